"""Sparse MLA (DSA) for Hopper in CuTe DSL: host side (checks, split planning, compile cache, launch).

The kernels give each CTA 64 heads of one query token and one split of that token's top-k:
- sparse_mla_kernel.py (bf16/fp16 caches, the "first slice"): a cp.async producer warpgroup gathers the
  selected cache rows into a swizzled smem ring and two consumer warpgroups split every tile's QK and PV in
  halves;
- sparse_mla_seesaw_kernel.py (bf16/fp16 caches, used by default; `_kernel(..., seesaw=False)` picks the
  first slice): the same gather with the dense decode kernel's seesaw consumers (each consumer owns every
  other tile's whole S and softmax, both add its P V). Not yet run on a GPU;
- sparse_mla_fp8_kernel.py (the FP8 656-byte cache): a loader warpgroup gathers the rows' raw bytes the same
  way and dequantizes them into a bf16 tile for the same consumers.
Their docstrings have the designs. Splits are merged by the Triton sparse kernel's `_combine_splits_kernel`,
so there is one merge in the repo.

Supported here (anything else raises ValueError naming the values): q bf16/fp16 [b, s_q, h, 576] with any
h, kv_cache [pages, page_size, 576] in q's dtype, or uint8 [pages, page_size, 656] (FP8, bf16 q only), with
contiguous rows and pages (any page size: slots are page * page_size + offset of the flattened cache),
indices int32 [b, s_q, topk], head_dim_v 512. `nvidia-cutlass-dsl` is imported on the first launch only:
checks and planning work without it.
"""

import importlib
import time
from dataclasses import dataclass

import torch
import triton

from mlaserve.kernels.cutedsl.common import D_QK, HEAD_DIM_V, check_query, cute_dtype, gmem_pointers
from mlaserve.kernels.triton.sparse_mla import choose_num_splits

TILE_M = 64            # heads per CTA
TILE_N = 64            # gathered rows per pipeline stage
MAX_SPLITS = 65535     # the split rides on the grid's y axis
MAX_CTAS = 2 ** 31 - 1  # head blocks x tokens on the grid's x axis
# blocks of 64 heads (out, or the fp32 split partials) stored 16 bytes at a time after a transpose within each quad
# (False: value by value; for A/B runs)
STORE_16B = True
# the bf16/fp16 seesaw kernel's softmax switches, the dense decode's of the same names (mla_decode.py; on there
# since bench/NOTES.md 93): LAZY_RESCALE, a row's max moves only when it rises by more than 2^8 and O's rescale is
# skipped in warps where none moved; TREE_MAX, each row's max folded pairwise. On the H200 (NOTES 97) the two
# together were 0.6-1.8% faster (lazy alone 0.3-1.2%, tree alone -0.5 to +0.6%) at b128 h128, b64 h128 s_q2, b128 h64
LAZY_RESCALE = True
TREE_MAX = True
# the FP8 cache's kernel with its bf16 tile as three column-half slots and one raw buffer held in the loader's
# registers (sparse_mla_fp8_kernel.py, "The half ring"; the dense decode's mla_decode.FP8_HALF_RING, 1.03-1.06x
# there), against one whole tile and two raw stages. The same bits. On an H100 (bench/NOTES.md 125; decode_ab,
# --sustain-ms 20, s_q 1, top-k 2048): b64 h128 / b128 h64 1.062 / 1.004x (False: for A/B runs)
FP8_HALF_RING = True
# the FP8 cache's kernel with its consumers' softmax on one barrier a page where no row's max rises by more than 2^8
# (split_consumers.one_barrier_p; the dense decode's mla_decode.FP8_ONE_BARRIER), against two barriers every page.
# Not the same bits (the running max is lazy). On an H100 (bench/NOTES.md 127; decode_ab, --sustain-ms 20, on the
# half ring, top-k 2048): b64 h128 / b128 h64 / b64 h128 s_q2 1.009 / 1.008 / 1.011x (False: for A/B runs)
FP8_ONE_BARRIER = True
FP8_ROW_BYTES = 656
_LOG2E = 1.4426950408889634

# seconds spent compiling each specialization, by compile key (dtype, split, fp8 cache), with "first-slice"
# appended for the bf16/fp16 first-slice kernel (seesaw=False), "store16" for 16-byte stores and ("softmax", the
# seesaw's two switches) where either is on
compile_seconds: dict[tuple, float] = {}
_compiled: dict[tuple, object] = {}


@dataclass(frozen=True)
class SparseSplitPlan:
    """How one call divides each token's top-k: `num_splits` runs of `split_len` indices (a multiple of
    TILE_N; the last run may be shorter)."""
    num_splits: int
    split_len: int


