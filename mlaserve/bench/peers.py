"""Peer libraries timed in the same run as mlaserve's kernels: FlashInfer, FlashMLA and SGLang's Triton decode.

flashinfer: `BatchMLAPagedAttentionWrapper(backend="fa3")` through mlaserve's adapter
  (attention/flashinfer_backend.py). Dense MLA decode over the same paged cache; sparse MLA with
  page_size=1, each query token one request whose pages are its top-k slots (exact, as SGLang's fa3
  DSA backend drives FA3). FP8 shapes use FlashInfer's own FP8 layout, converted from mlaserve's
  656-byte rows: c_kv e4m3 with the same 4 per-128 scales, but k_pe in e4m3 with one per-tensor scale
  (mlaserve keeps k_pe in bf16); it is checked against a reference on its own dequantized values.
flashmla: DeepSeek's FlashMLA as SGLang ships it (the `sgl-flash-mla` wheel, package `flash_mla`), on the
  kernels its `use_legacy=True` side keeps for SM90. Dense decode over the same paged bf16 cache (its split
  schedule made once, untimed, as a serving step makes it once for all layers); sparse decode
  over mlaserve's own FP8 cache, which is DeepSeek-V3.2's 656-byte row byte for byte (FlashMLA's "V32"
  format), indices the same slot ids; sparse prefill over the bf16 pool. Dense FP8 runs the fork's SM90 dense
  FP8 kernel, which reads its own layout: q and KV in e4m3 with one per-tensor scale each (576-byte rows),
  converted from mlaserve's rows and checked against a reference on the values that layout stands for.
  FlashMLA has no sparse decode over bf16 caches.
sglang: `decode_attention_fwd` from SGLang's `triton_ops/decode_attention.py`, loaded at run time from
  a carried SGLang wheel (never vendored): its only SGLang import is `is_hip`, stubbed for the load.
  Token-level paging (its page size is 1): each query token is its own request over its causal
  prefix, so s_q = 2 is exact too; KV splits per request follow SGLang's heuristic (max 8 splits,
  its `--triton-attention-num-kv-splits` default). Dense bf16 only.
"""

import glob
import math
import os
import sys
import tempfile
import types
import zipfile
from pathlib import Path

import torch

from mlaserve.attention import flashinfer_backend
from mlaserve.attention.flashinfer_backend import CsrPaging, FlashInferMLA
from mlaserve.bench.inputs import DenseInputs, SparseInputs
from mlaserve.bench.runners import Prepared, Subset, Unsupported, reference
from mlaserve.bench.shapes import D_V, DenseShape, Shape, SparseShape
from mlaserve.kernels import fp8_format

PEERS = ("flashinfer", "flashmla", "sglang")
SGLANG_MEMBER = "sglang/srt/layers/attention/triton_ops/decode_attention.py"
SGLANG_MAX_KV_SPLITS = 8
FLASHINFER_FP8_ROW_BYTES = fp8_format.KV_LORA_RANK + fp8_format.ROPE_DIM + 4 * fp8_format.NUM_TILES  # 592
FLASHMLA_FP8_ROW_BYTES = fp8_format.D_QK   # 576 e4m3, one scale for the whole cache
FLASHMLA_PAGE_SIZE = 64                    # its dense decode's only page size
_REPO = Path(__file__).resolve().parents[2]


def unavailable_reason(name: str, device: torch.device) -> str | None:
    if name == "flashinfer":
        return flashinfer_backend.unavailable_reason(device, torch.bfloat16)
    if name == "flashmla":
        return flashmla_unavailable_reason(device)
    if name == "sglang":
        if device.type != "cuda":
            return f"SGLang's Triton decode kernel runs on CUDA; got {device.type}"
        if find_sglang_wheel() is None:
            return ("no SGLang wheel found (set MLASERVE_SGLANG_WHEEL, or put sglang-*.whl under .peers/sglang/ "
                    "with scripts/pack_for_device.sh)")
        try:
            load_sglang_decode()
        except Exception as e:   # any failure to load it is the reason the peer is not timed
            return f"cannot load SGLang's decode_attention.py: {type(e).__name__}: {e}"
        return None
    raise ValueError(f"unknown peer {name!r}; known: {PEERS}")


