"""The MLA decode in Gluon for Hopper with the keys on wgmma's M side, for up to 32 query rows per request (h 16
s_q 1, h 32 s_q 1, h 16 s_q 2, ...), over bf16 caches and the FP8 656-byte cache: what the triton backend runs
there (MLADecodeConfig.gluon with 16- or 32-row blocks; the tl kernel elsewhere, on the same grid).

S^T = K Q^T and O^T = V^T P^T put a page's 64 keys on M and the query rows on N (BLOCK_R = 16 or 32), so no
MMA pads 16 or 32 rows to 64. Every MMA is bf16 with both operands in shared memory. FP8 pages are computed on
the format's values (fp8_format: the bf16 nearest e4m3 x scale), as the reference does: each page is
dequantized into a bf16 tile first.

Layout:
- a producer warp (warp_specialize worker) TMA-loads each page of the split into a STAGES-deep ring on
  mbarriers: bf16 as eight [64, 64] boxes of c_kv and one of k_pe; FP8 as three boxes of the same cache
  rows (e4m3 c_kv in four [64, 128] boxes, fp32 scales [64, 4], bf16 k_pe [64, 64]);
- FP8 (DQ_WG, the default): a dequantizing warpgroup converts each page into one of two bf16 tiles (16-byte
  loads, a bit trick of 2 instructions per byte and one bf16 multiply per pair, 32-byte stores) while one
  compute warpgroup works on the other; the producer loads c_kv in half-page units into a 2-deep raw ring (each
  unit freed as soon as it is dequantized) and k_pe into its own buffer beside the tile. The compute warpgroup
  reads the tiles as a bf16 ring and takes all 512 columns: S^T whole (no exchange), O^T [512, BLOCK_R] (at 32
  rows 128 registers a thread). Two tiles do not fit beside 32 rows' Q and the exchange buffers of two compute
  warpgroups; with one there is nothing to exchange (bench/NOTES.md 84). With PIPE_S the next page's S^T is
  issued behind O^T, so that the tensor cores run it while the warpgroup waits for O^T and releases the tile;
- bf16, and FP8 without DQ_WG: two compute warpgroups split the 512 c_kv columns in halves. Per page each one
  - FP8: dequantizes its half into the one shared bf16 tile; bf16: the ring stage is the tile,
  - computes its partial S^T = K_half Q_half^T ([64 keys, BLOCK_R rows]; warpgroup 0 adds k_pe q_pe^T),
  - exchanges the partials through shared memory (an mbarrier of 2 arrivals per page), so that both run the
    same online softmax along the keys,
  - and computes O^T_half += V^T_half P^T, V^T read MN-major from the same tile.
  Both store their own 256 output columns; warpgroup 0 stores lse. A bf16 stage (or DQ_WG tile) is freed
  once O^T is done (2 stages); an FP8 stage dequantized in place once its halves are and S^T is done (3
  stages fit beside the tile at 16 rows, 2 at 32).
Registers: the second compute warpgroup 168 at 16 rows, 208 at 32 (32 spill 32 B at 168); DQ_WG's compute
warpgroup is the default partition and takes what the dequantizer (96) and the producer (24) leave.
Cache rows past the request's end: FP8 gets scale 0 there (the bit trick makes every byte finite, NaN bytes
included); bf16 zeroes them in the stage before use (NaN in unused slots); their scores are masked.

Measured (H200, scripts/gluon_narrow_check.py, bench/NOTES.md items 35, 37), h 16, b 128 s_k 4k-32k and b 1/4/16
at 32k: bf16 1.06-1.14x the tl kernel; FP8 with the dequantizing warpgroup (beside two compute warpgroups, then)
1.02-1.10x the kernel's own bf16 time (in place: 0.98-1.03x). h 32 (N = 32), b 128 s_k 4k-32k: bf16 1.35-1.39x
the tl kernel and 1.14x the 64-row Gluon kernel; FP8 in place 0.80-0.87x its bf16. The dequantizing warpgroup
with one compute warpgroup (decode_ab, bench/NOTES.md 84): FP8 at 32 rows 1.28-1.35x in place at b 128, 1.11-1.28x
at b 1/4/16; at 16 rows 1.03-1.04x the dequantizer beside two compute warpgroups (b 1/4, b 128 s_k 1024). What
bounded FP8 before (16 rows, two compute warpgroups): from L2 (scripts/chain_rate.py, NARROW_POOL) a page took
1.92 us with the dequantizing warpgroup and 2.07 in place against bf16's 1.34, the same as from HBM: the chain,
not the loads. A second dequantizing warpgroup, k_pe in its own 3-deep ring and an L2 prefetch of the pages
ahead measured no faster; overlapping the next page's dequantize with O^T (in place) 9% slower, K from registers
10-15% slower (branch wip/fp8-dequant-variants).
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_init, warpgroup_mma_wait)

from mlaserve.kernels import fp8_format
from mlaserve.kernels.triton import mla_decode_gluon
from mlaserve.kernels.triton.mla_decode_gluon import (dequantize_group, finish_rows, split_and_visibility,
                                                       zero_rows_from)

PAGE = gl.constexpr(64)       # cached tokens per page = per step = the MMA's M
D_V = gl.constexpr(512)
GROUP = gl.constexpr(128)     # columns per FP8 scale
HALF = gl.constexpr(256)      # columns per compute warpgroup
D_PE = gl.constexpr(64)
ROW_BYTES = gl.constexpr(656)
LOG2E = gl.constexpr(1.4426950408889634)
MAX_ROWS = 32                 # query rows per request: the MMA's N is 16 or 32 (BLOCK_R)
# FP8 pages through the dequantizing warpgroup (two bf16 tiles, one compute warpgroup), against the two compute
# warpgroups dequantizing into one tile themselves (decode_ab's DEQUANT_WG; bench/NOTES.md 84)
DEQUANT_WG = True
# DQ_WG's compute warpgroup issues the next page's S^T right behind this page's O^T, before waiting for O^T, so that
# the tensor cores run it while the warpgroup finishes the page (decode_ab's NARROW_PIPE_S against it off: b 128
# h 32 s_k 4k/8k/32k 1.032/1.044/1.051x, b 16 1.032x; b 4 at s_k 32768, 16-page splits, 0.978-0.994x: each split
# ends with one S^T more, discarded), where a split spans at least PIPE_S_MIN_PAGES pages (bench/NOTES.md 88)
PIPE_S = True
PIPE_S_MIN_PAGES = 32


@gluon.jit
def _load_partition(ckv_desc, sc_desc, kpe_desc, bt_row, ckv_smem, sc_smem, kpe_smem, ready, empty, raw_ready,
                    raw_empty, first_page, n_tiles, STAGES: gl.constexpr, KV_FP8: gl.constexpr,
                    DQ_WG: gl.constexpr, RAW_UNITS: gl.constexpr, BT_EARLY: gl.constexpr = False):
    """The producer warp: page t of the split into ring stage t % STAGES once the stage is free. With DQ_WG the
    page's c_kv goes in two half-page units (columns 0-255, 256-511; the page's scales with each) into the raw
    ring (RAW_UNITS deep, raw_ready / raw_empty), and k_pe straight into the bf16 tile t % 2 once it is free.
    BT_EARLY (mla_decode_gluon.BT_EARLY): without DQ_WG, the page's block-table entry is read before the wait for
    its stage instead of after it."""
    for t in range(n_tiles):
        s = t % STAGES
        if DQ_WG:
            row = gl.load(bt_row + first_page + t) * PAGE
            for hh in gl.static_range(2):
                u = 2 * t + hh
                r = u % RAW_UNITS
                mbarrier.wait(raw_empty.index(r), ((u // RAW_UNITS) & 1) ^ 1)
                mbarrier.expect(raw_ready.index(r), PAGE * (HALF + 4 * 4))
                for g in gl.static_range(2):
                    tma.async_copy_global_to_shared(ckv_desc, [row, (2 * hh + g) * GROUP], raw_ready.index(r),
                                                    ckv_smem.index(r).slice(g * GROUP, GROUP, dim=1))
                tma.async_copy_global_to_shared(sc_desc, [row, D_V // 4], raw_ready.index(r), sc_smem.index(r))
            mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), PAGE * D_PE * 2)
            tma.async_copy_global_to_shared(kpe_desc, [row, (D_V + 16) // 2], ready.index(s), kpe_smem.index(s))
        else:
            if BT_EARLY:
                row = gl.load(bt_row + first_page + t) * PAGE
            mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
            if not BT_EARLY:
                row = gl.load(bt_row + first_page + t) * PAGE
            bar = ready.index(s)
            if KV_FP8:
                mbarrier.expect(bar, PAGE * (D_V + 4 * 4 + D_PE * 2))
                for g in gl.static_range(4):
                    tma.async_copy_global_to_shared(ckv_desc, [row, g * GROUP], bar,
                                                    ckv_smem.index(s).slice(g * GROUP, GROUP, dim=1))
                tma.async_copy_global_to_shared(sc_desc, [row, D_V // 4], bar, sc_smem.index(s))
                tma.async_copy_global_to_shared(kpe_desc, [row, (D_V + 16) // 2], bar, kpe_smem.index(s))
            else:
                mbarrier.expect(bar, PAGE * (D_V + D_PE) * 2)
                for c in gl.static_range(D_V // D_PE):
                    tma.async_copy_global_to_shared(ckv_desc, [row, c * D_PE], bar,
                                                    ckv_smem.index(s).slice(c * D_PE, D_PE, dim=1))
                tma.async_copy_global_to_shared(ckv_desc, [row, D_V], bar, kpe_smem.index(s))


@gluon.jit
def _dequant_partition(raw_smem, rsc_smem, tiles, raw_ready, raw_empty, ready, empty, seqlens_ptr, b, num_splits,
                       H, S_Q, CAUSAL: gl.constexpr, RAW_UNITS: gl.constexpr):
    """DQ_WG's dequantizing warpgroup: each FP8 page from its two raw units into the bf16 tile t % 2 (once the
    compute warpgroup is done with it), a unit freed as soon as it is read; the tile's ready barrier takes
    this arrival and the producer's k_pe bytes."""
    CVT: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    SCL: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
    split = gl.program_id(1)
    rows = gl.arange(0, 16, gl.SliceLayout(1, SCL))        # only for the helper's per-row visibility, unused
    seqlen, start, n_tiles, _, _ = split_and_visibility(seqlens_ptr, b, split, num_splits, rows, H, S_Q, CAUSAL)
    for t in range(n_tiles):
        s = t % 2
        mbarrier.wait(empty.index(s), ((t // 2) & 1) ^ 1)
        n_valid = seqlen - (start + t * PAGE)
        for hh in gl.static_range(2):
            u = 2 * t + hh
            r = u % RAW_UNITS
            mbarrier.wait(raw_ready.index(r), (u // RAW_UNITS) & 1)
            sc = rsc_smem.index(r).load(SCL)
            for g in gl.static_range(2):
                dequantize_group(raw_smem.index(r).slice(g * GROUP, GROUP, dim=1), sc,
                                 tiles.index(s).slice((2 * hh + g) * GROUP, GROUP, dim=1), 2 * hh + g, n_valid,
                                 CVT, SCL)
            gl.thread_barrier()
            mbarrier.arrive(raw_empty.index(r))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(ready.index(s))


@gluon.jit
def _consumer(q_smem, qpe_smem, ckv_smem, sc_smem, kpe_smem, kbuf, pt_smem, xbuf, ready, empty, xbar, seqlens_ptr, b,
              out_ptr, lse_ptr, po_ptr, pl_ptr, qk_scale, num_splits, H, S_Q, ROWS, stride_pob, stride_pos,
              CAUSAL: gl.constexpr, IS_SPLIT: gl.constexpr, STAGES: gl.constexpr, KV_FP8: gl.constexpr,
              BLOCK_R: gl.constexpr, DQ_WG: gl.constexpr, W: gl.constexpr, COLS: gl.constexpr = HALF,
              PIPE_S: gl.constexpr = False):
    """Compute warpgroup W: columns W * 256 .. W * 256 + COLS - 1 of every page (FP8: dequantized into kbuf;
    partial S^T; O^T); with COLS 256, S^T's two partials are exchanged through shared memory, so both warpgroups run
    the same softmax; with COLS 512 (DQ_WG's one compute warpgroup) the warpgroup has all of S^T itself.
    Stores its COLS output columns (warpgroup 0 the lse too). With DQ_WG the ring is of bf16 tiles that the
    dequantizing warpgroup fills, read as a bf16 ring (its rows past the request's end already 0)."""
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_R, 16])
    DEQUANT_HERE: gl.constexpr = KV_FP8 and DQ_WG == 0
    EXCHANGE: gl.constexpr = COLS == HALF
    PIPE: gl.constexpr = PIPE_S and not EXCHANGE
    KEY_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)     # per key (M) of S^T
    ROW_S: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)     # per query row (N) of S^T
    CVT: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    SCL: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])

    split = gl.program_id(1)
    rows = gl.arange(0, BLOCK_R, ROW_S)
    seqlen, start, n_tiles, vis, min_vis = split_and_visibility(seqlens_ptr, b, split, num_splits, rows, H, S_Q,
                                                                CAUSAL)
    m_i = gl.full([BLOCK_R], float("-inf"), gl.float32, ROW_S)
    l_acc = gl.zeros([PAGE, BLOCK_R], gl.float32, S_LAYOUT)
    o0 = gl.zeros([GROUP, BLOCK_R], gl.float32, S_LAYOUT)
    o1 = gl.zeros([GROUP, BLOCK_R], gl.float32, S_LAYOUT)
    o2 = gl.zeros([GROUP, BLOCK_R], gl.float32, S_LAYOUT)     # COLS 512 only
    o3 = gl.zeros([GROUP, BLOCK_R], gl.float32, S_LAYOUT)
    zero_s = gl.zeros([PAGE, BLOCK_R], gl.float32, S_LAYOUT)
    pt = pt_smem.index(W)
    if PIPE:
        acc = warpgroup_mma_init(zero_s)
        if n_tiles > 0:
            mbarrier.wait(ready.index(0), 0)
            acc = _scores(ckv_smem.index(0), kpe_smem.index(0), q_smem, qpe_smem, zero_s, W, COLS)
    for t in range(n_tiles):
        s = t % STAGES
        if not PIPE:
            mbarrier.wait(ready.index(s), (t // STAGES) & 1)
        tok0 = start + t * PAGE
        if DEQUANT_HERE:
            # -- this warpgroup's half of the page, dequantized into kbuf --
            sc = sc_smem.index(s).load(SCL)
            for g in gl.static_range(2 * W, 2 * W + COLS // GROUP):
                dequantize_group(ckv_smem.index(s).slice(g * GROUP, GROUP, dim=1), sc,
                                 kbuf.slice(g * GROUP, GROUP, dim=1), g, seqlen - tok0, CVT, SCL)
            fence_async_shared()
            gl.thread_barrier()
            kv = kbuf
        else:
            kv = ckv_smem.index(s)
            if not KV_FP8:
                if tok0 + PAGE > seqlen:
                    # rows past the request's end (NaN in unused slots) zeroed in this half: O^T reads them
                    zero_rows_from(kv, seqlen - tok0, W * HALF, COLS, CVT)
                    fence_async_shared()
                    gl.thread_barrier()
        # -- partial S^T over these columns (and k_pe q_pe^T in warpgroup 0); PIPE: issued last page --
        if PIPE:
            sacc = warpgroup_mma_wait(0, deps=[acc])
        else:
            # _scores' two MMAs, spelled out: through the helper ptxas schedules the bf16 and unpipelined FP8 kernels
            # differently (gluon_sass.py cmp), and those builds are the ones measured
            acc = warpgroup_mma(kv.slice(W * HALF, COLS, dim=1), q_smem.slice(W * HALF, COLS, dim=1).permute((1, 0)),
                                zero_s, use_acc=False, is_async=True)
            if W == 0:
                acc = warpgroup_mma(kpe_smem.index(s), qpe_smem.permute((1, 0)), acc, is_async=True)
            sacc = warpgroup_mma_wait(0, deps=[acc])
        gl.thread_barrier()
        if DEQUANT_HERE:
            mbarrier.arrive(empty.index(s))       # the raw stage is done with (the ring has 2 arrivals a fill)
        if EXCHANGE:
            # -- exchange the partials: S^T = warpgroup 0's + warpgroup 1's, the same sum in both --
            x = t % 2
            xbuf.index(2 * x + W).store(sacc)
            gl.thread_barrier()
            mbarrier.arrive(xbar.index(x))
            mbarrier.wait(xbar.index(x), (t // 2) & 1)
            other = xbuf.index(2 * x + 1 - W).load(S_LAYOUT)
            if W == 0:
                sco = sacc + other
            else:
                sco = other + sacc
        else:
            sco = sacc
        sco = sco * qk_scale
        p, alpha, m_i, l_acc = softmax_keys_on_m(sco, m_i, l_acc, tok0, min_vis, vis, KEY_S)
        pt.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        # -- O^T of this warpgroup's two column groups: V^T from kbuf (MN-major), P^T from shared memory --
        o0 = warpgroup_mma(kv.slice(W * HALF, GROUP, dim=1).permute((1, 0)), pt, o0 * alpha[None, :],
                           is_async=True)
        o1 = warpgroup_mma(kv.slice(W * HALF + GROUP, GROUP, dim=1).permute((1, 0)), pt, o1 * alpha[None, :],
                           is_async=True)
        if EXCHANGE:
            o0, o1 = warpgroup_mma_wait(0, deps=[o0, o1])
        else:
            o2 = warpgroup_mma(kv.slice(2 * GROUP, GROUP, dim=1).permute((1, 0)), pt, o2 * alpha[None, :],
                               is_async=True)
            o3 = warpgroup_mma(kv.slice(3 * GROUP, GROUP, dim=1).permute((1, 0)), pt, o3 * alpha[None, :],
                               is_async=True)
            if PIPE:
                # the next page's S^T queued behind O^T (the last page's own again, discarded: a wait needs a
                # fixed count); O^T's four groups done leaves S^T's (up to) two pending
                tn = gl.minimum(t + 1, n_tiles - 1)
                mbarrier.wait(ready.index(tn % STAGES), (tn // STAGES) & 1)
                acc = _scores(ckv_smem.index(tn % STAGES), kpe_smem.index(tn % STAGES), q_smem, qpe_smem, zero_s,
                              W, COLS)
                o0, o1, o2, o3 = warpgroup_mma_wait(2 if W == 0 else 1, deps=[o0, o1, o2, o3])
            else:
                o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=[o0, o1, o2, o3])
        gl.thread_barrier()                       # kbuf and P^T are free for the next page
        if not DEQUANT_HERE:
            mbarrier.arrive(empty.index(s))       # the stage is done with (an arrival per compute warpgroup)

    if PIPE:
        warpgroup_mma_wait(0, deps=[acc])     # the discarded S^T of the last page
    inv_l, lse = finish_rows(m_i, gl.sum(l_acc, 0), ROW_S)
    row_ok = rows < ROWS
    _store_group(o0, 2 * W, inv_l, rows, row_ok, b, split, ROWS, out_ptr, po_ptr, stride_pob, stride_pos,
                 IS_SPLIT, S_LAYOUT)
    _store_group(o1, 2 * W + 1, inv_l, rows, row_ok, b, split, ROWS, out_ptr, po_ptr, stride_pob, stride_pos,
                 IS_SPLIT, S_LAYOUT)
    if not EXCHANGE:
        _store_group(o2, 2, inv_l, rows, row_ok, b, split, ROWS, out_ptr, po_ptr, stride_pob, stride_pos, IS_SPLIT,
                     S_LAYOUT)
        _store_group(o3, 3, inv_l, rows, row_ok, b, split, ROWS, out_ptr, po_ptr, stride_pob, stride_pos, IS_SPLIT,
                     S_LAYOUT)
    if W == 0:
        if IS_SPLIT:
            gl.store(pl_ptr + b * (num_splits * ROWS) + split * ROWS + rows, lse, mask=row_ok)
        else:
            gl.store(lse_ptr + b * ROWS + rows, lse, mask=row_ok)


@gluon.jit
def _scores(kv, kpe, q_smem, qpe_smem, zero_s, W: gl.constexpr, COLS: gl.constexpr):
    """A page's partial S^T over columns W * 256 .. + COLS - 1 (and k_pe q_pe^T in warpgroup 0), issued, not
    waited for."""
    acc = warpgroup_mma(kv.slice(W * HALF, COLS, dim=1), q_smem.slice(W * HALF, COLS, dim=1).permute((1, 0)),
                        zero_s, use_acc=False, is_async=True)
    if W == 0:
        acc = warpgroup_mma(kpe, qpe_smem.permute((1, 0)), acc, is_async=True)
    return acc


@gluon.jit
def softmax_keys_on_m(sco, m_i, l_acc, tok0, min_vis, vis, KEY: gl.constexpr):
    """One page of the online softmax along the keys (S^T's M, log2 units): scores of keys a row does not see
    (vis per row) masked where the page reaches past min_vis -> (P^T, the rows' rescale, new max, row sums kept
    per element)."""
    if tok0 + PAGE > min_vis:
        keys = tok0 + gl.arange(0, PAGE, KEY)
        sco = gl.where(keys[:, None] < vis[None, :], sco, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(sco, 0))
    m_base = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_base)
    p = gl.exp2(sco - m_base[None, :])
    return p, alpha, m_new, l_acc * alpha[None, :] + p


@gluon.jit
def _second_consumer(q_smem, qpe_smem, ckv_smem, sc_smem, kpe_smem, kbuf, pt_smem, xbuf, ready, empty, xbar,
                     seqlens_ptr, b, out_ptr, lse_ptr, po_ptr, pl_ptr, qk_scale, num_splits, H, S_Q, ROWS,
                     stride_pob, stride_pos, CAUSAL: gl.constexpr, IS_SPLIT: gl.constexpr, STAGES: gl.constexpr,
                     KV_FP8: gl.constexpr, BLOCK_R: gl.constexpr, DQ_WG: gl.constexpr):
    """The worker partition's entry: _consumer as warpgroup 1."""
    _consumer(q_smem, qpe_smem, ckv_smem, sc_smem, kpe_smem, kbuf, pt_smem, xbuf, ready, empty, xbar, seqlens_ptr, b,
              out_ptr, lse_ptr, po_ptr, pl_ptr, qk_scale, num_splits, H, S_Q, ROWS, stride_pob, stride_pos,
              CAUSAL, IS_SPLIT, STAGES, KV_FP8, BLOCK_R, DQ_WG, 1)


@gluon.jit
def _store_group(o, g: gl.constexpr, inv_l, rows, row_ok, b, split, ROWS, out_ptr, po_ptr, stride_pob, stride_pos,
                 IS_SPLIT: gl.constexpr, O_LAYOUT: gl.constexpr):
    """O^T_g [128, 16] normalized into out [.., row, 128 g + c] (or the fp32 split partials)."""
    store_columns(o, g * GROUP + gl.arange(0, GROUP, gl.SliceLayout(1, O_LAYOUT)), inv_l, rows, row_ok, b, split,
                  ROWS, out_ptr, po_ptr, stride_pob, stride_pos, IS_SPLIT)


@gluon.jit
def store_columns(o, cols, inv_l, rows, row_ok, b, split, ROWS, out_ptr, po_ptr, stride_pob, stride_pos,
                  IS_SPLIT: gl.constexpr):
    """O^T [columns, rows] normalized (inv_l per row) into out [.., row, cols] bf16, or the fp32 split partials."""
    o = o * inv_l[None, :]
    mask = (cols < D_V)[:, None] & row_ok[None, :]
    if IS_SPLIT:
        base = po_ptr + b.to(gl.int64) * stride_pob + split * stride_pos
        gl.store(base + rows[None, :] * D_V + cols[:, None], o, mask=mask)
    else:
        base = out_ptr + b.to(gl.int64) * ROWS * D_V
        gl.store(base + rows[None, :] * D_V + cols[:, None], o.to(gl.bfloat16), mask=mask)


@gluon.jit
def _mla_decode_narrow_kernel(ckv_desc, sc_desc, kpe_desc, q_ptr, bt_ptr, seqlens_ptr, out_ptr, lse_ptr, po_ptr,
                              pl_ptr, order_ptr, qk_scale, num_splits, H, S_Q, ROWS, stride_qb, stride_btb,
                              stride_pob, stride_pos, CAUSAL: gl.constexpr, IS_SPLIT: gl.constexpr,
                              STAGES: gl.constexpr, KV_FP8: gl.constexpr, BLOCK_R: gl.constexpr, DQ_WG: gl.constexpr,
                              ORDERED: gl.constexpr, BT_EARLY: gl.constexpr = False,
                              PIPE_S_: gl.constexpr = False):
    """Grid (b, num_splits); 4 + 4 compute warps + the producer warp; with DQ_WG 4 dequantizing warps + 4 compute
    warps (all 512 columns, no exchange of S^T partials) + the producer warp.
    q [b, ROWS, 576] bf16 (row = token j * H + head, ROWS <= BLOCK_R = 16 or 32); the cache behind its
    descriptors: FP8 as [pages * 64, 656] bytes (three, one per part of a row), bf16 as [pages * 64, 576] (one,
    [64, 64] boxes). out [b * ROWS, 512] bf16, lse [b * ROWS]; with splits po [b, splits, ROWS, 512] /
    pl [b, splits, ROWS] fp32 instead. ORDERED: the request axis runs through order_ptr (work_order.grid_order:
    longest first); the partitions get the request from here."""
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    # the second compute warpgroup's registers: 168 fit 16 rows; 32 rows spill 32 B there, none at 208
    WORKER_REGS: gl.constexpr = 168 if BLOCK_R == 16 else 208
    DQ_REGS: gl.constexpr = 96
    b = gl.program_id(0)
    if ORDERED:
        b = gl.load(order_ptr + b)
    split = gl.program_id(1)
    qr = gl.arange(0, BLOCK_R, gl.SliceLayout(1, QL))
    _, start, n_tiles, _, _ = split_and_visibility(seqlens_ptr, b, split, num_splits, qr, H, S_Q, CAUSAL)

    SMEM16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_R, D_V], SMEM16)
    qpe_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_R, D_PE], SMEM16)
    q_rows = q_ptr + b.to(gl.int64) * stride_qb + qr * (D_V + D_PE)
    q_smem.store(gl.load(q_rows[:, None] + gl.arange(0, D_V, gl.SliceLayout(0, QL))[None, :],
                         mask=(qr < ROWS)[:, None], other=0.0))
    qpe_smem.store(gl.load(q_rows[:, None] + D_V + gl.arange(0, D_PE, gl.SliceLayout(0, QL))[None, :],
                           mask=(qr < ROWS)[:, None], other=0.0))

    CKV_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    SC_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    PT_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([PAGE, BLOCK_R], gl.bfloat16)
    X_SMEM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    RAW_UNITS: gl.constexpr = 2
    if DQ_WG:
        # raw ring of half pages (e4m3 [64, 256] + the page's scales); STAGES = 2 bf16 tiles (c_kv; k_pe by TMA)
        ckv_smem = gl.allocate_shared_memory(gl.float8e4nv, [RAW_UNITS, PAGE, HALF], CKV_SMEM)
        sc_smem = gl.allocate_shared_memory(gl.float32, [RAW_UNITS, PAGE, 4], SC_SMEM)
        kbuf = gl.allocate_shared_memory(gl.bfloat16, [STAGES, PAGE, D_V], SMEM16)
    elif KV_FP8:
        ckv_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, PAGE, D_V], CKV_SMEM)
        sc_smem = gl.allocate_shared_memory(gl.float32, [STAGES, PAGE, 4], SC_SMEM)
        kbuf = gl.allocate_shared_memory(gl.bfloat16, [PAGE, D_V], SMEM16)
    else:
        ckv_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, PAGE, D_V], SMEM16)
        sc_smem = ckv_smem        # unused
        kbuf = ckv_smem           # unused: the stage is the bf16 tile
    kpe_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, PAGE, D_PE], SMEM16)
    pt_smem = gl.allocate_shared_memory(gl.bfloat16, [2, PAGE, BLOCK_R], PT_SMEM)
    if DQ_WG:
        xbuf = pt_smem            # unused: one compute warpgroup, no partials to exchange
    else:
        xbuf = gl.allocate_shared_memory(gl.float32, [4, PAGE, BLOCK_R], X_SMEM)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    xbar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=2 if DQ_WG else 1)   # DQ_WG: the dequantizer + k_pe's TMA
        mbarrier.init(empty.index(i), count=1 if DQ_WG else 2)    # the compute warpgroups
    mbarrier.init(xbar.index(0), count=2)
    mbarrier.init(xbar.index(1), count=2)
    raw_ready = gl.allocate_shared_memory(gl.int64, [RAW_UNITS, 1], mbarrier.MBarrierLayout())
    raw_empty = gl.allocate_shared_memory(gl.int64, [RAW_UNITS, 1], mbarrier.MBarrierLayout())
    if DQ_WG:
        for i in gl.static_range(RAW_UNITS):
            mbarrier.init(raw_ready.index(i), count=1)
            mbarrier.init(raw_empty.index(i), count=1)
    fence_async_shared()
    gl.thread_barrier()

    bt_row = bt_ptr + b.to(gl.int64) * stride_btb
    # (each call spells out its argument tuples: a tuple held in a variable loses its constexprs in Gluon)
    if DQ_WG:
        # one compute warpgroup reads the bf16 tiles (kbuf) as its ring; the dequantizer fills them
        gl.warp_specialize(
            [(_consumer, (q_smem, qpe_smem, kbuf, sc_smem, kpe_smem, kbuf, pt_smem, xbuf, ready, empty, xbar,
                          seqlens_ptr, b, out_ptr, lse_ptr, po_ptr, pl_ptr, qk_scale, num_splits, H, S_Q, ROWS,
                          stride_pob, stride_pos, CAUSAL, IS_SPLIT, STAGES, KV_FP8, BLOCK_R, DQ_WG, 0, D_V,
                          PIPE_S_)),
             (_dequant_partition, (ckv_smem, sc_smem, kbuf, raw_ready, raw_empty, ready, empty, seqlens_ptr, b,
                                   num_splits, H, S_Q, CAUSAL, RAW_UNITS)),
             (_load_partition, (ckv_desc, sc_desc, kpe_desc, bt_row, ckv_smem, sc_smem, kpe_smem, ready, empty,
                                raw_ready, raw_empty, start // PAGE, n_tiles, STAGES, KV_FP8, DQ_WG, RAW_UNITS,
                                BT_EARLY))],
            [4, 1], [DQ_REGS, 24])
    else:
        gl.warp_specialize(
            [(_consumer, (q_smem, qpe_smem, ckv_smem, sc_smem, kpe_smem, kbuf, pt_smem, xbuf, ready, empty, xbar,
                          seqlens_ptr, b, out_ptr, lse_ptr, po_ptr, pl_ptr, qk_scale, num_splits, H, S_Q, ROWS,
                          stride_pob, stride_pos, CAUSAL, IS_SPLIT, STAGES, KV_FP8, BLOCK_R, DQ_WG, 0)),
             (_second_consumer, (q_smem, qpe_smem, ckv_smem, sc_smem, kpe_smem, kbuf, pt_smem, xbuf, ready, empty,
                                 xbar, seqlens_ptr, b, out_ptr, lse_ptr, po_ptr, pl_ptr, qk_scale, num_splits, H, S_Q,
                                 ROWS, stride_pob, stride_pos, CAUSAL, IS_SPLIT, STAGES, KV_FP8, BLOCK_R, DQ_WG)),
             (_load_partition, (ckv_desc, sc_desc, kpe_desc, bt_row, ckv_smem, sc_smem, kpe_smem, ready, empty,
                                raw_ready, raw_empty, start // PAGE, n_tiles, STAGES, KV_FP8, DQ_WG, RAW_UNITS,
                                BT_EARLY))],
            [4, 1], [WORKER_REGS, 24])