def check_supported(q_shape, q_dtype: torch.dtype, kv_shape, kv_dtype: torch.dtype, indices_shape,
                    indices_dtype: torch.dtype, head_dim_v: int) -> None:
    """Raise ValueError naming the values when this kernel cannot take these shapes/dtypes."""
    check_query("cutedsl sparse MLA", q_shape, q_dtype, head_dim_v)
    if kv_dtype == torch.uint8:
        if q_dtype != torch.bfloat16:
            raise ValueError(f"the cutedsl sparse MLA reads the FP8 KV cache with bf16 q, got {q_dtype}")
        if len(kv_shape) != 3 or kv_shape[2] != FP8_ROW_BYTES:
            raise ValueError(f"the cutedsl sparse MLA needs an FP8 kv_cache uint8 [pages, page_size, "
                             f"{FP8_ROW_BYTES}], got shape {tuple(kv_shape)}")
    else:
        if kv_dtype != q_dtype:
            raise ValueError(f"kv_cache dtype {kv_dtype} must match q dtype {q_dtype}")
        if len(kv_shape) != 3 or kv_shape[2] != D_QK:
            raise ValueError(f"the cutedsl sparse MLA needs kv_cache [pages, page_size, {D_QK}], "
                             f"got shape {tuple(kv_shape)}")
    if indices_dtype != torch.int32:
        raise ValueError(f"indices must be int32, got {indices_dtype}")
    if len(indices_shape) != 3 or tuple(indices_shape[:2]) != tuple(q_shape[:2]) or indices_shape[2] < 1:
        raise ValueError(f"indices shape {tuple(indices_shape)} must be [b, s_q, topk >= 1] with q's "
                         f"b, s_q = {tuple(q_shape[:2])}")
    b, s_q, h, _ = q_shape
    ctas = triton.cdiv(h, TILE_M) * b * s_q
    if ctas > MAX_CTAS:
        raise ValueError(f"the cutedsl sparse MLA launches at most {MAX_CTAS} CTAs per split, got "
                         f"{ctas} (b {b} x s_q {s_q} x {triton.cdiv(h, TILE_M)} head blocks)")


def plan_splits(tokens: int, h: int, topk: int, num_sms: int, num_splits: int | None = None) -> SparseSplitPlan:
    """Top-k splits from shapes only (CUDA-graph safe): the Triton kernel's rule with this kernel's
    64-head CTAs and 64-row tiles; `num_splits` forces a count (clamped to the tiles there are)."""
    tiles = triton.cdiv(topk, TILE_N)
    if num_splits is None:
        num_splits = choose_num_splits(tokens * triton.cdiv(h, TILE_M), tiles, num_sms)
    elif not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    splits = min(num_splits, tiles)
    split_len = triton.cdiv(tiles, splits) * TILE_N
    plan = SparseSplitPlan(num_splits=triton.cdiv(topk, split_len), split_len=split_len)
    # the kernel indexes out, the split partials and the indices with 32-bit offsets
    if plan.num_splits * tokens * h * HEAD_DIM_V >= 2 ** 31 or tokens * topk >= 2 ** 31:
        raise ValueError(f"the cutedsl sparse MLA indexes with 32-bit offsets: {plan.num_splits} splits x "
                         f"{tokens} tokens x h {h} x {HEAD_DIM_V} outputs (or x topk {topk} indices) is too many; "
                         f"call it on fewer tokens at a time")
    return plan


def _kernel(dtype: torch.dtype, split: bool, fp8: bool = False, seesaw: bool = True, store16: bool = False,
            softmax: tuple[bool, bool] = (False, False)):
    """The compiled kernel for one specialization (compiled on first use, then cached). `seesaw` picks the
    bf16/fp16 kernel (the FP8 cache has one kernel and ignores it); `store16` (unsplit): O in 16-byte stores;
    `softmax`: (lazy rescale, tree max) for the seesaw (the first-slice and FP8 kernels have neither)."""
    key = (dtype, split, fp8) if seesaw or fp8 else (dtype, split, fp8, "first-slice")
    if store16:
        key += ("store16",)
    if fp8 and FP8_HALF_RING:
        key += ("half-ring",)
    if fp8 and FP8_ONE_BARRIER:
        key += ("one-barrier",)
    softmax = softmax if seesaw and not fp8 else (False, False)
    if any(softmax):
        key += ("softmax",) + softmax
    fn = _compiled.get(key)
    if fn is None:
        cutlass = importlib.import_module("cutlass")
        cute = importlib.import_module("cutlass.cute")
        cuda = importlib.import_module("cuda.bindings.driver")
        # compile-time stand-ins: only the pointers' types and alignments matter
        scalars = (*(cutlass.Int32(1) for _ in range(6)), cutlass.Float32(1.0), cuda.CUstream(0))
        if fp8:
            kernel = importlib.import_module("mlaserve.kernels.cutedsl.sparse_mla_fp8_kernel").SparseMLAFP8Sm90(
                is_split=split, store16=store16, half_ring=FP8_HALF_RING, one_barrier=FP8_ONE_BARRIER)
        elif seesaw:
            kernel = importlib.import_module("mlaserve.kernels.cutedsl.sparse_mla_seesaw_kernel").SparseMLASeesawSm90(
                cute_dtype(dtype), is_split=split, store16=store16, lazy_rescale=softmax[0], tree_max=softmax[1])
        else:
            kernel = importlib.import_module("mlaserve.kernels.cutedsl.sparse_mla_kernel").SparseMLASm90(
                cute_dtype(dtype), is_split=split, store16=store16)
        t0 = time.perf_counter()
        fn = cute.compile(kernel, *_pointers(dtype, (None,) * 7, fp8), *scalars)
        compile_seconds[key] = time.perf_counter() - t0
        _compiled[key] = fn
    return fn