def version(name: str) -> str | None:
    try:
        if name == "flashinfer":
            import flashinfer
            return flashinfer.__version__
        if name == "flashmla":
            import flash_mla
            return flash_mla.__version__
        wheel = find_sglang_wheel()
        return None if wheel is None else Path(wheel).name.split("-")[1]
    except Exception as e:      # a version string is informative only
        return f"unknown ({type(e).__name__})"


def prepare(name: str, shape: Shape, inputs) -> Prepared:
    if name == "flashinfer":
        return _prepare_flashinfer(shape, inputs)
    if name == "flashmla":
        return _prepare_flashmla(shape, inputs)
    if name == "sglang":
        return _prepare_sglang(shape, inputs)
    raise ValueError(f"unknown peer {name!r}")


# -- FlashInfer --

_FLASHINFER: dict[torch.device, FlashInferMLA] = {}


def _flashinfer(device: torch.device) -> FlashInferMLA:
    if device not in _FLASHINFER:
        _FLASHINFER[device] = FlashInferMLA(device)
    return _FLASHINFER[device]


def flashinfer_fp8_cache(packed: torch.Tensor):
    """mlaserve FP8 rows uint8 [..., 656] -> FlashInfer's layout: (ckv e4m3 [..., 512], ckv scales f32 [..., 4],
    kpe e4m3 [..., 64], kpe per-tensor scale)."""
    ckv = packed[..., :fp8_format.SCALE_OFFSET].contiguous().view(torch.float8_e4m3fn)
    scales = packed[..., fp8_format.SCALE_OFFSET:fp8_format.ROPE_OFFSET].contiguous().view(torch.float32)
    kpe = packed[..., fp8_format.ROPE_OFFSET:].contiguous().view(torch.bfloat16).float()
    kpe_scale = float(kpe.abs().amax().clamp_min(1e-8)) / fp8_format.E4M3_MAX
    kpe8 = (kpe / kpe_scale).clamp(-fp8_format.E4M3_MAX, fp8_format.E4M3_MAX).to(torch.float8_e4m3fn)
    return ckv, scales, kpe8, kpe_scale


def flashinfer_fp8_dequant(ckv, scales, kpe8, kpe_scale) -> torch.Tensor:
    """The float32 [..., 576] values FlashInfer's FP8 layout stands for."""
    c = ckv.float().unflatten(-1, (fp8_format.NUM_TILES, fp8_format.TILE)) * scales[..., None]
    return torch.cat([c.flatten(-2), kpe8.float() * kpe_scale], dim=-1)


def warm_flashinfer(device: str = "cuda") -> None:
    """JIT-build FlashInfer's bf16 and FP8 MLA modules ahead of the benchmark (its on-disk cache keeps them),
    so that scripts/device_run.sh can overlap the ~20 s builds with the GPU tests."""
    import time
    from mlaserve.bench.inputs import make_dense
    for kv in ("bf16", "fp8"):
        t0 = time.perf_counter()
        shape = DenseShape(2, 1, 256, 16, kv)
        prepared = _prepare_flashinfer(shape, make_dense(shape, torch.device(device), 0, 0))
        out, lse = prepared.calls[0]()
        torch.cuda.synchronize()
        print(f"flashinfer {kv}: built and ran in {time.perf_counter() - t0:.1f} s, out {tuple(out.shape)}, "
              f"finite {bool(torch.isfinite(out).all())}", flush=True)


