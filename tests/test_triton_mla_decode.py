"""The Triton paged MLA decode kernel and the `triton` attention backend, through Triton's CPU interpreter.

Every kernel result is compared with mlaserve.kernels.reference.mla_decode on the same inputs. Cache
slots no request owns hold NaN and block-table entries past a request's pages hold a poison page id,
so that a kernel reading anything it should not shows up as NaN or an out-of-range error.
fp16/fp32 only: the interpreter computes tl.dot on bf16 wrongly (KERNEL-NOTES.md).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mlaserve import ops
from mlaserve.attention import registry
from mlaserve.attention.base import BackendConfig
from mlaserve.attention.batch import BatchLayout, ForwardMode
from mlaserve.attention.torch_backend import TorchBackend, _ragged_mha
from mlaserve.kernels import fp8_format, reference
from mlaserve.kernels.triton import mla_decode as _  # noqa: F401  (the package resolves the op lazily)
from mlaserve.kernels.triton.mla_decode import (MLADecodeConfig, choose_num_splits, combine_config, full_wave_splits,
                                                default_config, mla_decode, plan_mla_decode, uses_fp8_mma,
                                                workspace_numel)

POISON_PAGE = 1 << 20
TOL = {torch.float16: dict(atol=3e-3, rtol=1e-2), torch.float32: dict(atol=2e-5, rtol=1e-4)}


def make_paged(lens, page_size, d, dtype, gen, fp8=False, spare_pages=3):
    """A shuffled paged cache holding len(lens) requests; everything no request owns is NaN.

    Returns kv [pages, page_size, d] (or uint8 [.., 656]), block_table int32 [b, max_pages] with
    POISON_PAGE past each request's pages, cache_seqlens int32 [b].
    """
    b = len(lens)
    max_pages = max(1, max(math.ceil(n / page_size) for n in lens)) + 1   # a spare column, always poison
    num_pages = b * max_pages + spare_pages
    kv = torch.randn(num_pages, page_size, d, generator=gen)
    owned = torch.zeros(num_pages, page_size, dtype=torch.bool)
    table = torch.full((b, max_pages), POISON_PAGE, dtype=torch.int32)
    pages = torch.randperm(num_pages, generator=gen)
    for i, n in enumerate(lens):
        used = pages[i * max_pages: i * max_pages + math.ceil(n / page_size)]
        table[i, :len(used)] = used.int()
        for t in range(n):
            owned[used[t // page_size], t % page_size] = True
    if fp8:
        kv = fp8_format.quantize(kv)
        kv[~owned] = 0xFF            # NaN in e4m3, in the fp32 scales and in bf16 k_pe alike
    else:
        kv = kv.to(dtype)
        kv[~owned] = float("nan")
    return kv, table, torch.tensor(lens, dtype=torch.int32)


def check_against_reference(q, kv, table, seqlens, scale, head_dim_v, causal=True, lse_atol=None, **kwargs):
    out, lse = mla_decode(q, kv, table, seqlens, scale, causal=causal, head_dim_v=head_dim_v, **kwargs)
    kv_ref = kv if kv.dtype == torch.uint8 else kv.double()
    ref_out, ref_lse = reference.mla_decode(q.double(), kv_ref, table, seqlens, scale, causal=causal,
                                            head_dim_v=head_dim_v)
    assert out.dtype == q.dtype and out.shape == ref_out.shape and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    empty = ref_lse == float("-inf")
    assert torch.equal(lse == float("-inf"), empty), "rows with no visible key must have lse = -inf, only they"
    assert (out[empty] == 0).all(), "rows with no visible key must have out = 0"
    torch.testing.assert_close(out.double(), ref_out.double(), **TOL[q.dtype])
    torch.testing.assert_close(lse[~empty].double(), ref_lse[~empty].double(), atol=lse_atol or 1e-4, rtol=0)
    return out, lse


CASES = [
    # b, s_q, h, page_size, lens, num_splits, dtype
    (2, 1, 1, 16, [37, 5], 1, torch.float16),
    (2, 1, 3, 32, [70, 33], 3, torch.float16),
    (3, 2, 5, 64, [0, 130, 2], 2, torch.float16),      # an empty request; one shorter than s_q needs
    (2, 3, 3, 16, [1, 95], 4, torch.float32),          # request 0: fewer keys than new tokens
    (1, 4, 5, 32, [200], 5, torch.float16),
    (4, 1, 5, 16, [3, 17, 64, 1], 8, torch.float32),   # more splits than a short request has tiles
    (2, 1, 3, 80, [150, 190], 1, torch.float32),        # pages that are no multiple of the tile: tiles straddle
    (2, 2, 3, 96, [200, 40], 3, torch.float16),         # pages (read row by row, never past a page's end)
]


@pytest.mark.parametrize("b,s_q,h,page_size,lens,num_splits,dtype", CASES)
def test_matches_reference(b, s_q, h, page_size, lens, num_splits, dtype):
    gen = torch.Generator().manual_seed(hash((b, s_q, h, page_size, num_splits)) % (1 << 31))
    d_qk, d_v = 80, 64
    kv, table, seqlens = make_paged(lens, page_size, d_qk, dtype, gen)
    q = torch.randn(b, s_q, h, d_qk, generator=gen).to(dtype)
    check_against_reference(q, kv, table, seqlens, d_qk ** -0.5, d_v, num_splits=num_splits)


@pytest.mark.parametrize("config", [
    MLADecodeConfig(block_h=16, block_n=16, num_warps=4),           # several tiles per page
    MLADecodeConfig(block_h=16, block_n=32, v_split=2, num_warps=4),  # two programs share a query block
    MLADecodeConfig(block_h=32, block_n=64, num_warps=4),           # a tile spans several pages
    MLADecodeConfig(block_h=128, block_n=32, v_split=2),            # all rows in one block, padded
    MLADecodeConfig(block_h=16, block_n=16, num_warps=4, lazy_rescale=True),
    MLADecodeConfig(block_h=64, block_n=64, gluon=True),   # off Hopper: the tl kernel on the Gluon kernel's grid
    MLADecodeConfig(block_h=16, block_n=64, num_stages=3, gluon=True),   # likewise for the keys-on-M kernel
])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_configs(config, num_splits):
    gen = torch.Generator().manual_seed(7 + num_splits)
    kv, table, seqlens = make_paged([150, 41], 32, 80, torch.float16, gen)
    q = torch.randn(2, 2, 3, 80, generator=gen).to(torch.float16)
    check_against_reference(q, kv, table, seqlens, 0.1, 64, num_splits=num_splits, config=config)


def test_combine_takes_blocks_of_rows():
    """520 query rows (40 requests x 13 heads) over 3 splits: the combine runs 16 rows per program, the last
    block part-filled; empty and one-token requests among them."""
    gen = torch.Generator().manual_seed(520)
    lens = torch.randint(0, 50, (40,), generator=gen).tolist()
    lens[:3] = [0, 1, 49]
    kv, table, seqlens = make_paged(lens, 16, 80, torch.float16, gen)
    q = torch.randn(40, 1, 13, 80, generator=gen).to(torch.float16)
    check_against_reference(q, kv, table, seqlens, 0.1, 64, num_splits=3)


def test_combine_reads_more_than_128_splits_in_chunks():
    """130 splits of one page each: the combine loads 128 splits at a time (combine_config), so the last 2 come
    in a second, mostly masked chunk; a short request sees nothing in most splits."""
    gen = torch.Generator().manual_seed(130)
    kv, table, seqlens = make_paged([130 * 16, 20], 16, 80, torch.float16, gen)
    q = torch.randn(2, 1, 3, 80, generator=gen).to(torch.float16)
    assert combine_config(6, 130, 64).split_chunk == 128
    check_against_reference(q, kv, table, seqlens, 0.1, 64, num_splits=130)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_lazy_rescale_with_growing_scores(num_splits):
    """Scores that grow by ~100 (log2 units) along the sequence: P in fp16 overflows unless the lazy path
    rescales whenever a row's max grows by more than 2^8, and it skips the smaller steps."""
    gen = torch.Generator().manual_seed(41 + num_splits)
    kv, table, seqlens = make_paged([300, 45], 16, 80, torch.float16, gen)
    pos = torch.zeros(kv.shape[0], kv.shape[1])
    for i, n in enumerate(seqlens.tolist()):       # token position of every owned slot
        for t in range(n):
            pos[table[i, t // 16], t % 16] = t / 300
    kv = (kv.float() * (1 + 15 * pos[..., None])).to(torch.float16)
    q = torch.randn(2, 2, 3, 80, generator=gen).to(torch.float16)
    cfg = MLADecodeConfig(block_h=16, block_n=16, num_warps=4, lazy_rescale=True)
    check_against_reference(q, kv, table, seqlens, 0.5, 64, num_splits=num_splits, config=cfg)


@pytest.mark.parametrize("d_qk,d_v", [(64, 64), (72, 48)])
def test_head_dims_without_rope_or_power_of_two(d_qk, d_v):
    gen = torch.Generator().manual_seed(d_qk + d_v)
    kv, table, seqlens = make_paged([50, 9], 16, d_qk, torch.float32, gen)
    q = torch.randn(2, 2, 3, d_qk, generator=gen)
    check_against_reference(q, kv, table, seqlens, 0.2, d_v, num_splits=2)


def test_not_causal():
    gen = torch.Generator().manual_seed(11)
    kv, table, seqlens = make_paged([40, 3], 16, 80, torch.float16, gen)
    q = torch.randn(2, 3, 2, 80, generator=gen).to(torch.float16)
    check_against_reference(q, kv, table, seqlens, 0.15, 64, causal=False, num_splits=2)


@pytest.mark.parametrize("v_split", [1, 2])
def test_grid_of_several_waves_takes_requests_longest_first(v_split):
    """More programs than the (CPU stand-in's 8) SMs, unsplit: the request axis runs through the longest-first
    order (work_order.grid_order); each request's rows still land in its own output rows."""
    from mlaserve.kernels.triton.work_order import grid_order
    gen = torch.Generator().manual_seed(13 + v_split)
    lens = [5, 140, 0, 77, 140, 33, 1, 96, 64, 12]
    kv, table, seqlens = make_paged(lens, 32, 80, torch.float16, gen)
    q = torch.randn(len(lens), 2, 3, 80, generator=gen).to(torch.float16)
    config = MLADecodeConfig(block_h=16, block_n=32, v_split=v_split, num_warps=4)
    assert grid_order(seqlens, len(lens) * v_split, 1) is not None and grid_order(seqlens, 8, 1) is None
    assert grid_order(seqlens, 4, 2) is None, "small batches' splits fill one wave: no order"
    check_against_reference(q, kv, table, seqlens, 0.1, 64, num_splits=1, config=config)


def test_split_grid_of_several_waves_takes_requests_longest_first():
    """Two KV splits of 6 requests on the CPU stand-in's 8 SMs (what balanced_splits plans for variable
    lengths): 12 programs, ordered longest first, each split's partial in its request's slot of the workspace."""
    from mlaserve.kernels.triton.work_order import grid_order
    gen = torch.Generator().manual_seed(17)
    lens = [40, 300, 0, 129, 7, 300]
    kv, table, seqlens = make_paged(lens, 32, 80, torch.float16, gen)
    q = torch.randn(len(lens), 2, 3, 80, generator=gen).to(torch.float16)
    assert grid_order(seqlens, len(lens), 2) is not None
    check_against_reference(q, kv, table, seqlens, 0.1, 64, num_splits=2,
                            config=MLADecodeConfig(block_h=16, block_n=32, num_warps=4))


@pytest.mark.parametrize("num_splits", [1, 2])
def test_deepseek_dims(num_splits):
    gen = torch.Generator().manual_seed(576 + num_splits)
    kv, table, seqlens = make_paged([70, 0], 64, 576, torch.float16, gen)
    q = (0.5 * torch.randn(2, 2, 3, 576, generator=gen)).to(torch.float16)
    check_against_reference(q, kv, table, seqlens, 576 ** -0.5, 512, num_splits=num_splits)


@pytest.mark.parametrize("num_splits,page_size,dtype", [(1, 64, torch.float16), (3, 16, torch.float32)])
def test_fp8_kv(num_splits, page_size, dtype):
    gen = torch.Generator().manual_seed(656 + num_splits)
    kv, table, seqlens = make_paged([90, 5], page_size, 576, dtype, gen, fp8=True)
    q = torch.randn(2, 2, 3, 576, generator=gen).to(dtype)
    # the kernel rounds dequantized rows to q's dtype before its dots; the reference keeps float32
    check_against_reference(q, kv, table, seqlens, 576 ** -0.5, 512, num_splits=num_splits, lse_atol=2e-3)


def test_through_ops_and_default_plan():
    gen = torch.Generator().manual_seed(3)
    kv, table, seqlens = make_paged([100, 60, 7], 32, 80, torch.float16, gen)
    q = torch.randn(3, 1, 4, 80, generator=gen).to(torch.float16)
    for options in ({}, {"num_splits": 3}):
        out, lse = ops.mla_decode(q, kv, table, seqlens, 0.1, head_dim_v=64, backend="triton", **options)
        ref_out, ref_lse = reference.mla_decode(q, kv.double(), table, seqlens, 0.1, head_dim_v=64)
        torch.testing.assert_close(out.double(), ref_out.double(), **TOL[torch.float16])
        torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=0)


def test_bf16_is_refused_by_the_interpreter():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("only the CPU interpreter refuses bf16")
    gen = torch.Generator().manual_seed(5)
    kv, table, seqlens = make_paged([10], 16, 80, torch.bfloat16, gen)
    with pytest.raises(ValueError, match="bfloat16"):
        mla_decode(torch.zeros(1, 1, 1, 80, dtype=torch.bfloat16), kv, table, seqlens, 0.1, head_dim_v=64)


@pytest.mark.parametrize("rows", [16, 32])
def test_dequantizing_warpgroup_takes_fp8_only(rows):
    # the Gluon kernel's dequantizing warpgroup and its two bf16 tiles are for FP8 caches: asking for it with a bf16
    # cache is an error that names the dtype, raised before anything touches a GPU
    pytest.importorskip("triton.experimental.gluon")
    from mlaserve.kernels.triton import mla_decode_gluon_narrow as narrow
    kv = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    q = torch.zeros(1, 1, rows, 576, dtype=torch.bfloat16)
    plan = plan_mla_decode(1, 1, rows, 512, 2, 64, False, "cpu")
    with pytest.raises(ValueError, match="dequant_warpgroup takes FP8 caches, got torch.bfloat16"):
        narrow.mla_decode_gluon_narrow(q, kv, torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                                       0.1, True, plan, torch.empty(1, 1, rows, 512), torch.empty(1, 1, rows),
                                       dequant_warpgroup=True)


def test_pipelined_scores_only_where_splits_are_long(monkeypatch):
    # the dequantizing warpgroup's compute warpgroup queues each next page's S^T behind O^T (PIPE_S) where a split
    # spans >= PIPE_S_MIN_PAGES pages: each split ends with one S^T more, which short splits do not pay back
    pytest.importorskip("triton.experimental.gluon")
    from mlaserve.kernels.triton import mla_decode_gluon_narrow as narrow
    n = narrow.PIPE_S_MIN_PAGES
    assert narrow.pipes_scores(n, 1) and narrow.pipes_scores(8 * n, 8) and narrow.pipes_scores(8 * n - 7, 8)
    assert not narrow.pipes_scores(n - 1, 1) and not narrow.pipes_scores(8 * n - 8, 8)
    assert not narrow.pipes_scores(512, 32)          # b 4 at s_k 32768: 16-page splits
    monkeypatch.setattr(narrow, "PIPE_S", False)
    assert not narrow.pipes_scores(512, 1)


# -- planning --

def test_num_splits_from_shapes_only():
    cpu = torch.device("cpu")   # the interpreter pretends to have 8 SMs
    cfg = MLADecodeConfig(block_h=16, min_split_tokens=256)
    assert choose_num_splits(64, 1, 16, 512, 64, cpu, cfg) == 1                 # the batch fills the SMs
    many = choose_num_splits(1, 1, 16, 512, 64, cpu, cfg)
    assert 1 < many <= 8 * 2                                                     # fills them by splitting
    assert choose_num_splits(1, 1, 16, 2, 64, cpu, cfg) == 1                     # 128 tokens: nothing to split
    assert choose_num_splits(1, 1, 16, 8, 64, cpu, cfg) <= 2                     # 512 tokens: 2 splits at most
    assert choose_num_splits(1, 1, 16, 512, 64, cpu, cfg) == many                # deterministic


def test_fp8_descriptors_view_the_three_parts_of_a_row():
    """The Gluon FP8 kernels' TMA descriptors (built on the CPU here; no launch): one cache row of 656 bytes seen
    as 656 e4m3 (c_kv boxes [64, 128] at columns 0-511), 164 fp32 (scales [64, 4] at column 128 = byte 512) and
    328 bf16 (k_pe [64, 64] at column 264 = byte 528), all over the same bytes."""
    from mlaserve.kernels.triton.mla_decode_gluon_narrow import fp8_descriptors
    kv = torch.zeros(3, 64, fp8_format.PACKED_BYTES, dtype=torch.uint8)
    ckv, sc, kpe = fp8_descriptors(kv)
    for d, dtype, cols, box in ((ckv, torch.float8_e4m3fn, 656, [64, 128]), (sc, torch.float32, 164, [64, 4]),
                                (kpe, torch.bfloat16, 328, [64, 64])):
        assert d.base.dtype == dtype and tuple(d.shape) == (192, cols) and list(d.block_shape) == box
        assert d.base.data_ptr() == kv.data_ptr() and tuple(d.strides) == (cols, 1)
    assert fp8_format.SCALE_OFFSET // 4 == 128 and fp8_format.ROPE_OFFSET // 2 == 264


def test_fp8_mma_takes_long_splits_of_fp8_caches_only():
    """The FP8-MMA kernel's rule (<= 16 rows, FP8 KV): one new token, unsplit over >= 32 pages or split into runs
    of >= 64, from host shapes; never with bf16 KV or where the config leaves it off; a negative threshold is
    refused."""
    fp8, bf16 = default_config(16, True), default_config(16, False)
    assert fp8.fp8_mma_min_pages == 16 and bf16.fp8_mma_min_pages == 0
    assert uses_fp8_mma(fp8, True, 64, 1)             # b 128 s_k 4096: one split of 64 pages
    assert uses_fp8_mma(fp8, True, 16, 1)             # b 128 s_k 1024: one split of 16
    assert not uses_fp8_mma(fp8, True, 15, 1)
    assert not uses_fp8_mma(fp8, True, 64, 1, s_q=2)  # h 8 s_q 2: the dequantizing warpgroup
    assert uses_fp8_mma(fp8, True, 512, 8)            # b 16 s_k 32768: 8 splits of 64
    assert uses_fp8_mma(fp8, True, 512, 16)           # b 8 s_k 32768: 16 splits of 32
    assert not uses_fp8_mma(fp8, True, 511, 16)
    assert not uses_fp8_mma(fp8, True, 512, 32)       # b 4 s_k 32768: 32 splits of 16
    assert not uses_fp8_mma(fp8, True, 512, 64)       # b 1: 64 splits of 8
    assert not uses_fp8_mma(fp8, False, 512, 1)       # bf16 KV
    assert not uses_fp8_mma(bf16, True, 512, 1)       # a config without it
    assert not uses_fp8_mma(default_config(32, True), True, 512, 1)
    with pytest.raises(ValueError, match="fp8_mma_min_pages must be >= 0, got -1"):
        MLADecodeConfig(block_h=16, fp8_mma_min_pages=-1)


@pytest.fixture
def h200_planning(monkeypatch):
    """Planning as on an H200 (Hopper, 132 SMs) for host-only rules; choose_num_splits' cache emptied around it."""
    from mlaserve.kernels.triton import mla_decode_plan
    monkeypatch.setattr(mla_decode_plan, "_is_hopper", lambda device: True)
    monkeypatch.setattr(mla_decode_plan, "_num_sms", lambda device: 132)
    choose_num_splits.cache_clear()
    yield mla_decode_plan
    choose_num_splits.cache_clear()


def test_17_to_32_bf16_rows_take_the_seesaw_where_its_splits_are_long(h200_planning):
    """bf16 steps of 17-32 rows: the 64-row config (the seesaw) where its splits span >= SEESAW_32_MIN_PAGES pages,
    the narrow 32-row one elsewhere; FP8 KV, other row counts, other page sizes and non-Hopper GPUs keep the
    table's config. plan_mla_decode takes the same config and sizes its workspace from its splits."""
    p, cpu = h200_planning, torch.device("cpu")
    wide, narrow = p.DEFAULT_CONFIGS[(64, "bf16")], p.DEFAULT_CONFIGS[(32, "bf16")]
    assert p.SEESAW_32_MIN_PAGES == 32 and narrow.block_h == 32
    assert p.decode_config(128, 1, 32, 64, 64, False, cpu) == wide          # b 128 s_k 4096: unsplit, 64 pages
    assert p.decode_config(128, 2, 16, 512, 64, False, cpu) == wide         # 32 rows as h 16 s_q 2
    assert p.decode_config(16, 1, 32, 512, 64, False, cpu) == wide          # 8 splits of 64 pages
    assert p.decode_config(4, 1, 32, 512, 64, False, cpu) == narrow         # 32 splits of 16
    assert p.decode_config(1, 1, 32, 512, 64, False, cpu) == narrow         # 128 splits of 4
    assert p.decode_config(128, 1, 32, 16, 64, False, cpu) == narrow        # unsplit, but 16 pages
    assert p.decode_config(128, 1, 32, 64, 64, True, cpu) == p.DEFAULT_CONFIGS[(32, "fp8")]
    assert p.decode_config(128, 1, 16, 64, 64, False, cpu) == p.DEFAULT_CONFIGS[(16, "bf16")]
    assert p.decode_config(128, 1, 64, 64, 64, False, cpu) == wide
    assert p.decode_config(128, 1, 32, 32, 128, False, cpu) == narrow       # page 128: the tl kernel runs
    plan = plan_mla_decode(16, 1, 32, 512, 512, 64, False, cpu)
    assert plan.config == wide and plan.num_splits == 8 and plan.partial_out.shape == (16, 8, 32, 512)
    assert plan_mla_decode(1, 1, 32, 512, 512, 64, False, cpu).config == narrow


def test_graph_workspace_covers_every_batch_size_under_the_seesaw_rule(h200_planning):
    """The CUDA-graph workspace is sized once for every batch size up to the maximum; with h 32 the configs differ
    by batch size (the 64-row seesaw at b 16, the narrow kernel at b 1-4), and each size's plan fits in it."""
    backend = registry.create("triton", _config(num_heads=32, rank=512, rope=64))
    backend.init_cuda_graph(max_batch_size=16, max_pages=512)
    configs = set()
    for b in (1, 4, 16):
        layout = BatchLayout.build([100] * b, [1] * b, [[i + 1] * 2 for i in range(b)], 64, "cpu")
        plan = backend.plan_for_capture(layout).decode_plan
        configs.add(plan.config.block_h)
        assert plan.num_splits > 1 and plan.partial_out.shape == (b, plan.num_splits, 32, 512)
    assert configs == {32, 64}


def test_host_lengths_split_variable_batches_of_one_wave(h200_planning):
    """With the requests' lengths on the host, a step whose programs fit one wave splits every request in two when
    the lengths vary enough for the halves to balance the SMs (mla_decode_plan.balanced_splits), and not at fixed
    or nearly fixed lengths, short contexts, several waves or small batches (their splits come from shapes)."""
    p, cpu = h200_planning, torch.device("cpu")
    gen = torch.Generator().manual_seed(86)

    def lens(b, s, spread):
        return (s + (torch.rand(b, generator=gen) * 2 - 1) * spread * s).long().tolist()

    def splits(b, h, seqlens, kv_fp8=False, s_q=1):
        max_pages = -(-max(seqlens) // 64)
        return plan_mla_decode(b, s_q, h, 512, max_pages, 64, kv_fp8, cpu, seqlens=seqlens).num_splits

    for s in (4096, 8192, 32768):
        var = lens(128, s, 0.5)
        assert splits(128, 16, var) == 2 and splits(128, 32, var, True) == 2 and splits(128, 32, var, s_q=2) == 2
        assert splits(100, 64, var[:100]) == 2
        assert splits(128, 16, [s] * 128) == 1 and splits(128, 64, [s] * 128, True) == 1
        assert splits(128, 16, lens(128, s, 0.05)) == 1
        assert splits(128, 128, var) == 1, "two 64-row programs a request: two waves, ordered instead"
    one_long = [8192] * 127 + [16384]
    assert splits(128, 16, one_long) == 2
    assert p.plan_num_splits(128, 1, 16, 256, 64, False, cpu, one_long) == 2, "the count without a workspace"
    assert p.plan_num_splits(128, 1, 16, 256, 64, False, cpu) == 1
    small = lens(4, 32768, 0.5)
    small_pages = -(-max(small) // 64)
    assert splits(128, 16, lens(128, 1024, 0.5)) == 1, "mean under BALANCE_MIN_PAGES: unmeasured, no balancing"
    assert splits(4, 16, small) == plan_mla_decode(4, 1, 16, 512, small_pages, 64, False, cpu).num_splits > 2
    assert plan_mla_decode(128, 1, 16, 512, 192, 64, False, cpu).num_splits == 1, "without lengths: shapes only"
    with pytest.raises(ValueError, match="seqlens must have b = 128 entries, got 3"):
        plan_mla_decode(128, 1, 16, 512, 192, 64, False, cpu, seqlens=[1, 2, 3])
    p.BALANCE_SPLITS = False
    try:
        assert splits(128, 16, lens(128, 8192, 0.5)) == 1
    finally:
        p.BALANCE_SPLITS = True


def test_lpt_makespan():
    from mlaserve.kernels.triton.mla_decode_plan import lpt_makespan
    assert lpt_makespan([5, 4, 3, 3, 3], 2) == 10     # longest first: 5 + 3 and 4 + 3 + 3
    assert lpt_makespan([7, 1, 1], 4) == 7 and lpt_makespan([], 3) == 0
    assert lpt_makespan([2] * 6, 3) == 4


def test_17_to_32_bf16_rows_keep_the_narrow_kernel_off_hopper():
    from mlaserve.kernels.triton import mla_decode_plan as p
    assert p.decode_config(128, 1, 32, 64, 64, False, torch.device("cpu")) == p.DEFAULT_CONFIGS[(32, "bf16")]


@pytest.mark.parametrize("programs, units, min_units, want, max_splits", [
    (1, 512, 4, 64, 64),    # a cap on the count: 64 splits of 8
    (1, 200, 4, 50, 64),    # under the cap: 50 splits of 4
    (1, 512, 4, 128, 128),   # 512 KV tiles: 128 splits of 4 fill 128 of the 132 SMs
    (2, 512, 4, 64, 128),    # 66 would fit too, but 512 tiles cut into 66 runs of 8 leave 2 splits empty
    (4, 512, 4, 32, 128),
    (8, 512, 4, 16, 128),
    (32, 512, 4, 4, 128),
    (1, 512, 8, 64, 128),    # the floor on a split's length caps the count
    (1, 6, 4, 1, 128),       # 6 tiles cannot make two splits of >= 4
    (106, 512, 4, 1, 128),   # >= 80% of the SMs busy without splitting
    (0, 512, 4, 1, 128),
])
def test_full_wave_splits(programs, units, min_units, want, max_splits):
    n = full_wave_splits(programs, 132, units, min_units, max_splits)
    assert n == want
    per = -(-units // n)
    assert n == 1 or (programs * n <= 132 and per >= min_units and -(-units // per) == n)   # no empty split
    assert n <= max_splits


def test_plan_shares_a_workspace_and_checks_it():
    need = workspace_numel(4, 2 * 3, 64, 3)
    buf = torch.empty(need + 5)
    plan = plan_mla_decode(4, 2, 3, 64, 10, 16, False, "cpu", num_splits=3, workspace=buf)
    assert plan.partial_out.data_ptr() == buf.data_ptr() and plan.partial_out.shape == (4, 3, 6, 64)
    assert plan.partial_lse.shape == (4, 3, 6)
    with pytest.raises(ValueError, match="workspace"):
        plan_mla_decode(4, 2, 3, 64, 10, 16, False, "cpu", num_splits=3, workspace=torch.empty(need - 1))
    with pytest.raises(ValueError, match="num_splits"):
        plan_mla_decode(4, 2, 3, 64, 10, 16, False, "cpu", num_splits=0)
    with pytest.raises(ValueError, match="block_n"):
        MLADecodeConfig(block_n=48)
    with pytest.raises(ValueError, match="gluon takes block_h 16, 32 or 64"):
        MLADecodeConfig(block_h=128, v_split=2, gluon=True)
    # a plan serves any batch up to its own, with the same rows
    gen = torch.Generator().manual_seed(9)
    kv, table, seqlens = make_paged([33, 12], 16, 80, torch.float16, gen)
    q = torch.randn(2, 2, 3, 80, generator=gen).to(torch.float16)
    check_against_reference(q, kv, table, seqlens, 0.1, 64, plan=plan)
    with pytest.raises(ValueError, match="plan"):
        mla_decode(q[:, :1], kv, table, seqlens, 0.1, head_dim_v=64, plan=plan)


# -- the attention backend --

def _config(dtype=torch.float16, kv_cache_dtype="auto", num_heads=3, rank=64, rope=16):
    return BackendConfig(num_heads=num_heads, kv_lora_rank=rank, qk_rope_head_dim=rope, dtype=dtype,
                         kv_cache_dtype=kv_cache_dtype, device=torch.device("cpu"))


def _layout_and_cache(prefix_lens, extend_lens, page_size, d, gen, mode=None):
    lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    kv, table, _ = make_paged(lens, page_size, d, torch.float16, gen)
    tables = [[int(p) for p in row if p != POISON_PAGE] for row in table]
    layout = BatchLayout.build(prefix_lens, extend_lens, tables, page_size, "cpu", mode=mode)
    return layout, kv


@pytest.mark.parametrize("prefix_lens,extend_lens", [([40, 0, 17], [1, 1, 1]),   # DECODE
                                                     ([5, 30], [3, 3]),          # uniform short EXTEND
                                                     ([0, 21], [6, 2])])         # ragged EXTEND
def test_backend_mla_matches_torch_backend(prefix_lens, extend_lens):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU backend test runs through the interpreter")
    gen = torch.Generator().manual_seed(sum(prefix_lens) + len(extend_lens))
    config = _config()
    layout, kv = _layout_and_cache(prefix_lens, extend_lens, 16, 80, gen)
    backend = registry.create("triton", config)
    meta = backend.plan(layout)
    q = torch.randn(layout.num_tokens, 3, 80, generator=gen).to(torch.float16)
    out = backend.mla(q, kv, layout, meta, 0.12, 64)
    torch_backend = TorchBackend(config, extend_form="absorbed")
    ref = torch_backend.mla(q.float(), kv.float(), layout, torch_backend.plan(layout), 0.12, 64)
    torch.testing.assert_close(out.float(), ref, **TOL[torch.float16])
    assert meta.s_q == (3 if extend_lens == [3, 3] else 1)


def test_backend_plans_decode_splits_from_the_steps_host_lengths(h200_planning):
    """The backend's plan hands the step's lengths to the kernel's planner: a DECODE step of 128 variable lengths
    is split in two (balanced_splits), one of fixed lengths is not; per-token EXTEND views plan from shapes."""
    backend = registry.create("triton", _config(num_heads=16, rank=512, rope=64))
    gen = torch.Generator().manual_seed(7)
    var = (8192 * (0.5 + torch.rand(128, generator=gen))).long().tolist()
    for lens, want in ((var, 2), ([8192] * 128, 1)):
        tables = [list(range(1 + 128 * i, 1 + 128 * i + -(-n // 64))) for i, n in enumerate(lens)]
        layout = BatchLayout.build([n - 1 for n in lens], [1] * 128, tables, 64, "cpu")
        assert backend.plan(layout).decode_plan.num_splits == want
    ragged = BatchLayout.build([8000, 100], [5, 3], [list(range(1, 127)), [200, 201]], 64, "cpu")
    meta = backend.plan(ragged)
    assert meta.s_q == 1 and meta.decode_plan.max_batch == 8


def test_backend_mha_and_extend_choice():
    gen = torch.Generator().manual_seed(21)
    layout, _ = _layout_and_cache([0, 9], [5, 4], 16, 80, gen)
    backend = registry.create("triton", _config(dtype=torch.float32))
    n_ctx = sum(layout.seq_lens)
    q = torch.randn(layout.num_tokens, 3, 24, generator=gen)
    k = torch.randn(n_ctx, 3, 24, generator=gen)
    v = torch.randn(n_ctx, 3, 16, generator=gen)
    torch.testing.assert_close(backend.mha(q, k, v, layout, None, 0.3), _ragged_mha(q, k, v, layout, 0.3),
                               atol=1e-5, rtol=1e-5)
    assert not backend.extend_uses_mha(layout)     # 4.5 new tokens per request: the absorbed kernel
    long_layout, _ = _layout_and_cache([0], [300], 64, 80, gen)
    assert backend.extend_uses_mha(long_layout)


def test_backend_availability():
    assert registry.unavailable_reason("triton", _config()) is None
    assert "bfloat16" in registry.unavailable_reason("triton", _config(dtype=torch.bfloat16))
    assert "kv_lora_rank=512" in registry.unavailable_reason("triton", _config(kv_cache_dtype="fp8_e4m3"))
    assert registry.unavailable_reason("triton", _config(kv_cache_dtype="fp8_e4m3", rank=512, rope=64)) is None
    # on the CPU, "auto" takes the reference: the interpreter is for tests
    auto = registry.create("auto", _config())
    assert auto.primary.name == "torch" and auto.decode_peers == ()


def test_graph_hooks_write_static_buffers():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU backend test runs through the interpreter")
    gen = torch.Generator().manual_seed(31)
    backend = registry.create("triton", _config())
    with pytest.raises(ValueError, match="init_cuda_graph"):
        backend.plan_for_capture(_layout_and_cache([3], [1], 16, 80, gen)[0])
    backend.init_cuda_graph(max_batch_size=4, max_pages=8)
    layout, kv = _layout_and_cache([20, 50], [1, 1], 16, 80, gen)
    meta = backend.plan_for_capture(layout)
    q = torch.randn(2, 3, 80, generator=gen).to(torch.float16)
    captured = backend.mla(q, kv, layout, meta, 0.1, 64)
    # a later step of the same batch size: new tables and lengths land in the same buffers
    layout2, kv2 = _layout_and_cache([70, 4], [1, 1], 16, 80, gen)
    meta2 = backend.plan_for_replay(layout2)
    assert meta2 is meta and meta2.block_table.data_ptr() == meta.block_table.data_ptr()
    out = backend.mla(q, kv2, layout2, meta2, 0.1, 64)
    ref = reference.mla_decode(q.unsqueeze(1), kv2.double(), layout2.block_table, layout2.cache_seqlens, 0.1,
                               head_dim_v=64)[0].squeeze(1)
    torch.testing.assert_close(out.double(), ref.double(), **TOL[torch.float16])
    assert not torch.equal(out, captured)
    with pytest.raises(ValueError, match="no CUDA graph"):
        backend.plan_for_replay(_layout_and_cache([1, 2, 3], [1, 1, 1], 16, 80, gen)[0])
    with pytest.raises(ValueError, match="DECODE"):
        backend.plan_for_capture(_layout_and_cache([1], [3], 16, 80, gen, mode=ForwardMode.EXTEND)[0])


def test_tuning_script_runs_end_to_end(tmp_path):
    """scripts/tune_mla_decode.py --smoke: its whole pipeline (parallel compile, check, timing, JSON) on tiny shapes."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "tune_mla_decode.py"
    out = tmp_path / "tune.json"
    env = {**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    r = subprocess.run([sys.executable, str(script), "--smoke", "--only", "fp8", "--workers", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["rows"] and all(row["check"] == "ok" for row in data["rows"]), data["rows"]
    assert len({row["num_splits"] for row in data["rows"]}) > 1, "the smoke shape should try several split counts"
    assert data["best"]["16,fp8"]["config"] is not None
    assert "DEFAULT_CONFIGS = {" in r.stdout
