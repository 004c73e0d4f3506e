"""The dense MLA decode in Gluon, Triton's layout-explicit dialect (triton.experimental.gluon, Triton 3.6), for
Hopper, in 64-row blocks: what `ops.mla_decode(..., backend="triton")` runs for FP8 KV in page-64 caches when the
plan says so (MLADecodeConfig.gluon with 64-row blocks, the default from 33 query rows per request up), and for
bf16 KV where mla_decode_gluon_seesaw.SEESAW is off (the seesaw kernel there measured 1.07-1.19x this one's serial
page chain on the H200, bench/NOTES.md item 80); elsewhere mla_decode.py runs the `tl` kernel with the same plan
and grid.

Why: the `tl` kernel tops out at 270-300 TFLOP/s at h 128 (bench/NOTES.md items 21, 23, 25): Triton
chooses where tiles live, loads KV with cp.async per thread and serializes the MMAs with the softmax.
Here the kernel says where things live:
- a producer warp (warp_specialize worker, 24 registers) TMA-loads Q once and each page of the request's
  split ([64, 576] bf16: eight [64, 64] boxes of c_kv and one of k_pe) into a STAGES-deep ring completed on
  mbarriers;
- the 8 compute warps (two warpgroups, wgmma layout warps [4, 2]) compute S = Q K^T (each warpgroup 32 of
  the page's 64 keys, Q and K from shared memory), the online softmax in registers (row max across the
  two warpgroups by the layout's reduction; row sums kept per element and reduced once at the end, 3-5%
  faster than a reduction per page), P to shared memory, and O += P V with each
  warpgroup accumulating 256 of the 512 columns, V being the page's c_kv read MN-major from the same ring
  stage; then they free the stage.
FP8 KV (the 656-byte format): the producer loads each page's e4m3 c_kv, scales and bf16 k_pe (three descriptors
over the same cache rows) into the ring; the compute warps first dequantize the page's c_kv into one bf16 tile
(the format's values, the bit trick of dequantize_group; rows past the request's end get scale 0 and become 0),
which S and P V then read as they read a bf16 stage; the ring stage is freed as soon as S is done. One tile (the
smem holds Q, two raw stages and one tile), so a page's dequantize waits for the P V before it: 0.72-0.79x the
bf16 time at h 64/128 in the benchmark (0.77-0.92x in scripts/gluon_check.py), 1.7-1.8x the tl kernel's FP8
(bench/NOTES.md item 42).
A CTA owns 64 query rows of one request (row = token j * h + head): rows past s_q * h (h 16/32, odd h)
are computed on zeros or on the next request's queries and never stored. Cache rows past the request's
end in its last page are zeroed in shared memory before P V (a masked P of 0 times a NaN left in an
unused slot would be NaN). Splits write fp32 partials that mla_decode.combine_splits reduces.

FA3's order (S of page t + 1 issued before P V of page t, P as the register A operand) measured 20% slower
on the H200 than this serial order: with two ring stages, S of page t + 1 waits for a load that starts
only when P V of page t - 1 frees its stage (bench/NOTES.md item 27). It is not here.
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

BLOCK_M = gl.constexpr(64)    # query rows per CTA (one wgmma M)
GROUP = gl.constexpr(128)     # FP8: columns per scale (an e4m3 TMA box is [64, 128])
ROW_BYTES = gl.constexpr(656)  # FP8: bytes per cached token (fp8_format)
PAGE = gl.constexpr(64)       # cached tokens per page = per step
D_QK = gl.constexpr(576)
D_V = gl.constexpr(512)
BOX = gl.constexpr(64)        # TMA box columns (128 bytes of bf16: one 128-byte swizzle atom)
NBOX = gl.constexpr(8)        # D_V // BOX: the c_kv boxes; k_pe is one more box, in its own buffer
LOG2E = gl.constexpr(1.4426950408889634)
TWO_POW_120 = gl.constexpr(2.0 ** 120)


@gluon.jit
def _load_partition(q_desc, kv_desc, sc_desc, kpe_desc, bt_row, q_smem, qpe_smem, kv_smem, sc_smem, kpe_smem, q_bar,
                    ready, empty, q_row0, first_page, n_tiles, STAGES: gl.constexpr, KV_FP8: gl.constexpr,
                    BT_EARLY: gl.constexpr):
    """The producer warp: Q once, then page t of the split into ring stage t % STAGES once it is free (FP8: the
    e4m3 c_kv in four [64, 128] boxes, the [64, 4] scales and the bf16 k_pe, through three descriptors over
    the same cache rows). BT_EARLY: the page's block-table entry is read before the wait for the stage, so that
    its latency passes during the wait instead of after it."""
    mbarrier.expect(q_bar, BLOCK_M * D_QK * 2)
    for c in gl.static_range(NBOX):
        tma.async_copy_global_to_shared(q_desc, [q_row0, c * BOX], q_bar, q_smem.slice(c * BOX, BOX, dim=1))
    tma.async_copy_global_to_shared(q_desc, [q_row0, D_V], q_bar, qpe_smem)
    for t in range(n_tiles):
        s = t % STAGES
        if BT_EARLY:
            page = gl.load(bt_row + first_page + t)
        # fill t // STAGES of stage s waits for the release of the fill before it (the first round passes)
        mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
        if not BT_EARLY:
            page = gl.load(bt_row + first_page + t)
        bar = ready.index(s)
        if KV_FP8:
            mbarrier.expect(bar, PAGE * ROW_BYTES)
            for g in gl.static_range(D_V // GROUP):
                tma.async_copy_global_to_shared(kv_desc, [page * PAGE, g * GROUP], bar,
                                                kv_smem.index(s).slice(g * GROUP, GROUP, dim=1))
            tma.async_copy_global_to_shared(sc_desc, [page * PAGE, D_V // 4], bar, sc_smem.index(s))
            tma.async_copy_global_to_shared(kpe_desc, [page * PAGE, (D_V + 16) // 2], bar, kpe_smem.index(s))
        else:
            mbarrier.expect(bar, PAGE * D_QK * 2)
            for c in gl.static_range(NBOX):
                tma.async_copy_global_to_shared(kv_desc, [page * PAGE, c * BOX], bar,
                                                kv_smem.index(s).slice(c * BOX, BOX, dim=1))
            tma.async_copy_global_to_shared(kv_desc, [page * PAGE, D_V], bar, kpe_smem.index(s))


@gluon.jit
def e4m3_times(x, c):
    """e4m3 bytes x (uint8) times bf16 c -> bf16, rounded once: the bf16 whose bits are sign | (byte & 0x7f) << 4
    is the byte's value times 2^-120 (subnormals included), so c carries the scale times 2^120. Each byte goes
    sign-extended into a 16-bit lane (prmt), << 4 puts its magnitude bits in place, the mask keeps the sign."""
    return gl.inline_asm_elementwise(
        """{
        .reg .b32 lo, hi;
        prmt.b32 lo, $2, 0, 0x9180;
        prmt.b32 hi, $2, 0, 0xB3A2;
        shl.b32 lo, lo, 4;
        shl.b32 hi, hi, 4;
        and.b32 lo, lo, 0x87F087F0;
        and.b32 hi, hi, 0x87F087F0;
        mul.rn.bf16x2 $0, lo, $3;
        mul.rn.bf16x2 $1, hi, $4;
        }""",
        "=r,=r,r,r,r", [x, c], dtype=gl.bfloat16, is_pure=True, pack=4)


@gluon.jit
def dequantize_group(src, sc, dst, g: gl.constexpr, n_valid, CVT: gl.constexpr, SCL: gl.constexpr):
    """c_kv group g of a page (src, e4m3 [64, 128]) times its per-key scale (column g of sc [64, 4]), rounded
    once to bf16 (the format's values), into dst (bf16 [64, 128]); keys n_valid.. (past the request's end: NaN
    in unused slots) get scale 0, and the bit trick turns every byte, NaN's included, into a finite bf16, so
    they become 0."""
    cols = gl.arange(0, 4, gl.SliceLayout(0, SCL))
    c = gl.sum(gl.where(cols[None, :] == g, sc, 0.0), 1)
    c = gl.convert_layout(c, gl.SliceLayout(1, CVT))      # the same rows per thread: no data moves
    keys = gl.arange(0, PAGE, gl.SliceLayout(1, CVT))
    c = gl.where(keys < n_valid, c * TWO_POW_120, 0.0).to(gl.bfloat16)   # exact: scales are bf16 <= 2^7
    raw = src.load(CVT)
    x, cb = gl.broadcast(raw.to(gl.uint8, bitcast=True), c[:, None])
    dst.store(e4m3_times(x, cb))


@gluon.jit
def zero_rows_from(kv, first, col0: gl.constexpr, ncols: gl.constexpr, LAYOUT: gl.constexpr):
    """Zero rows first .. PAGE - 1 of columns col0 .. col0 + ncols - 1 of a stage's c_kv [PAGE, 512] in
    shared memory, one 64-column box at a time, loaded and stored in LAYOUT."""
    keep = (gl.arange(0, PAGE, gl.SliceLayout(1, LAYOUT)) < first)[:, None]
    for c in gl.static_range(ncols // BOX):
        box = kv.slice(col0 + c * BOX, BOX, dim=1)
        x = box.load(LAYOUT)
        box.store(gl.where(keep, x, gl.zeros_like(x)))


@gluon.jit
def _compute_partition(q_smem, qpe_smem, kv_smem, sc_smem, kpe_smem, kbuf, p_smem, q_bar, ready, empty, n_tiles,
                       start, seqlen, vis_len, min_vis, qk_scale, STAGES: gl.constexpr, DTYPE: gl.constexpr,
                       S_LAYOUT: gl.constexpr, O_LAYOUT: gl.constexpr, KV_FP8: gl.constexpr):
    """The 8 compute warps: the online softmax over the split's pages -> (O unnormalized, row max, row sum).
    FP8: each page's c_kv is first dequantized from its ring stage into the one bf16 tile kbuf (the format's
    values; rows past the request's end become 0), which S and P V then read; the stage is freed once S is done."""
    CVT: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [8, 1], [1, 0])     # [64, 128]: 16 bytes a thread
    SCL: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [8, 1], [1, 0])      # [64, 4] scales, CVT's rows
    ROW_S: gl.constexpr = gl.SliceLayout(1, S_LAYOUT)
    COL_S: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, ROW_S)
    l_acc = gl.zeros([BLOCK_M, PAGE], gl.float32, S_LAYOUT)   # row sums per element: no reduction per page
    acc = gl.zeros([BLOCK_M, D_V], gl.float32, O_LAYOUT)
    vis = gl.convert_layout(vis_len, ROW_S)
    mbarrier.wait(q_bar, 0)
    for t in range(n_tiles):
        s = t % STAGES
        mbarrier.wait(ready.index(s), (t // STAGES) & 1)
        tok0 = start + t * PAGE
        if KV_FP8:
            scales = sc_smem.index(s).load(SCL)
            for g in gl.static_range(D_V // GROUP):
                dequantize_group(kv_smem.index(s).slice(g * GROUP, GROUP, dim=1), scales,
                                 kbuf.slice(g * GROUP, GROUP, dim=1), g, seqlen - tok0, CVT, SCL)
            fence_async_shared()
            gl.thread_barrier()                   # the tile in place for both warpgroups' wgmma
            kv = kbuf
        else:
            kv = kv_smem.index(s)
        sc = warpgroup_mma(q_smem, kv.permute((1, 0)), gl.zeros([BLOCK_M, PAGE], gl.float32, S_LAYOUT),
                           use_acc=False, is_async=True)
        sc = warpgroup_mma(qpe_smem, kpe_smem.index(s).permute((1, 0)), sc, is_async=True)
        sc = warpgroup_mma_wait(0, deps=[sc])
        if KV_FP8:
            gl.thread_barrier()                   # both warpgroups are done with the stage (raw c_kv, k_pe)
            mbarrier.arrive(empty.index(s))
        p, alpha, m_new = softmax_rows_on_m(sc * qk_scale, m_i, tok0, min_vis, vis, COL_S)
        l_acc = l_acc * alpha[:, None] + p
        m_i = m_new
        if not KV_FP8 and tok0 + PAGE > seqlen:
            # S is done with them: they are masked keys (8 warps, a box at a time)
            zero_rows_from(kv, seqlen - tok0, 0, D_V, gl.BlockedLayout([1, 8], [8, 4], [8, 1], [1, 0]))
        p_smem.store(p.to(DTYPE))
        fence_async_shared()
        gl.thread_barrier()                       # P (and zeroed V rows) in place for both warpgroups' wgmma
        acc = acc * gl.convert_layout(alpha, ROW_O)[:, None]
        acc = warpgroup_mma(p_smem, kv, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        gl.thread_barrier()                       # both warpgroups are done reading the stage (tile) and P
        if not KV_FP8:
            mbarrier.arrive(empty.index(s))
    return acc, m_i, gl.sum(l_acc, 1)


@gluon.jit
def softmax_rows_on_m(sc, m_i, tok0, min_vis, vis, COL_S: gl.constexpr):
    """One page of the online softmax along S's columns (the keys; log2 units, scale applied): scores of keys a row
    does not see (vis per row) masked where the page reaches past min_vis -> (P, the rows' rescale, new max)."""
    if tok0 + PAGE > min_vis:
        keys = tok0 + gl.arange(0, PAGE, COL_S)
        sc = gl.where(keys[None, :] < vis[:, None], sc, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(sc, 1))
    # a row that has seen no key yet keeps m = -inf: exponentiate against 0 so that it stays 0, not NaN
    m_base = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_base)
    return gl.exp2(sc - m_base[:, None]), alpha, m_new


@gluon.jit
def program_item(order_ptr, ROWS, ORDERED: gl.constexpr):
    """-> (request, 64-row tile, split) of this program of a grid (b * cdiv(ROWS, 64), num_splits); ORDERED: the
    request axis runs through order_ptr (work_order.grid_order: longest first)."""
    tiles = gl.cdiv(ROWS, BLOCK_M)
    b = gl.program_id(0) // tiles
    if ORDERED:
        b = gl.load(order_ptr + b)
    return b, gl.program_id(0) % tiles, gl.program_id(1)


@gluon.jit
def split_pages(seqlens_ptr, b, split, num_splits):
    """-> (request b's length, its split's first token, the split's pages). Splits are whole pages,
    cdiv(cdiv(length, num_splits), 64) * 64 tokens each."""
    seqlen = gl.load(seqlens_ptr + b)
    split_len = gl.cdiv(gl.cdiv(seqlen, num_splits), PAGE) * PAGE
    start = split * split_len
    end = gl.minimum(start + split_len, seqlen)
    return seqlen, start, gl.maximum(gl.cdiv(end - start, PAGE), 0)


@gluon.jit
def split_and_visibility(seqlens_ptr, b, split, num_splits, rows, H, S_Q, CAUSAL: gl.constexpr):
    """-> (request b's length, its split's first token, the split's pages, per row the keys it sees, the
    fewest keys any row sees). Splits are whole pages, cdiv(cdiv(length, num_splits), 64) * 64 tokens each;
    causal: new token j (rows j * H .. j * H + H - 1) sees 0 .. length - S_Q + j."""
    seqlen, start, n_tiles = split_pages(seqlens_ptr, b, split, num_splits)
    if CAUSAL:
        vis_len = gl.minimum(seqlen - S_Q + 1 + rows // H, seqlen)
        min_vis = gl.maximum(seqlen - S_Q + 1, 0)
    else:
        vis_len = gl.zeros_like(rows) + seqlen
        min_vis = seqlen
    return seqlen, start, n_tiles, vis_len, min_vis


@gluon.jit
def finish_rows(m_i, l_i, ROW_LAYOUT: gl.constexpr):
    """(1 / row sum, lse in natural log) in ROW_LAYOUT from the softmax's row max (log2 units) and row sum;
    rows that saw no key get 1 / sum = 1 (their O is 0) and lse = -inf."""
    l_o = gl.convert_layout(l_i, ROW_LAYOUT)
    m_o = gl.convert_layout(m_i, ROW_LAYOUT)
    empty_row = l_o == 0.0
    inv_l = 1.0 / gl.where(empty_row, 1.0, l_o)
    lse = gl.where(empty_row, float("-inf"), (m_o + gl.log2(gl.where(empty_row, 1.0, l_o))) / LOG2E)
    return inv_l, lse


@gluon.jit
def _mla_decode_gluon_kernel(q_desc, kv_desc, sc_desc, kpe_desc, bt_ptr, seqlens_ptr, out_ptr, lse_ptr, po_ptr,
                             pl_ptr, order_ptr, qk_scale, num_splits, H, S_Q, ROWS, stride_btb, stride_pob,
                             stride_pos, CAUSAL: gl.constexpr, IS_SPLIT: gl.constexpr, STAGES: gl.constexpr,
                             DTYPE: gl.constexpr, KV_FP8: gl.constexpr, ORDERED: gl.constexpr,
                             STORE_16B: gl.constexpr = False, BT_EARLY: gl.constexpr = False):
    """Grid (b * cdiv(ROWS, 64), num_splits); 8 warps + the producer warp. q_desc: q as [b * ROWS, 576] (row =
    token j * H + head), kv_desc: the cache as [pages * 64, 576], boxes [64, 64] (sc_desc, kpe_desc: the same);
    FP8: the cache as [pages * 64, 656] bytes seen as e4m3 ([64, 128] boxes), fp32 scales ([64, 4]) and bf16
    k_pe ([64, 64]). out [b * ROWS, 512]; lse [b * ROWS]; with splits po [b, splits, ROWS, 512] /
    pl [b, splits, ROWS] fp32 instead. ORDERED: the request axis runs through order_ptr (work_order.grid_order:
    longest first)."""
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, 256, 16])
    SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)

    b, tile, split = program_item(order_ptr, ROWS, ORDERED)
    rows = tile * BLOCK_M + gl.arange(0, BLOCK_M, ROW_O)
    seqlen, start, n_tiles, vis_len, min_vis = split_and_visibility(seqlens_ptr, b, split, num_splits, rows, H, S_Q,
                                                                    CAUSAL)

    # shared buffers have power-of-two shapes: c_kv ([.., 512]) and k_pe ([.., 64]) apart
    q_smem = gl.allocate_shared_memory(DTYPE, [BLOCK_M, D_V], SMEM)
    qpe_smem = gl.allocate_shared_memory(DTYPE, [BLOCK_M, BOX], SMEM)
    if KV_FP8:
        # a ring of raw pages (e4m3 c_kv, scales, bf16 k_pe) and one bf16 c_kv tile they are dequantized into
        kv_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, PAGE, D_V], gl.NVMMASharedLayout(
            swizzle_byte_width=128, element_bitwidth=8, rank=2))
        sc_smem = gl.allocate_shared_memory(gl.float32, [STAGES, PAGE, 4], gl.NVMMASharedLayout(
            swizzle_byte_width=0, element_bitwidth=32, rank=2))
        kbuf = gl.allocate_shared_memory(DTYPE, [PAGE, D_V], SMEM)
    else:
        kv_smem = gl.allocate_shared_memory(DTYPE, [STAGES, PAGE, D_V], SMEM)   # a rank-2 layout per stage
        sc_smem = kv_smem         # unused
        kbuf = kv_smem            # unused: the stage is the tile
    kpe_smem = gl.allocate_shared_memory(DTYPE, [STAGES, PAGE, BOX], SMEM)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()

    bt_row = bt_ptr + b.to(gl.int64) * stride_btb
    q_row0 = b * ROWS + tile * BLOCK_M
    p_smem = gl.allocate_shared_memory(DTYPE, [BLOCK_M, PAGE], SMEM)
    acc, m_i, l_i = gl.warp_specialize(
        [(_compute_partition, (q_smem, qpe_smem, kv_smem, sc_smem, kpe_smem, kbuf, p_smem, q_bar, ready, empty,
                               n_tiles, start, seqlen, vis_len, min_vis, qk_scale, STAGES, DTYPE, S_LAYOUT, O_LAYOUT,
                               KV_FP8)),
         (_load_partition, (q_desc, kv_desc, sc_desc, kpe_desc, bt_row, q_smem, qpe_smem, kv_smem, sc_smem, kpe_smem,
                            q_bar, ready, empty, q_row0, start // PAGE, n_tiles, STAGES, KV_FP8, BT_EARLY))],
        [1], [24])

    inv_l, lse = finish_rows(m_i, l_i, ROW_O)
    o = acc * inv_l[:, None]
    row_ok = rows < ROWS
    if IS_SPLIT:
        po_rows = po_ptr + b.to(gl.int64) * stride_pob + split * stride_pos
        _store_o(o, po_rows, tile * BLOCK_M, ROWS, O_LAYOUT, STORE_16B, 4)
        gl.store(pl_ptr + b * (num_splits * ROWS) + split * ROWS + rows, lse, mask=row_ok)
    else:
        _store_o(o.to(DTYPE), out_ptr + b.to(gl.int64) * ROWS * D_V, tile * BLOCK_M, ROWS, O_LAYOUT, STORE_16B, 8)
        gl.store(lse_ptr + b * ROWS + rows, lse, mask=row_ok)


@gluon.jit
def _store_o(o, base, row0, ROWS, O_LAYOUT: gl.constexpr, STORE_16B: gl.constexpr, VEC: gl.constexpr):
    """o [64, 512] (rows row0.. of a request's ROWS; out's dtype or fp32) into base + row * 512 + col, rows past
    ROWS left out. STORE_16B: first into a layout of VEC contiguous values (16 bytes) a thread, 8 threads along a
    row (the conversion goes through shared memory), so that every store is 16 bytes and a warp's cover whole
    lines; otherwise from the accumulator's layout (2 adjacent values a thread and row)."""
    if STORE_16B:
        L: gl.constexpr = gl.BlockedLayout([1, VEC], [4, 8], [8, 1], [1, 0])
        o = gl.convert_layout(o, L)
    else:
        L: gl.constexpr = O_LAYOUT
    rows = row0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, L))
    cols = gl.arange(0, D_V, gl.SliceLayout(0, L))
    mask = (rows < ROWS)[:, None] & (cols < D_V)[None, :]
    gl.store(base + rows[:, None] * D_V + cols[None, :], o, mask=mask)


# bf16 only: the fp16 specializations compile but have not run on a GPU (the tl kernel takes fp16)
_GL_DTYPES = {torch.bfloat16: gl.bfloat16}
# O (or the fp32 split partials) converted from the wgmma accumulator's layout, where a thread holds 2 adjacent
# columns of a row, to one of 16 contiguous bytes a thread, before the stores (False: stored from the
# accumulator's layout; for A/B runs). The CuTe kernels' epilogue took 11.5 k cycles an item that way, 4.0 k with
# 16-byte stores (bench/NOTES.md 54).
STORE_16B = True
# This kernel's and the narrow kernels' producers read a page's block-table entry before waiting for its ring stage
# to be free, not after (False: for A/B runs). On the H200 (bench/NOTES.md 76): bf16 b128 h16/h32/h64 8k 1.007/
# 1.009/1.005x, FP8 h32/h64 level; the FP8-MMA kernel's producer keeps the read after the wait (0.979-0.996x)
BT_EARLY = True


def supports(q: torch.Tensor, kv_cache: torch.Tensor, head_dim_v: int) -> bool:
    """Whether this kernel takes the call: a Hopper GPU, bf16 q with d_qk 576 / d_v 512, and a contiguous
    page-64 cache in q's dtype or in the FP8 format."""
    d_qk = q.shape[-1]
    fp8 = kv_cache.dtype == torch.uint8 and kv_cache.dim() == 3 and kv_cache.shape[2] == ROW_BYTES.value
    return (q.device.type == "cuda" and torch.cuda.get_device_capability(q.device)[0] == 9
            and (kv_cache.dtype == q.dtype or fp8) and q.dtype in _GL_DTYPES and kv_cache.dim() == 3
            and kv_cache.is_contiguous() and kv_cache.shape[1] == PAGE.value and d_qk == D_QK.value
            and head_dim_v == D_V.value)


def mla_decode_gluon(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal, plan, out, lse,
                     stages: int = 2, order: torch.Tensor | None = None) -> None:
    """ops.mla_decode's semantics for the calls `supports` takes, into out [b, s_q, h, 512] and lse [b, s_q, h]
    (contiguous, b > 0); `plan` from mla_decode_plan.plan_mla_decode with a 64-row, 64-token config. `order`:
    int32 [b], the order in which the grid takes the requests (work_order.grid_order), or None for batch order."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from mlaserve.kernels import fp8_format
    from mlaserve.kernels.triton.mla_decode import combine_splits
    assert fp8_format.PACKED_BYTES == ROW_BYTES.value
    b, s_q, h, _ = q.shape
    rows = s_q * h
    smem = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    # descriptor shapes are plain ints on the host (the module's gl.constexpr globals are for the kernels)
    block_m, box, page, d_qk = BLOCK_M.value, BOX.value, PAGE.value, D_QK.value
    q_desc = TensorDescriptor.from_tensor(q.contiguous().view(b * rows, d_qk), [block_m, box], smem)
    kv_fp8 = kv_cache.dtype == torch.uint8
    if kv_fp8:
        # three views of the same cache rows: e4m3 c_kv, fp32 scales, bf16 k_pe
        flat = kv_cache.view(-1, ROW_BYTES.value)
        kv_desc = TensorDescriptor.from_tensor(flat.view(torch.float8_e4m3fn), [page, GROUP.value],
                                               gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2))
        sc_desc = TensorDescriptor.from_tensor(flat.view(torch.float32), [page, 4],
                                               gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
        kpe_desc = TensorDescriptor.from_tensor(flat.view(torch.bfloat16), [page, box], smem)
    else:
        kv_desc = sc_desc = kpe_desc = TensorDescriptor.from_tensor(kv_cache.view(-1, d_qk), [page, box], smem)
    split = plan.num_splits > 1
    po, pl = (plan.partial_out, plan.partial_lse) if split else (out, lse)
    _mla_decode_gluon_kernel[(b * triton.cdiv(rows, block_m), plan.num_splits)](
        q_desc, kv_desc, sc_desc, kpe_desc, block_table, cache_seqlens, out, lse, po, pl,
        cache_seqlens if order is None else order, softmax_scale * LOG2E.value,
        plan.num_splits, h, s_q, rows, block_table.stride(0), po.stride(0), po.stride(1),
        CAUSAL=causal, IS_SPLIT=split, STAGES=stages, DTYPE=_GL_DTYPES[q.dtype], KV_FP8=kv_fp8,
        ORDERED=order is not None, STORE_16B=STORE_16B, BT_EARLY=BT_EARLY, num_warps=8)
    if split:
        combine_splits(plan, out, lse)