def _prepare_flashinfer(shape: Shape, inputs) -> Prepared:
    if not isinstance(shape, (DenseShape, SparseShape)):
        raise Unsupported("FlashInfer has no Hopper DSA indexer in mlaserve's peer set")
    if shape.d_v != D_V:
        raise Unsupported(f"mlaserve drives FlashInfer's MLA at d_v 512 only, got {shape.d_v}")
    device = inputs.q[0].device
    mla = _flashinfer(device)
    b, s_q, h, d = inputs.q[0].shape
    tokens = b * s_q
    if isinstance(shape, DenseShape):
        di: DenseInputs = inputs
        p = di.paging
        paging = CsrPaging.from_block_table(p.block_table, p.seqlens_cpu, torch.full((b,), s_q, dtype=torch.int32),
                                            p.page_size)
        page_size, causal, caches = p.page_size, True, di.kv
    else:
        si: SparseInputs = inputs
        paging = CsrPaging.from_sparse_indices(si.indices.reshape(tokens, -1))
        page_size, causal = 1, False
        caches = [kv.view(-1, 1, kv.shape[-1]) for kv in si.kv]     # one slot per "page"
    kv_dtype = torch.float8_e4m3fn if shape.kv == "fp8" else inputs.q[0].dtype
    mla.plan(paging, num_heads=h, page_size=page_size, causal=causal, sm_scale=inputs.scale,
             dtype=inputs.q[0].dtype, kv_dtype=kv_dtype)

    def shaped(result):
        out, lse = result
        return out.view(b, s_q, h, -1), lse.view(b, s_q, h)

    if shape.kv == "bf16":
        calls = [lambda q=q, kv=kv: shaped(mla.run(q.view(tokens, h, d), kv)) for q, kv in zip(inputs.q, caches)]
        return Prepared(calls, note="FlashInfer fa3" + (", page_size=1 per top-k slot" if page_size == 1 else ""))
    converted = [flashinfer_fp8_cache(kv) for kv in caches]
    calls = [lambda q=q, c=c: shaped(mla.run_split(q.view(tokens, h, d), c[0], c[2], ckv_scale_arr=c[1],
                                                   kpe_scale=c[3]))
             for q, c in zip(inputs.q, converted)]

    def own_reference(subset: Subset):
        # the same problem on float32 copies of the values FlashInfer's FP8 cache stands for
        equiv = flashinfer_fp8_dequant(*converted[0]).view(*inputs.kv[0].shape[:-1], -1)
        q32 = [inputs.q[0].float()]
        if isinstance(shape, DenseShape):
            as_f32 = DenseInputs(q=q32, kv=[equiv], paging=inputs.paging, scale=inputs.scale)
        else:
            as_f32 = SparseInputs(q=q32, kv=[equiv], indices=inputs.indices, scale=inputs.scale)
        out, lse = reference(shape, as_f32, subset)
        return out.to(inputs.q[0].dtype), lse

    return Prepared(calls, reference=own_reference, kv_row_bytes=FLASHINFER_FP8_ROW_BYTES,
                    note="FlashInfer's own FP8 layout (k_pe e4m3, per-tensor scale), converted from mlaserve's")


# -- FlashMLA --

def flashmla_unavailable_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"FlashMLA runs on CUDA; got {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"mlaserve drives FlashMLA's SM90 kernels (its legacy side); this GPU is sm_{major}{minor}"
    try:
        import flash_mla
    except Exception as e:   # any failure to load it is the reason the peer is not timed
        return (f"cannot import flash_mla ({type(e).__name__}: {str(e)[:200]}); install the sgl-flash-mla wheel "
                f"with --no-deps (scripts/pack_for_device.sh packs it into .peers/flashmla/)")
    if not flash_mla.has_legacy():
        return "this flash_mla build has no legacy (SM90) kernels"
    return None


def flashmla_fp8_cache(packed: torch.Tensor, chunk_rows: int = 1 << 20):
    """mlaserve FP8 rows uint8 [..., 656] -> FlashMLA's dense FP8 layout: (e4m3 [..., 576], its per-tensor scale,
    float32 [1]). Dequantized and requantized in chunks of rows, so that no float32 copy of the cache is made."""
    flat = packed.reshape(-1, fp8_format.PACKED_BYTES)
    amax = torch.zeros((), dtype=torch.float32, device=packed.device)

    def values(start: int) -> torch.Tensor:
        return fp8_format.dequantize(flat[start:start + chunk_rows], torch.float32, exact=True)

    for start in range(0, flat.shape[0], chunk_rows):
        amax = torch.maximum(amax, values(start).abs().amax())
    scale = (amax / fp8_format.E4M3_MAX).clamp_min(1e-12).reshape(1)
    out = torch.empty(flat.shape[0], fp8_format.D_QK, dtype=torch.float8_e4m3fn, device=packed.device)
    for start in range(0, flat.shape[0], chunk_rows):
        rows = values(start)
        out[start:start + chunk_rows] = (rows / scale).clamp(-fp8_format.E4M3_MAX, fp8_format.E4M3_MAX) \
            .to(torch.float8_e4m3fn)
    return out.view(*packed.shape[:-1], fp8_format.D_QK), scale