def _pointers(dtype: torch.dtype, addresses, fp8: bool = False) -> list:
    """Global-memory pointers for the kernel's 7 tensor arguments (q, kv, indices, out, lse, partial out,
    partial lse) from their addresses (None: a stand-in for compiling). q (TMA) and kv (16-byte cp.async)
    are 16-byte aligned (sparse_mla checks), the rest 4-byte. An FP8 cache is passed as int32 words."""
    cutlass = importlib.import_module("cutlass")
    elem = cute_dtype(dtype)
    kinds = ((elem, 16), (cutlass.Int32 if fp8 else elem, 16), (cutlass.Int32, 4), (elem, 4),
             (cutlass.Float32, 4), (cutlass.Float32, 4), (cutlass.Float32, 4))
    return gmem_pointers(kinds, addresses)


def sparse_mla(q, kv_cache, indices, softmax_scale, head_dim_v=512, *, num_splits: int | None = None):
    """Absorbed MLA over the cache slots each query token selected (semantics of
    mlaserve.kernels.reference.sparse_mla).

    q [b, s_q, h, 576] bf16/fp16; kv_cache [pages, page_size, 576] in q's dtype, or the FP8 cache uint8
    [pages, page_size, 656] with bf16 q; indices int32 [b, s_q, topk]
    of slot ids page * page_size + offset, -1 = unused (anywhere in the row). Returns out [b, s_q, h, 512]
    in q's dtype and lse float32 [b, s_q, h] (natural log; out 0 and lse -inf for a token whose indices
    are all -1). `num_splits` forces the top-k split count (None: from shapes).
    """
    check_supported(q.shape, q.dtype, kv_cache.shape, kv_cache.dtype, indices.shape, indices.dtype, head_dim_v)
    if q.device.type != "cuda":
        raise ValueError(f"the cutedsl sparse MLA runs on CUDA tensors (a Hopper GPU), got {q.device}")
    row = kv_cache.shape[2]
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != row or kv_cache.stride(0) != kv_cache.shape[1] * row:
        raise ValueError(f"kv_cache must have contiguous rows and pages, got strides {kv_cache.stride()}")
    b, s_q, h, _ = q.shape
    topk = indices.shape[2]
    tokens = b * s_q
    q = q.contiguous()
    indices = indices.contiguous()
    for name, t in (("q", q), ("kv_cache", kv_cache)):
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must start on a 16-byte boundary, got address {t.data_ptr():#x}")
    plan = plan_splits(tokens, h, topk, torch.cuda.get_device_properties(q.device).multi_processor_count,
                       num_splits)
    out = torch.empty(b, s_q, h, HEAD_DIM_V, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, s_q, h, dtype=torch.float32, device=q.device)
    if tokens == 0:
        return out, lse
    split = plan.num_splits > 1
    if split:
        po = torch.empty(plan.num_splits, tokens, h, HEAD_DIM_V, dtype=torch.float32, device=q.device)
        pl = torch.empty(plan.num_splits, tokens, h, dtype=torch.float32, device=q.device)
    else:
        po, pl = lse, lse          # unused pointers
    cutlass = importlib.import_module("cutlass")
    cuda = importlib.import_module("cuda.bindings.driver")
    num_slots = kv_cache.shape[0] * kv_cache.shape[1]
    addresses = [t.data_ptr() for t in (q, kv_cache, indices, out, lse, po, pl)]
    fp8 = kv_cache.dtype == torch.uint8
    fn = _kernel(q.dtype, split, fp8, store16=STORE_16B, softmax=(LAZY_RESCALE, TREE_MAX))
    fn(*_pointers(q.dtype, addresses, fp8),
       cutlass.Int32(tokens), cutlass.Int32(h), cutlass.Int32(num_slots), cutlass.Int32(topk),
       cutlass.Int32(plan.num_splits), cutlass.Int32(plan.split_len), cutlass.Float32(softmax_scale * _LOG2E),
       cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream))
    if split:
        _combine(po, pl, out, lse)
    return out, lse


def _combine(po: torch.Tensor, pl: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """out [b, s_q, h, 512], lse [b, s_q, h] from per-split partials po f32 [splits, tokens, h, 512] and
    pl f32 [splits, tokens, h] (the Triton sparse kernel's merge)."""
    from mlaserve.kernels.triton.sparse_mla import _combine_splits_kernel
    splits = po.shape[0]
    rows = out.numel() // HEAD_DIM_V
    _combine_splits_kernel[(rows,)](po, pl, out, lse, splits, rows, DV=HEAD_DIM_V, BLOCK_DV=HEAD_DIM_V,
                                    SPLITS_P2=triton.next_power_of_2(splits), num_warps=4)