def supports(q: torch.Tensor, kv_cache: torch.Tensor, head_dim_v: int) -> bool:
    """Whether this kernel takes the call: a Hopper GPU, a contiguous page-64 cache (FP8 or bf16), <= 32 query
    rows per request, bf16 q with d_qk 576, d_v 512."""
    b, s_q, h, d_qk = q.shape
    fp8 = kv_cache.dtype == torch.uint8 and kv_cache.dim() == 3 and kv_cache.shape[2] == ROW_BYTES.value
    bf16 = kv_cache.dtype == torch.bfloat16 and kv_cache.dim() == 3 and kv_cache.shape[2] == D_V.value + D_PE.value
    return (q.device.type == "cuda" and torch.cuda.get_device_capability(q.device)[0] == 9 and (fp8 or bf16)
            and kv_cache.is_contiguous() and kv_cache.shape[1] == PAGE.value
            and s_q * h <= MAX_ROWS and q.dtype == torch.bfloat16 and d_qk == D_V.value + D_PE.value
            and head_dim_v == D_V.value)


def ring_stages(kv_fp8: bool, rows: int, dq: bool, stages: int | None = None) -> int:
    """The ring's depth: 2 bf16 tiles with the dequantizing warpgroup; else `stages`, or 3 raw FP8 stages at <= 16
    rows (beside the one tile) and 2 otherwise."""
    return 2 if dq else stages or (3 if kv_fp8 and rows <= 16 else 2)