def flashmla_fp8_q(q: torch.Tensor):
    """q bf16 [b, s_q, h, 576] -> (e4m3 q, its per-tensor scale float32 [1]), as FlashMLA's dense FP8 kernel reads."""
    scale = (q.float().abs().amax() / fp8_format.E4M3_MAX).clamp_min(1e-12).reshape(1)
    return (q.float() / scale).clamp(-fp8_format.E4M3_MAX, fp8_format.E4M3_MAX).to(torch.float8_e4m3fn), scale


def _flashmla_meta(flash_mla, seqlens: torch.Tensor, s_q: int, h: int, fp8: bool, topk: int | None = None):
    """FlashMLA's split schedule for a step, made and waited for ahead of the timed calls, as SGLang's FlashMLA backend
    plans it once a step for all layers (left to the decode call, the first call makes it)."""
    meta = flash_mla.get_mla_metadata()[0]
    meta.tile_scheduler_metadata, meta.num_splits = flash_mla.get_mla_decoding_metadata(
        seqlens, s_q * h, 1, h_q=h, is_fp8_kvcache=fp8, topk=topk, use_legacy=True)
    torch.cuda.synchronize(seqlens.device)
    return meta


def _prepare_flashmla(shape: Shape, inputs) -> Prepared:
    if not isinstance(shape, (DenseShape, SparseShape)):
        raise Unsupported("FlashMLA has no DSA indexer")
    if (shape.d_qk, shape.d_v) != (fp8_format.D_QK, D_V):
        raise Unsupported(f"FlashMLA's SM90 kernels take d_qk 576, d_v 512; got {shape.d_qk}/{shape.d_v}")
    import flash_mla
    if isinstance(shape, SparseShape):
        return _prepare_flashmla_sparse(flash_mla, shape, inputs)
    di: DenseInputs = inputs
    p = di.paging
    if p.page_size != FLASHMLA_PAGE_SIZE:
        raise Unsupported(f"FlashMLA's dense decode takes page size {FLASHMLA_PAGE_SIZE}; got {p.page_size}")
    b, s_q, h, d = di.q[0].shape
    meta = _flashmla_meta(flash_mla, p.seqlens, s_q, h, shape.kv == "fp8")

    def shaped(result):
        out, lse = result
        return out, lse.transpose(1, 2)     # lse [b, h, s_q] -> [b, s_q, h]

    if shape.kv == "bf16":
        def call(q, kv):
            return shaped(flash_mla.flash_mla_with_kvcache(
                q, kv.view(*kv.shape[:2], 1, d), p.block_table, p.seqlens, shape.d_v, meta,
                softmax_scale=di.scale, causal=True, use_legacy=True))
        return Prepared([lambda q=q, kv=kv: call(q, kv) for q, kv in zip(di.q, di.kv)],
                        note="FlashMLA (sgl-flash-mla, legacy SM90 dense decode); metadata planned once, untimed")
    converted = [(flashmla_fp8_q(q), flashmla_fp8_cache(kv)) for q, kv in zip(di.q, di.kv)]

    def call_fp8(q8, q_scale, kv8, kv_scale):
        return shaped(flash_mla.flash_mla_with_kvcache(
            q8, kv8.view(*kv8.shape[:2], 1, d), p.block_table, p.seqlens, shape.d_v, meta,
            softmax_scale=di.scale, causal=True, is_fp8_kvcache=True, use_legacy=True,
            descale_q=q_scale, descale_k=kv_scale))

    def own_reference(subset: Subset):
        (q8, q_scale), (kv8, kv_scale) = converted[0]
        as_f32 = DenseInputs(q=[q8.float() * q_scale], kv=[kv8.float() * kv_scale], paging=p, scale=di.scale)
        out, lse = reference(shape, as_f32, subset)
        return out.to(di.q[0].dtype), lse

    return Prepared([lambda c=c: call_fp8(*c[0], *c[1]) for c in converted], reference=own_reference,
                    kv_row_bytes=FLASHMLA_FP8_ROW_BYTES,
                    note="FlashMLA's SM90 dense FP8 kernel (sgl-flash-mla): q and KV e4m3 with per-tensor scales, "
                         "converted from mlaserve's rows")


