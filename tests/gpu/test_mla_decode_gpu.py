"""The Triton MLA decode kernel at real shapes on a GPU, against the torch reference; CUDA-graph capture.

Tolerances follow FlashMLA's tests: every output element within 1e-3 absolute or 2/128 relative, cosine
distance of the whole output <= 1e-5 (1e-4 with FP8 KV), lse within 2e-3; see `_check` for short requests and for
the two readings of an FP8 entry. Cache rows no request owns hold NaN (bf16) or 0xFF
bytes (NaN in e4m3, the fp32 scales and bf16 k_pe alike) and block-table entries past a request's
pages a poison page id, so a read outside a request's tokens shows up.
One command: python -m pytest -q tests/gpu/test_mla_decode_gpu.py
"""

import math

import pytest
import torch

from mlaserve import ops
from mlaserve.attention.base import BackendConfig
from mlaserve.attention.batch import BatchLayout
from mlaserve.kernels import fp8_format, reference
from mlaserve.kernels.triton import mla_decode_plan as tk

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SCALE = 192 ** -0.5
POISON_PAGE = 1 << 30


def _case(lens, page_size, s_q, h, kv_kind, seed):
    """-> q [b, s_q, h, 576] bf16, kv cache, block_table int32 [b, max_pages], seqlens int32 [b] (all on cuda)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    gen_cpu = torch.Generator().manual_seed(seed)
    pages = [math.ceil(n / page_size) for n in lens]
    num_pages = sum(pages) + 2
    order = torch.randperm(num_pages, generator=gen_cpu)
    table = torch.full((len(lens), max(pages) + 1), POISON_PAGE, dtype=torch.int32)
    owned = torch.zeros(num_pages * page_size, dtype=torch.bool)
    start = 0
    for i, (n, p) in enumerate(zip(lens, pages)):
        table[i, :p] = order[start:start + p].int()
        slots = table[i, :p].long()[:, None] * page_size + torch.arange(page_size)
        owned[slots.flatten()[:n]] = True
        start += p
    kv = torch.randn(num_pages, page_size, 576, device="cuda", generator=gen, dtype=torch.bfloat16)
    owned = owned.view(num_pages, page_size).cuda()
    if kv_kind == "fp8":
        kv = ops.quantize_kv_fp8(kv)
        kv[~owned] = 0xFF
    else:
        kv[~owned] = float("nan")
    q = torch.randn(len(lens), s_q, h, 576, device="cuda", generator=gen, dtype=torch.bfloat16)
    return q, kv, table.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")


def _check(out, lse, q, kv, table, seqlens, rows):
    """Compares requests `rows` of a kernel result (lse may be None) with the reference, computed for those only.

    FlashMLA's bounds, with absolute slack for rounding P (and FP8-dequantized rows) to bf16 before P·V: that
    moves an element by up to ~2^-8 of the output's magnitude, which a peaked softmax makes ~1 (short requests,
    and long ones whose scores single out a few keys: a 446-key h128 request once exceeded the bare bound,
    bench/NOTES.md 56), so each request gets 2^-7 (FP8 2^-6) of its largest output as slack, whatever its
    length. Requests of >= 256 keys must also meet the cosine bound.
    FP8 KV: an entry is e4m3 * scale, which the dequantizing kernels round to bf16 (fp8_format.dequantize) and
    the FP8-MMA kernel uses exactly; the result must meet the bounds against the reference on one of the two
    readings (they alone move a score by up to 2^-9 * SCALE * sum |q_i| |c_kv_i|, more than lse's 2e-3).
    """
    idx = torch.tensor(rows, device=out.device)
    if kv.dtype == torch.uint8:
        readings = {"bf16-rounded entries": kv, "exact entries": fp8_format.dequantize(kv, torch.float32, exact=True)}
    else:
        readings = {"": kv}
    why = {}
    for name, values in readings.items():
        ref_out, ref_lse = reference.mla_decode(q[idx], values, table[idx], seqlens[idx], SCALE, causal=True,
                                                head_dim_v=512)
        why[name] = _mismatch(out[idx].float(), None if lse is None else lse[idx], ref_out.float(), ref_lse,
                              seqlens[idx] >= 256, kv.dtype == torch.uint8)
        if why[name] is None:
            return
    raise AssertionError("; ".join(f"{k}: {v}" if k else v for k, v in why.items()))


def _mismatch(out, lse, ref_out, ref_lse, long, fp8):
    """None if (out, lse) meet the bounds against (ref_out, ref_lse), else what failed."""
    if out.isnan().any() or (lse is not None and lse.isnan().any()):
        return "NaN"
    empty = ref_lse == float("-inf")
    if lse is not None and not torch.equal(lse == float("-inf"), empty):
        return "empty rows differ"
    if not (out[empty] == 0).all():
        return "empty rows not 0"
    err = (out - ref_out).abs()
    slack = ((2 ** -6 if fp8 else 2 ** -7) * ref_out.abs().amax(dim=(1, 2, 3)))[:, None, None, None]
    bad = (err > 1e-3 + slack) & (err > (2 / 128) * ref_out.abs())
    if bad.any():
        return f"{int(bad.sum())} elements off; worst abs err {float(err.max()):.3g}"
    x, y = out[long].double().flatten(), ref_out[long].double().flatten()
    if x.numel():
        cos_dist = float(1 - 2 * (x @ y) / (x @ x + y @ y).clamp_min(1e-30))
        # FP8: the dequantizing kernels round rows (e4m3 * fp32 scale) to bf16, the reference keeps them in fp32
        limit = 1e-4 if fp8 else 1e-5
        if cos_dist > limit:
            return f"cosine distance {cos_dist:.3g} > {limit}"
    if lse is not None and (~empty).any():
        lse_err = float((lse[~empty] - ref_lse[~empty]).abs().max())
        if lse_err > 2e-3:
            return f"lse abs err {lse_err:.3g}"
    return None


CASES = [
    # b, s_q, s_k, h, kv, num_splits (None: the kernel's own choice)
    (128, 1, 4096, 128, "bf16", None),
    (128, 2, 8192, 16, "bf16", None),
    (128, 1, 4096, 64, "fp8", None),
    (128, 2, 4096, 32, "fp8", None),
    (4, 1, 32768, 128, "bf16", None),
    (1, 1, 32768, 16, "bf16", None),
    (16, 2, 32768, 128, "fp8", None),
    (4, 1, 32768, 16, "fp8", None),
    (3, 2, 20000, 64, "bf16", 1),
    (3, 2, 20000, 64, "bf16", 7),
    # rows per request that are no multiple of the Gluon kernel's 64-row tiles (padded, never stored)
    (5, 3, 5000, 20, "bf16", None),
    (6, 3, 3000, 128, "bf16", None),
    # 17-32 bf16 rows: the 64-row seesaw where its splits span >= 32 pages (b 128 s_q 2 h 16 above, b 16 here), the
    # narrow kernel with shorter splits (b 4)
    (16, 1, 20000, 32, "bf16", None),
    (4, 1, 32768, 32, "bf16", None),
    # 17-32 FP8 rows: the dequantizing warpgroup beside one compute warpgroup, unsplit, split, odd rows
    (128, 2, 4096, 16, "fp8", None),
    (4, 1, 32768, 32, "fp8", None),
    (5, 3, 3000, 7, "fp8", 2),
    (200, 1, 3000, 32, "fp8", 1),
    # <= 16 rows: the keys-on-M Gluon kernel, bf16 and FP8, split and not
    (3, 2, 5000, 8, "bf16", 2),
    (128, 1, 4096, 16, "fp8", None),
    (3, 2, 5000, 8, "fp8", 2),
    (5, 3, 3000, 5, "fp8", None),
    # <= 16 rows, FP8, s_q 1, split into runs of >= 64 pages: the FP8-MMA kernel (b 128 unsplit above too)
    (4, 1, 12000, 16, "fp8", 2),
    # more 64-row programs than SMs, ragged lengths, unsplit: the grid takes requests longest first (b 128 h 128
    # above too)
    (150, 2, 3000, 64, "fp8", 1),
    (140, 1, 3000, 128, "bf16", 1),
    # likewise for the narrow kernels (one program per request: more requests than SMs): bf16 32 rows, FP8 with the
    # dequantizing warpgroup (< 32 pages), the FP8-MMA kernel (>= 32 pages)
    (200, 2, 2000, 16, "bf16", 1),
    (200, 1, 1000, 16, "fp8", 1),
    (200, 1, 3000, 16, "fp8", 1),
]


@pytest.mark.parametrize("b,s_q,s_k,h,kv_kind,num_splits", CASES)
def test_matches_reference(b, s_q, s_k, h, kv_kind, num_splits):
    gen = torch.Generator().manual_seed(b * 7 + s_q + h)
    lens = torch.randint(s_k // 2, s_k * 3 // 2 + 1, (b,), generator=gen).tolist()
    lens[0] = s_k                                        # the nominal length
    if b > 2:
        lens[1], lens[2] = 1, 0                          # a first token that sees nothing (s_q 2); an empty request
    q, kv, table, seqlens = _case(lens, 64, s_q, h, kv_kind, seed=b + s_k + h)
    options = {} if num_splits is None else {"num_splits": num_splits}
    out, lse = ops.mla_decode(q, kv, table, seqlens, SCALE, causal=True, head_dim_v=512, backend="triton", **options)
    torch.cuda.synchronize()
    rows = list(range(min(b, 12)))
    _check(out, lse, q, kv, table, seqlens, rows)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_gluon_seesaw_16_byte_stores_equal_accumulator_layout_stores(monkeypatch, num_splits):
    """The seesaw kernel's O halves (or fp32 split partials) stored 16 bytes a thread through a ring stage
    (STORE_16B) give the same bits as stores from the accumulator's layout: 80 rows (a partial second block),
    lengths of 1-1500 keys, an empty request."""
    from mlaserve.kernels.triton import mla_decode_gluon_seesaw as ms
    lens = [1 + (389 * i) % 1500 for i in range(6)]
    lens[2] = 0
    q, kv, table, seqlens = _case(lens, 64, 2, 40, "bf16", seed=num_splits)

    def call():
        return ops.mla_decode(q, kv, table, seqlens, SCALE, causal=True, head_dim_v=512, backend="triton",
                              num_splits=num_splits)
    monkeypatch.setattr(ms, "STORE_16B", True)
    out, lse = call()
    monkeypatch.setattr(ms, "STORE_16B", False)
    out2, lse2 = call()
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    _check(out, lse, q, kv, table, seqlens, list(range(len(lens))))


@pytest.mark.parametrize("b, s_q, h, kv_kind, num_splits", [
    (8, 1, 128, "bf16", 1), (6, 2, 40, "bf16", 1), (4, 1, 128, "bf16", 4), (8, 2, 64, "fp8", 1), (3, 1, 80, "fp8", 3)])
def test_gluon_16_byte_stores_equal_accumulator_layout_stores(monkeypatch, b, s_q, h, kv_kind, num_splits):
    """The 64-row Gluon kernel's O (or fp32 split partials) converted to 16 bytes a thread before the stores
    (STORE_16B) gives the same bits as stores from the accumulator's layout (80 rows: a partial second block),
    over lengths of 1-1500 keys."""
    from mlaserve.kernels.triton import mla_decode_gluon as mg
    from mlaserve.kernels.triton import mla_decode_gluon_seesaw
    monkeypatch.setattr(mla_decode_gluon_seesaw, "SEESAW", False)    # bf16: the serial kernel, whose stores these are
    lens = [1 + (389 * i) % 1500 for i in range(b)]
    q, kv, table, seqlens = _case(lens, 64, s_q, h, kv_kind, seed=b + h)

    def call():
        return ops.mla_decode(q, kv, table, seqlens, SCALE, causal=True, head_dim_v=512, backend="triton",
                              num_splits=num_splits)
    out, lse = call()
    monkeypatch.setattr(mg, "STORE_16B", False)
    out2, lse2 = call()
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    _check(out, lse, q, kv, table, seqlens, list(range(b)))


@pytest.mark.parametrize("seesaw", [True, False])
@pytest.mark.parametrize("b, s_q, h, num_splits", [(5, 1, 64, 1), (3, 2, 64, 3), (4, 3, 20, 1), (2, 1, 128, 5)])
def test_gluon_64_row_kernels_bf16(monkeypatch, seesaw, b, s_q, h, num_splits):
    """bf16 KV in 64-row blocks through the seesaw kernel (mla_decode_gluon_seesaw.py, the default) and through the
    serial one (mla_decode_gluon.py): odd and even page counts a split (the last page the first or the second
    consumer's), a one-page and an empty request, partial last pages, padded rows (h 20 s_q 3), splits."""
    from mlaserve.kernels.triton import mla_decode_gluon_seesaw
    monkeypatch.setattr(mla_decode_gluon_seesaw, "SEESAW", seesaw)
    _check_ragged_pages(b, s_q, h, "bf16", num_splits, seed=b * 31 + h)


def _check_ragged_pages(b, s_q, h, kv_kind, num_splits, seed):
    """b requests of ~3000 tokens, odd and even page counts and partial last pages, the 2nd and 3rd (b > 2) of one
    page and empty, through the triton backend with `num_splits`, against the reference."""
    lens = [3000 + 64 * i + 17 * (i % 2) for i in range(b)]
    if b > 2:
        lens[1], lens[2] = 40, 0
    q, kv, table, seqlens = _case(lens, 64, s_q, h, kv_kind, seed=seed)
    out, lse = ops.mla_decode(q, kv, table, seqlens, SCALE, causal=True, head_dim_v=512, backend="triton",
                              num_splits=num_splits)
    _check(out, lse, q, kv, table, seqlens, list(range(b)))


@pytest.mark.parametrize("dequant_wg", [True, False])
@pytest.mark.parametrize("b, s_q, h, num_splits", [(5, 1, 32, 1), (3, 2, 12, 3), (4, 3, 9, 1), (3, 1, 16, 2)])
def test_gluon_fp8_narrow_both_forms(monkeypatch, dequant_wg, b, s_q, h, num_splits):
    """FP8 KV at <= 32 rows through the dequantizing warpgroup beside one compute warpgroup for all 512 columns
    (DEQUANT_WG, the default) and through two compute warpgroups dequantizing in place: odd and even page counts,
    a one-page and an empty request, partial last pages, padded rows (h 12 s_q 2, h 9 s_q 3), splits; 16 rows with
    splits too short for the FP8-MMA kernel."""
    from mlaserve.kernels.triton import mla_decode_gluon_narrow
    monkeypatch.setattr(mla_decode_gluon_narrow, "DEQUANT_WG", dequant_wg)
    _check_ragged_pages(b, s_q, h, "fp8", num_splits, seed=b * 37 + h)


@pytest.mark.parametrize("s_q, h, kv_kind", [(1, 16, "bf16"), (1, 16, "fp8"), (1, 32, "bf16"), (1, 32, "fp8"),
                                             (2, 16, "fp8"), (1, 64, "bf16"), (1, 64, "fp8")])
def test_balanced_splits_over_variable_lengths(s_q, h, kv_kind):
    """A step of about one wave of requests with variable lengths, planned from its host lengths: two KV splits a
    request, the split grid taking the requests longest first (work_order.grid_order), through each kernel of
    <= 64 rows (narrow bf16, FP8-MMA, seesaw, narrow FP8, the 64-row FP8 kernel); an empty and a one-page request
    among them. Requests across the length order are checked against the reference."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    b = sms - 4
    gen = torch.Generator().manual_seed(b + h + s_q)
    lens = torch.randint(4096, 12289, (b,), generator=gen).tolist()
    lens[3], lens[5] = 0, 50
    q, kv, table, seqlens = _case(lens, 64, s_q, h, kv_kind, seed=h * 7 + s_q)
    plan = tk.plan_mla_decode(b, s_q, h, 512, table.shape[1], 64, kv_kind == "fp8", "cuda", seqlens=lens)
    assert plan.num_splits == 2
    out, lse = ops.mla_decode(q, kv, table, seqlens, SCALE, causal=True, head_dim_v=512, backend="triton",
                              plan=plan)
    by_length = sorted(range(b), key=lambda i: lens[i])
    _check(out, lse, q, kv, table, seqlens, sorted({3, 5, *by_length[-4:], *by_length[b // 2:b // 2 + 2], b - 1}))


def test_more_requests_than_a_grid_axis_holds():
    """70000 one-token rows (an EXTEND step run per token): b exceeds the 65535 of CUDA's 2nd/3rd grid axes."""
    b, page_size = 70000, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    seqlens = torch.randint(0, page_size + 1, (b,), device="cuda", generator=gen, dtype=torch.int32)
    kv = torch.randn(b + 1, page_size, 576, device="cuda", generator=gen, dtype=torch.bfloat16)
    table = (torch.randperm(b, device="cuda", generator=gen) + 1).to(torch.int32)[:, None]
    q = torch.randn(b, 1, 16, 576, device="cuda", generator=gen, dtype=torch.bfloat16)
    out, lse = ops.mla_decode(q, kv, table, seqlens, SCALE, head_dim_v=512, backend="triton")
    rows = [0, 1, 65535, 65536, b - 1] + torch.randint(0, b, (7,), generator=torch.Generator().manual_seed(1)).tolist()
    _check(out, lse, q, kv, table, seqlens, rows)


@pytest.mark.parametrize("page_size", [16, 32, 128])
def test_page_sizes(page_size):
    lens = [3000, 77, 1]
    q, kv, table, seqlens = _case(lens, page_size, 2, 32, "bf16", seed=page_size)
    out, lse = ops.mla_decode(q, kv, table, seqlens, SCALE, head_dim_v=512, backend="triton", num_splits=3)
    _check(out, lse, q, kv, table, seqlens, [0, 1, 2])


@pytest.mark.parametrize("kv_kind,heads", [("bf16", 16), ("fp8", 16), ("bf16", 64), ("fp8", 32)])
def test_cuda_graph_replay_equals_eager(kv_kind, heads):
    from mlaserve.attention.triton_backend import TritonBackend
    config = BackendConfig(num_heads=heads, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
                           kv_cache_dtype="fp8_e4m3" if kv_kind == "fp8" else "auto", device=torch.device("cuda"))
    backend = TritonBackend(config)
    bs, page_size = 6, 64
    # one pool holding two steps' requests: step 1 uses requests 0..5, step 2 (other lengths, other pages) 6..11
    lens = [4000, 100, 2500, 1, 64, 3333] + [5000, 4096, 7, 1200, 65, 2]
    q, kv, table, _ = _case(lens, page_size, 1, heads, kv_kind, seed=5)
    tables = [[p for p in row.tolist() if p != POISON_PAGE] for row in table.cpu()]

    def step(first):
        sl = slice(first, first + bs)
        layout = BatchLayout.build([n - 1 for n in lens[sl]], [1] * bs, tables[sl], page_size, "cuda")
        return q[sl, 0].contiguous(), layout

    backend.init_cuda_graph(max_batch_size=8, max_pages=table.shape[1])
    q1, layout1 = step(0)
    meta = backend.plan_for_capture(layout1)
    assert meta.decode_plan.num_splits > 1, "a small batch should split the KV (this tests the workspace in a graph)"
    q_static = q1.clone()
    backend.mla(q_static, kv, layout1, meta, SCALE, 512)            # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = backend.mla(q_static, kv, layout1, meta, SCALE, 512)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_static, backend.mla(q1, kv, layout1, meta, SCALE, 512))

    q2, layout2 = step(bs)
    assert backend.plan_for_replay(layout2) is meta
    q_static.copy_(q2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_static, backend.mla(q2, kv, layout2, meta, SCALE, 512))
    _check(out_static.unsqueeze(1), None, q2.unsqueeze(1), kv, layout2.block_table, layout2.cache_seqlens,
           list(range(bs)))


@pytest.mark.parametrize("h,fp8_mma", [(16, False), (16, True), (32, False), (64, False)])
def test_fp8_subnormal_entries_count(h, fp8_mma):
    """Entries that quantize to e4m3 subnormals (|x| < 2^-6 * scale) keep their values: in each 128-column tile
    one entry of 1 sets the scale and the others are ~1e-5, so every other output column is an average of
    subnormal-derived values only. A kernel that flushes them (or a dequantizer that drops them) gives 0 there.
    h 16 runs the dequantizing Gluon kernel (its bit trick) or, with a block table of 32 pages and one split, the
    FP8-MMA kernel (e4m3 bytes straight into the MMAs); h 32 the dequantizing warpgroup too (N 32); h 64 the
    64-row Gluon kernel."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    lens = [64, 200]
    pages = 5
    kv = (torch.rand(pages, 64, 576, device="cuda", generator=gen) - 0.5) * 6e-5
    kv[..., 0:512:128] = 1.0
    kv[..., 512:] = torch.randn(pages, 64, 64, device="cuda", generator=gen) * 0.1
    packed = ops.quantize_kv_fp8(kv.bfloat16())
    e4m3 = packed[..., :512].contiguous().view(torch.float8_e4m3fn).float().abs()
    assert ((e4m3 > 0) & (e4m3 < 2 ** -6)).float().mean() > 0.5     # most entries are e4m3 subnormals
    table = torch.tensor([[4, 0, 0, 0], [0, 1, 2, 3]], dtype=torch.int32, device="cuda")
    if fp8_mma:
        table = torch.nn.functional.pad(table, (0, 28))
        assert tk.uses_fp8_mma(tk.default_config(h, True), True, table.shape[1], 1)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(2, 1, h, 576, device="cuda", generator=gen, dtype=torch.bfloat16)
    out, _ = ops.mla_decode(q, packed, table, seqlens, SCALE, head_dim_v=512, backend="triton",
                            **({"num_splits": 1} if fp8_mma else {}))
    ref, _ = reference.mla_decode(q.double(), ops.dequantize_kv_fp8(packed).double(), table, seqlens, SCALE)
    small = torch.ones(512, dtype=torch.bool, device="cuda")
    small[0::128] = False
    x, y = out[..., small].double().flatten(), ref[..., small].double().flatten()
    assert float(y.abs().max()) > 1e-6
    cos = float(x @ y / (x.norm() * y.norm()))
    assert cos > 0.999 and abs(float(x.norm() / y.norm()) - 1) < 1e-2, (cos, float(x.norm() / y.norm()))


@pytest.mark.parametrize("prefix_lens,extend_lens", [([3000, 0, 700], [2, 2, 2]),    # rows packed as s_q = 2
                                                     ([500, 64], [5, 130])])          # one row per token
def test_backend_extend_matches_torch_backend(prefix_lens, extend_lens):
    from mlaserve.attention.torch_backend import TorchBackend, _ragged_mha
    from mlaserve.attention.triton_backend import TritonBackend
    config = BackendConfig(num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
                           kv_cache_dtype="auto", device=torch.device("cuda"))
    lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    q, kv, table, _ = _case(lens, 64, 1, 16, "bf16", seed=sum(lens))
    tables = [[p for p in row.tolist() if p != POISON_PAGE] for row in table.cpu()]
    layout = BatchLayout.build(prefix_lens, extend_lens, tables, 64, "cuda")
    backend = TritonBackend(config)
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(layout.num_tokens, 16, 576, device="cuda", generator=gen, dtype=torch.bfloat16)
    out = backend.mla(q, kv, layout, backend.plan(layout), SCALE, 512)
    ref_backend = TorchBackend(config, extend_form="absorbed")
    ref = ref_backend.mla(q, kv, layout, ref_backend.plan(layout), SCALE, 512)
    err = (out.float() - ref.float()).abs()
    assert float(err.max()) < 2e-2 and float(err.mean()) < 1e-3, (float(err.max()), float(err.mean()))
    # the MHA form through scaled_dot_product_attention (DeepSeek's 192/128 head dims)
    n_ctx = sum(layout.seq_lens)
    qm = torch.randn(layout.num_tokens, 16, 192, device="cuda", generator=gen, dtype=torch.bfloat16)
    km = torch.randn(n_ctx, 16, 192, device="cuda", generator=gen, dtype=torch.bfloat16)
    vm = torch.randn(n_ctx, 16, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    got = backend.mha(qm, km, vm, layout, None, SCALE)
    want = _ragged_mha(qm, km, vm, layout, SCALE)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