def pipes_scores(max_pages: int, num_splits: int) -> bool:
    """Whether DQ_WG's compute warpgroup issues each next page's S^T behind O^T (PIPE_S): where a split spans at
    least PIPE_S_MIN_PAGES pages (max_pages = the block table's columns; host shapes only)."""
    return PIPE_S and -(-max_pages // num_splits) >= PIPE_S_MIN_PAGES


def fp8_descriptors(kv_cache: torch.Tensor):
    """TMA descriptors over an FP8 cache's [pages * 64, 656] bytes: e4m3 c_kv in [64, 128] boxes (128-byte
    swizzle), the fp32 scales [64, 4], bf16 k_pe [64, 64]."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    flat, page = kv_cache.view(-1, ROW_BYTES.value), PAGE.value
    ckv_layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    sc_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    kpe_layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    return (TensorDescriptor.from_tensor(flat.view(torch.float8_e4m3fn), [page, GROUP.value], ckv_layout),
            TensorDescriptor.from_tensor(flat.view(torch.float32), [page, 4], sc_layout),
            TensorDescriptor.from_tensor(flat.view(torch.bfloat16), [page, D_PE.value], kpe_layout))


def mla_decode_gluon_narrow(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal, plan, out, lse,
                            stages: int | None = None, dequant_warpgroup: bool | None = None,
                            order: torch.Tensor | None = None) -> None:
    """ops.mla_decode's semantics for the calls `supports` takes, into out [b, s_q, h, 512] and lse [b, s_q, h]
    (contiguous, b > 0); `plan` from mla_decode_plan.plan_mla_decode with 16- or 32-row programs.
    `dequant_warpgroup` (FP8 only; the default there while DEQUANT_WG is on): a warpgroup dequantizes each page
    into one of two bf16 tiles while one compute warpgroup works on the other, instead of two compute warpgroups
    dequantizing into one tile themselves. `order`: int32 [b], the order in which the grid takes the requests
    (work_order.grid_order), or None for batch order."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from mlaserve.kernels.triton.mla_decode import combine_splits
    assert fp8_format.PACKED_BYTES == ROW_BYTES.value
    b, s_q, h, _ = q.shape
    rows, page = s_q * h, PAGE.value
    kv_fp8 = kv_cache.dtype == torch.uint8
    dq = kv_fp8 and DEQUANT_WG if dequant_warpgroup is None else dequant_warpgroup
    if dq and not kv_fp8:
        raise ValueError(f"dequant_warpgroup takes FP8 caches, got {kv_cache.dtype}")
    if kv_fp8:
        ckv_desc, sc_desc, kpe_desc = fp8_descriptors(kv_cache)
    else:
        layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        ckv_desc = sc_desc = kpe_desc = TensorDescriptor.from_tensor(kv_cache.view(-1, D_V.value + D_PE.value),
                                                                     [page, D_PE.value], layout)
    qc = q.contiguous()
    split = plan.num_splits > 1
    po, pl = (plan.partial_out, plan.partial_lse) if split else (out, lse)
    pipe_s = dq and pipes_scores(block_table.shape[1], plan.num_splits)
    _mla_decode_narrow_kernel[(b, plan.num_splits)](
        ckv_desc, sc_desc, kpe_desc, qc, block_table, cache_seqlens, out, lse, po, pl,
        cache_seqlens if order is None else order, softmax_scale * LOG2E.value, plan.num_splits, h, s_q, rows,
        qc.stride(0), block_table.stride(0), po.stride(0), po.stride(1),
        CAUSAL=causal, IS_SPLIT=split, STAGES=ring_stages(kv_fp8, rows, dq, stages),
        KV_FP8=kv_fp8, BLOCK_R=16 if rows <= 16 else 32, DQ_WG=dq, ORDERED=order is not None,
        BT_EARLY=mla_decode_gluon.BT_EARLY, PIPE_S_=pipe_s, num_warps=4)
    if split:
        combine_splits(plan, out, lse)