def _prepare_flashmla_sparse(flash_mla, shape: SparseShape, inputs) -> Prepared:
    si: SparseInputs = inputs
    b, s_q, h, d = si.q[0].shape
    if shape.phase == "prefill":
        if shape.kv != "bf16":
            raise Unsupported("FlashMLA's sparse prefill reads a bf16 pool")

        def prefill(q, kv):
            out, _, lse = flash_mla.flash_mla_sparse_fwd(
                q.view(b * s_q, h, d), kv.view(-1, 1, d), si.indices.view(b * s_q, 1, -1), si.scale, shape.d_v,
                use_legacy=True)
            return out.view(b, s_q, h, -1), lse.view(b, s_q, h)
        return Prepared([lambda q=q, kv=kv: prefill(q, kv) for q, kv in zip(si.q, si.kv)],
                        note="FlashMLA (sgl-flash-mla, legacy SM90 sparse prefill)")
    if shape.kv != "fp8":
        raise Unsupported("FlashMLA's sparse decode reads the FP8 656-byte (V3.2) cache only")
    meta = _flashmla_meta(flash_mla, torch.full((b,), shape.s_kv, dtype=torch.int32, device=si.q[0].device), s_q,
                          h, True, topk=si.indices.shape[-1])

    def decode(q, kv):
        out, lse = flash_mla.flash_mla_with_kvcache(
            q, kv.view(-1, shape.page_size, 1, kv.shape[-1]), None, None, shape.d_v, meta, softmax_scale=si.scale,
            causal=False, is_fp8_kvcache=True, indices=si.indices, use_legacy=True, kv_format="V32")
        return out, lse.transpose(1, 2)     # lse [b, h, s_q] -> [b, s_q, h]
    return Prepared([lambda q=q, kv=kv: decode(q, kv) for q, kv in zip(si.q, si.kv)],
                    note="FlashMLA (sgl-flash-mla, legacy SM90 sparse decode) on mlaserve's FP8 rows (its V32 format)")


# -- SGLang --

_SGLANG_MODULE: list = []


def find_sglang_wheel() -> str | None:
    env = os.environ.get("MLASERVE_SGLANG_WHEEL")
    if env:
        return env if os.path.isfile(env) else None
    for root in (Path.cwd(), _REPO):
        found = sorted(glob.glob(str(root / ".peers" / "sglang" / "sglang-*.whl")))
        if found:
            return found[-1]
    return None


def load_sglang_decode():
    """SGLang's decode_attention module, extracted from the carried wheel into a temp dir and imported alone."""
    if _SGLANG_MODULE:
        return _SGLANG_MODULE[0]
    wheel = find_sglang_wheel()
    if wheel is None:
        raise FileNotFoundError("no SGLang wheel")
    folder = tempfile.mkdtemp(prefix="mlaserve-sglang-")
    with zipfile.ZipFile(wheel) as z:
        path = z.extract(SGLANG_MEMBER, folder)
    # Its one SGLang import is `from sglang.srt.utils import is_hip`; stub just that for the load when
    # SGLang itself is absent, then remove the stubs again.
    stubs = {}
    if "sglang.srt.utils" not in sys.modules:
        for name in ("sglang", "sglang.srt", "sglang.srt.utils"):
            stubs[name] = types.ModuleType(name)
        stubs["sglang.srt.utils"].is_hip = lambda: False
    import importlib.util
    spec = importlib.util.spec_from_file_location("mlaserve_peer_sglang_decode_attention", path)
    module = importlib.util.module_from_spec(spec)
    added = [n for n in stubs if n not in sys.modules]
    sys.modules.update({n: stubs[n] for n in added})
    try:
        spec.loader.exec_module(module)
    finally:
        for n in added:
            sys.modules.pop(n, None)
    _SGLANG_MODULE.append(module)
    return module


def sglang_num_kv_splits(lens: list[int], num_heads: int, sm_count: int,
                         max_kv_splits: int = SGLANG_MAX_KV_SPLITS) -> list[int]:
    """KV splits per request the way SGLang's triton backend chooses them (its get_num_kv_splits heuristic):
    enough splits to balance short against long requests, and to give the grid about
    sm_count * log2(max_len / 64) programs, capped at max_kv_splits."""
    longest, shortest = max(lens), max(1, min(lens))
    if longest * 8 < shortest * 10:
        shortest = longest
    chunk_balance = math.ceil(longest / min(math.ceil(longest / shortest), max_kv_splits))
    cores = int(sm_count * max(math.log2(longest / 64.0), 1.0))
    grid = len(lens) * math.ceil(num_heads / min(16, num_heads))
    chunk_fill = math.ceil(longest / min(math.ceil(cores / grid), max_kv_splits))
    return [max(math.ceil(n / chunk_balance), math.ceil(n / chunk_fill)) for n in lens]


def _prepare_sglang(shape: Shape, inputs) -> Prepared:
    if not isinstance(shape, DenseShape):
        raise Unsupported("SGLang's Triton kernel here is the dense decode one")
    if shape.kv != "bf16":
        raise Unsupported("SGLang's Triton decode reads bf16 KV (its FP8 KV is per-tensor scaled, not mlaserve's rows)")
    di: DenseInputs = inputs
    if di.kv[0].numel() >= 2 ** 31:
        # seen on the H200: an illegal address at b128 s_k 32768 (2.4e9 elements), which also ends the process
        raise Unsupported(f"SGLang's Triton decode indexes the KV buffer with 32-bit offsets; this one has "
                          f"{di.kv[0].numel()} elements (>= 2^31)")
    mod = load_sglang_decode()
    p = di.paging
    device = di.q[0].device
    b, s_q, h, d = di.q[0].shape
    # each query token is a request over its causal prefix
    lens, slots = [], []
    for i, n in enumerate(p.seqlens_cpu.tolist()):
        all_slots = p.slots(i, torch.arange(n, device=device)).to(torch.int32)
        for j in range(s_q):
            lens.append(n - s_q + j + 1)
            slots.append(all_slots[:lens[-1]])
    tokens = len(lens)
    kv_indices = torch.cat(slots)
    kv_indptr = torch.zeros(tokens + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(torch.tensor(lens), 0)
    kv_indptr = kv_indptr.to(device)
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    splits = torch.tensor(sglang_num_kv_splits(lens, h, sm_count), dtype=torch.int32, device=device)
    logits = torch.empty(tokens, h, SGLANG_MAX_KV_SPLITS, shape.d_v, dtype=torch.float32, device=device)
    lse = torch.empty(tokens, h, SGLANG_MAX_KV_SPLITS, dtype=torch.float32, device=device)

    def call(q, kv, o):
        k_buffer = kv.view(-1, 1, d)
        mod.decode_attention_fwd(q.view(tokens, h, d), k_buffer, k_buffer[..., :shape.d_v], o, kv_indptr,
                                 kv_indices, logits, lse, splits, SGLANG_MAX_KV_SPLITS, di.scale, 1.0, 1.0)
        return o.view(b, s_q, h, shape.d_v), None

    outs = [torch.empty(tokens, h, shape.d_v, dtype=di.q[0].dtype, device=device) for _ in di.q]
    return Prepared([lambda q=q, kv=kv, o=o: call(q, kv, o) for q, kv, o in zip(di.q, di.kv, outs)],
                    note=f"SGLang Triton decode, token paging, max {SGLANG_MAX_KV_SPLITS} KV splits, no lse")
