"""The Hopper (sm_90a) MLA decode kernel over the FP8 656-byte KV format, in CuTe DSL.

One CTA = 64 query rows (row = token j * h + head) x one KV split of one request, as the bf16 kernel
(mla_decode_kernel.py). The consumers' math (S halves by keys, O halves by columns, maxima exchanged
through smem) is duplicated from that kernel for this slice, so that its ongoing optimisation and this
kernel do not move each other; the differences are where K and V come from.

Each cached token is 656 bytes (mlaserve/kernels/fp8_format.py): 512 e4m3 c_kv bytes, 4 fp32 scales (one
per 128 columns), 64 bf16 k_pe values. Per 64-token page:

    raw ring stage (TMA)   e4m3 + scales  [64, 528 B] (the row's first 132 words)   33792 B
                           k_pe           [64, 64] bf16, 128-byte swizzle          8192 B
    bf16 tile (loader)     c_kv           [64, 512] bf16, 128-byte swizzle         65536 B

Warp roles (384 threads):
- WG 0, the loader (setmaxnreg 56): warp 0 issues the TMA (Q once; then per page the raw bytes and k_pe
  into a 2-stage ring; both land on one transaction barrier). All four warps dequantize each page's e4m3
  part into the one bf16 c_kv tile: an e4m3 byte x read as the bf16 with bits ((x & 0x7F) << 4) |
  ((x & 0x80) << 8) is exactly x * 2^-120 (subnormals too), so one fma.rn.bf16x2 by (scale * 2^120)
  (exact in bf16 when the scale is a bf16 value <= 2^7, which the quantizer guarantees) gives the bf16
  nearest e4m3 * scale -- the format's value -- with no conversion instruction. 4 bytes become two bf16x2
  words by prmt with sign replication, a shift and a mask. Rows past the request's end are written as
  zeros (multiplier 0: the bit trick never makes NaN/inf from any byte, even 0xFF poison). The tile is
  converted in 8 blocks of 64 columns and released to the consumers in halves (RELEASE_EVERY 4 blocks),
  each on its own mbarrier; the loads of block b + 1 are issued before block b is converted
  (fp8_dequant.dequant_tile).
- WG 1 and WG 2, the consumers (setmaxnreg 224): S_w = Q K_w^T over keys 32w..32w+32 (k_pe straight from
  the raw stage first, then c_kv from the bf16 tile half by half as the loader releases them),
  P_w to smem, O_w += P V_w over columns 256w..256w+256.

Smem (limit 232448 B): Q 73728 + bf16 tile 65536 + raw ring 2 x 41984 + P 8192 + 8 mbarriers 64 +
row maxima 512 (row sums reuse them after the loop) = 232000 B, which the struct rounds up to its 1024-byte
alignment: 232448, the limit exactly (the 8 extra block barriers fit in that rounding). A second bf16
tile does not fit beside Q, so a page's dequantization waits for the consumers' P V of the page before
it; only the QK overlaps it, half by half. Measured on the H200 (b128 s_k 8192): converting the whole
tile before releasing it gave 1.47 TB/s at h16 and 305 TFLOP/s at h128; the blocks with loads issued a
block ahead give 1.80 TB/s and 372 TFLOP/s (the loader has one warp per SM sub-partition, so its shared
loads' latency was exposed on every 8-byte unit). Each release is a proxy fence that waits for the
loader's stores: releasing halves instead of blocks measured 1.03-1.04x at h64/h128 (s_q 1 and 2; quarters
in between). Where rows are few (h16, s_q 1) the 64-row wgmma tiles
do 4x the needed MMA work (~1.2 us of wgmma a page at peak, near the bf16 kernel's memory time), so FP8's
1.6x there needs keys on wgmma's M side (S^T = K Q^T, N = rows), which this kernel does not do.

Barriers per page t (stage s = t % 2):
  raw full[s]  (TMA tx 41984 B)                    loader waits, consumers wait (k_pe)
  raw empty[s] 12 warp arrivals: 4 loader warps after dequantizing, 8 consumer warps after S
  kv_empty     256 consumer threads after P V of t-1 -> loader may overwrite the bf16 tile
  kv_full[g]   128 loader threads after converting column blocks 4g..4g+3 of t (fence.proxy.async
               first) -> the consumers' wgmma on those blocks (2 of the 8 barriers used, one phase a page)
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from mlaserve.kernels.cutedsl.fp8_dequant import KV_BLOCKS, dequant_tile
from mlaserve.kernels.cutedsl.mla_decode_kernel import first_masked_key, page_split, visible_keys
from mlaserve.kernels.cutedsl.split_consumers import (
    CONSUMER_THREADS, finish_rows, publish_p, rescale_to_tile_max, scale_rows, split_tiled_mmas, store_dense_block,
    store_dense_lse)

TILE_M = 64           # query rows per CTA: one wgmma M
TILE_N = 64           # cached tokens per tile: one page
D_QK = 576
D_V = 512
D_PE = D_QK - D_V
HALF_N = TILE_N // 2
HALF_V = D_V // 2
RAW_WORDS = 132       # the e4m3 bytes and the 4 scales of a row, in 32-bit words (528 B)
ROW_WORDS = 164       # 656 B
ROPE_ELEMS = 328      # a row in bf16 elements; k_pe starts at element 264 (byte 528)
RAW_STAGES = 2
LOADER_REGS = 56
CONSUMER_REGS = 224   # 128 * 56 + 256 * 224 = 65536
THREADS = 3 * 128
LOADER_THREADS = 128
# the loader hands the bf16 tile over every RELEASE_EVERY of its 8 column blocks (fp8_dequant.dequant_tile)
RELEASE_EVERY = 4


class MLADecodeFP8Sm90:
    """Compiled per (causal, split, ordered); q, out bf16. Launched by mla_decode.py through `__call__`."""

    def __init__(self, causal: bool, is_split: bool, ordered: bool = False, store16: bool = False):
        self.dtype = cutlass.BFloat16
        self.causal = causal
        self.is_split = is_split
        self.store16 = store16    # whole 64-row blocks (O or split partials) stored 16 bytes at a time
        # the grid's request axis runs through an int32 order (work_order.grid_order: longest first), passed in
        # partial out's place (unsplit steps only)
        self.ordered = ordered
        if ordered and is_split:
            raise ValueError("ordered launches are for unsplit decode steps")

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, kv_ptr: cute.Pointer, rope_ptr: cute.Pointer, bt_ptr: cute.Pointer,
                 seqlens_ptr: cute.Pointer, out_ptr: cute.Pointer, lse_ptr: cute.Pointer, po_ptr: cute.Pointer,
                 pl_ptr: cute.Pointer, batch: Int32, s_q: Int32, h: Int32, num_pages: Int32, max_pages: Int32,
                 num_splits: Int32, scale_log2: Float32, stream):
        """q bf16 [b, s_q * h, 576]; kv: the cache uint8 [num_pages * 64, 656] as int32 words; rope: the same
        cache as bf16 from byte 528 (k_pe, row stride 328 elements); bt int32 [b, max_pages]; seqlens int32
        [b]; out bf16 [b, s_q * h, 512], lse fp32 [b, s_q * h]; partials (split only) fp32
        [b, num_splits, s_q * h, 512] and [b, num_splits, s_q * h]. Ordered launches pass the requests' int32
        order [b] in partial out's place."""
        rows = s_q * h
        (mBT, mSeqlens, mOut, mLse, mPO, mPL), (atom, sQ_layout, sKV_layout, sPE_layout, sRaw_layout), \
            (tma_q, mQ_tma, tma_raw, mRaw_tma, tma_pe, mPE_tma) = fp8_host_setup(
                TILE_M, q_ptr, kv_ptr, rope_ptr, bt_ptr, seqlens_ptr, out_ptr, lse_ptr, po_ptr, pl_ptr, batch, s_q,
                h, num_pages, max_pages, num_splits)
        if const_expr(self.ordered):
            mPO = cute.make_tensor(po_ptr, cute.make_layout(batch))
        sP_layout = cute.tile_to_shape(atom, (TILE_M, TILE_N), order=(0, 1))

        tiled_mma_qk, tiled_mma_pv = split_tiled_mmas(self.dtype)

        self.shared_storage = fp8_split_storage(sQ_layout, sKV_layout, sPE_layout, sRaw_layout, sP_layout)
        grid = (cute.ceil_div(rows, TILE_M), num_splits, batch)
        self.kernel(tma_q, mQ_tma, tma_raw, mRaw_tma, tma_pe, mPE_tma, mBT, mSeqlens, mOut, mLse, mPO, mPL,
                    s_q, h, rows, num_splits, scale_log2, sQ_layout, sKV_layout, sPE_layout, sP_layout,
                    sRaw_layout, tiled_mma_qk, tiled_mma_pv).launch(
            grid=grid, block=[THREADS, 1, 1], smem=self.shared_storage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ_tma: cute.Tensor, tma_raw: cute.CopyAtom, mRaw_tma: cute.Tensor,
               tma_pe: cute.CopyAtom, mPE_tma: cute.Tensor, mBT: cute.Tensor, mSeqlens: cute.Tensor,
               mOut: cute.Tensor, mLse: cute.Tensor, mPO: cute.Tensor, mPL: cute.Tensor, s_q: Int32, h: Int32,
               rows: Int32, num_splits: Int32, scale_log2: Float32, sQ_layout: cute.ComposedLayout,
               sKV_layout: cute.ComposedLayout, sPE_layout: cute.ComposedLayout, sP_layout: cute.ComposedLayout,
               sRaw_layout: cute.Layout, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, split, batch = cute.arch.block_idx()
        if const_expr(self.ordered):
            batch = mPO[batch]
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = cute.arch.make_warp_uniform(tidx // 128)
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_raw)
            cpasync.prefetch_descriptor(tma_pe)

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        kv_full = storage.kv_mbar.data_ptr()       # KV_BLOCKS barriers, one per 64-column block of the tile
        kv_empty = kv_full + KV_BLOCKS
        raw_pipe, q_pipe, sQ, sKV, sPE, sRaw = fp8_kernel_setup(
            tidx, storage, CONSUMER_THREADS, TILE_M, sQ_layout, sKV_layout, sPE_layout, sRaw_layout)
        sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
        sStat = storage.row_stat.get_tensor(cute.make_layout((TILE_M, 2)))

        seqlen = mSeqlens[batch]
        start, n_tiles = page_split(seqlen, split, num_splits)
        first_page = start // TILE_N

        if wg == 0:
            # ---------------- loader: TMA (warp 0) and dequantization (all four warps) ----------------
            cute.arch.setmaxregister_decrease(LOADER_REGS)
            fp8_loader(tidx, warp_idx, tma_q, mQ_tma, sQ, q_pipe, m_block, TILE_M, tma_raw, mRaw_tma, sRaw,
                       tma_pe, mPE_tma, sPE, raw_pipe, storage.sRaw.data_ptr().toint(),
                       storage.sKV.data_ptr().toint(), kv_full, kv_empty, mBT, batch, first_page, n_tiles, seqlen, start,
                       release_every=RELEASE_EVERY)
        else:
            # ---------------- consumers (the bf16 kernel's math; K/V from the bf16 tile and the raw stage) --------
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            cw = wg - 1                  # which half: keys 32cw.. of S, columns 256cw.. of O
            ctid = tidx % 128
            (tSrQ, tSrQpe, tSrK, tSrKpe, tOrP, tOrV, tPsP, acc_s, acc_o, tScS, tOcO, rP) = _consumer_operands(
                tiled_mma_qk, tiled_mma_pv, ctid, cw, sQ, sKV, sPE, sP)

            # a wgmma m64 accumulator gives each thread rows r0 and r0 + 8 (value index bit 1 picks the row)
            r0 = (ctid // 32) * 16 + (ctid % 32) // 4
            vis = cute.make_rmem_tensor(2, Int32)      # keys visible to each of the thread's rows
            row_m = cute.make_rmem_tensor(2, Float32)  # running max (log2 units)
            row_l = cute.make_rmem_tensor(2, Float32)  # this thread's part of the running sum
            alpha = cute.make_rmem_tensor(2, Float32)
            m_base = cute.make_rmem_tensor(2, Float32)
            for hr in cutlass.range_constexpr(2):
                vis[hr] = visible_keys(seqlen, s_q, h, m_block * TILE_M + r0 + 8 * hr, self.causal)
                row_m[hr] = -Float32.inf
                row_l[hr] = 0.0
            min_vis = first_masked_key(seqlen, s_q, self.causal)

            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            q_pipe.consumer_wait(q_state)
            raw_c = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, RAW_STAGES)
            for t in cutlass.range(n_tiles, unroll=1):
                tok0 = start + t * TILE_N
                stage = raw_c.index
                raw_pipe.consumer_wait(raw_c)
                # -- S_w = Q_pe Kpe_w^T + Q_nope K_w^T, each 64-column block of K as soon as it is converted --
                _qk_gemm(tiled_mma_qk, acc_s, tSrQ, tSrK, tSrQpe, tSrKpe[None, None, None, stage], kv_full, t % 2,
                         RELEASE_EVERY)
                cute.arch.sync_warp()
                raw_pipe.consumer_release(raw_c)
                raw_c.advance()
                for i in cutlass.range_constexpr(cute.size(acc_s)):
                    acc_s[i] = acc_s[i] * scale_log2
                if tok0 + TILE_N > min_vis:
                    for i in cutlass.range_constexpr(cute.size(acc_s)):
                        if tok0 + cw * HALF_N + tScS[i][1] >= vis[(i // 2) % 2]:
                            acc_s[i] = -Float32.inf
                rescale_to_tile_max(acc_s, row_m, row_l, alpha, m_base, sStat, r0, cw, ctid)
                publish_p(acc_s, m_base, row_l, rP, tPsP)
                # -- O_w = alpha O_w + P V_w --
                scale_rows(acc_o, alpha)
                _pv_gemm(tiled_mma_pv, acc_o, tOrP, tOrV)
                cute.arch.mbarrier_arrive(kv_empty)

            # -- epilogue: row sums through the maxima's smem, normalize, store --
            inv_l = cute.make_rmem_tensor(2, Float32)
            lse = cute.make_rmem_tensor(2, Float32)
            finish_rows(row_m, row_l, sStat, r0, cw, ctid, inv_l, lse)
            if const_expr(self.store16):
                if m_block * TILE_M + TILE_M <= rows:
                    store_dense_block(acc_o, inv_l, mOut, mPO, batch, split, m_block, rows, r0, cw, ctid,
                                      self.is_split, "bf16")
                else:
                    self._store_values(acc_o, inv_l, tOcO, mOut, mPO, cw, batch, split, m_block, rows)
            else:
                self._store_values(acc_o, inv_l, tOcO, mOut, mPO, cw, batch, split, m_block, rows)
            store_dense_lse(lse, mLse, mPL, batch, split, m_block, rows, r0, cw, ctid, self.is_split)

    @cute.jit
    def _store_values(self, acc_o: cute.Tensor, inv_l: cute.Tensor, tOcO: cute.Tensor, mOut: cute.Tensor,
                      mPO: cute.Tensor, cw: Int32, batch: Int32, split: Int32, m_block: Int32, rows: Int32):
        """This consumer's normalized O half value by value (rows past the request's s_q * h left out), into out
        or the fp32 split partials."""
        for i in cutlass.range_constexpr(cute.size(acc_o)):
            r = m_block * TILE_M + tOcO[i][0]
            if r < rows:
                val = acc_o[i] * inv_l[(i // 2) % 2]
                col = cw * HALF_V + tOcO[i][1]
                if const_expr(self.is_split):
                    mPO[batch, split, r, col] = val
                else:
                    mOut[batch, r, col] = val.to(self.dtype)


def _consumer_operands(tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, ctid, cw, sQ: cute.Tensor,
                       sKV: cute.Tensor, sPE: cute.Tensor, sP: cute.Tensor):
    """Consumer cw's wgmma operands over the FP8 kernels' smem (Q [64, 576]; the bf16 c_kv tile [64, 512];
    the raw ring's k_pe [64, 64, stages]; P [64, 64]) and its accumulators (O zeroed), traced inline:
    (tSrQ, tSrQpe, tSrK, tSrKpe, tOrP, tOrV, tPsP, acc_s, acc_o, tScS, tOcO, rP)."""
    thr_qk = tiled_mma_qk.get_slice(ctid)
    thr_pv = tiled_mma_pv.get_slice(ctid)
    sQ_nope = cute.local_tile(sQ, (TILE_M, D_V), (0, 0))
    sQ_pe = cute.local_tile(sQ, (TILE_M, D_PE), (0, D_V // D_PE))
    sK_w = cute.local_tile(sKV, (HALF_N, D_V), (cw, 0))
    sKpe_w = cute.local_tile(sPE, (HALF_N, D_PE, RAW_STAGES), (cw, 0, 0))
    # V^T [512, 64 keys] as MN-major B: (column, key) -> the tile's (key, column)
    sVt = cute.composition(sKV, cute.make_layout((D_V, TILE_N), stride=(TILE_N, 1)))
    sVt_w = cute.local_tile(sVt, (HALF_V, TILE_N), (cw, 0))
    sP_w = cute.local_tile(sP, (TILE_M, HALF_N), (0, cw))
    acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((TILE_M, HALF_N)), Float32)
    acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((TILE_M, HALF_V)), Float32)
    acc_o.fill(0.0)
    return (tiled_mma_qk.make_fragment_A(thr_qk.partition_A(sQ_nope)),
            tiled_mma_qk.make_fragment_A(thr_qk.partition_A(sQ_pe)),
            tiled_mma_qk.make_fragment_B(thr_qk.partition_B(sK_w)),
            tiled_mma_qk.make_fragment_B(thr_qk.partition_B(sKpe_w)),
            tiled_mma_pv.make_fragment_A(thr_pv.partition_A(sP)),
            tiled_mma_pv.make_fragment_B(thr_pv.partition_B(sVt_w)),
            thr_qk.partition_C(sP_w), acc_s, acc_o,
            thr_qk.partition_C(cute.make_identity_tensor((TILE_M, HALF_N))),
            thr_pv.partition_C(cute.make_identity_tensor((TILE_M, HALF_V))),
            cute.make_fragment_like(acc_s, sQ.element_type))


def fp8_host_setup(q_rows: int, q_ptr, kv_ptr, rope_ptr, bt_ptr, seqlens_ptr, out_ptr, lse_ptr, po_ptr, pl_ptr,
                   batch, s_q, h, num_pages, max_pages, num_splits):
    """The host-side pieces both FP8 dense kernels (this one, mla_decode_fp8_narrow_kernel.py) build alike,
    from `__call__`'s arguments (see MLADecodeFP8Sm90.__call__), for CTAs of `q_rows` query rows:
      tensors (block table, seqlens, out, lse, partial out, partial lse),
      smem layouts (the 128-byte-swizzle K-major atom; Q [q_rows, 576]; the bf16 c_kv tile [64, 512]; the
        raw ring's k_pe [64, 64, stages] and bytes [64, 132 words, stages], plain row-major),
      TMA atoms with their tensors (Q, the raw bytes, k_pe)."""
    dtype = cutlass.BFloat16
    rows = s_q * h
    n_rows = num_pages * TILE_N
    mQ = cute.make_tensor(q_ptr, cute.make_layout((rows, D_QK, batch), stride=(D_QK, 1, rows * D_QK)))
    mRaw = cute.make_tensor(kv_ptr, cute.make_layout((n_rows, RAW_WORDS), stride=(ROW_WORDS, 1)))
    mRope = cute.make_tensor(rope_ptr, cute.make_layout((n_rows, D_PE), stride=(ROPE_ELEMS, 1)))
    mBT = cute.make_tensor(bt_ptr, cute.make_layout((batch, max_pages), stride=(max_pages, 1)))
    mSeqlens = cute.make_tensor(seqlens_ptr, cute.make_layout(batch))
    mOut = cute.make_tensor(out_ptr, cute.make_layout((batch, rows, D_V), stride=(rows * D_V, D_V, 1)))
    mLse = cute.make_tensor(lse_ptr, cute.make_layout((batch, rows), stride=(rows, 1)))
    mPO = cute.make_tensor(po_ptr, cute.make_layout((batch, num_splits, rows, D_V),
                                                    stride=(num_splits * rows * D_V, rows * D_V, D_V, 1)))
    mPL = cute.make_tensor(pl_ptr, cute.make_layout((batch, num_splits, rows), stride=(num_splits * rows, rows, 1)))

    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, dtype, D_QK), dtype)
    sQ_layout = cute.tile_to_shape(atom, (q_rows, D_QK), order=(0, 1))
    sKV_layout = cute.tile_to_shape(atom, (TILE_N, D_V), order=(0, 1))
    sPE_layout = cute.tile_to_shape(atom, (TILE_N, D_PE, RAW_STAGES), order=(0, 1, 2))
    sRaw_layout = cute.make_layout((TILE_N, RAW_WORDS, RAW_STAGES), stride=(RAW_WORDS, 1, TILE_N * RAW_WORDS))

    tma_op = cpasync.CopyBulkTensorTileG2SOp()
    tma_q, mQ_tma = cpasync.make_tiled_tma_atom(tma_op, mQ, sQ_layout, (q_rows, D_QK))
    tma_raw, mRaw_tma = cpasync.make_tiled_tma_atom(
        tma_op, mRaw, cute.slice_(sRaw_layout, (None, None, 0)), (TILE_N, RAW_WORDS))
    tma_pe, mPE_tma = cpasync.make_tiled_tma_atom(
        tma_op, mRope, cute.slice_(sPE_layout, (None, None, 0)), (TILE_N, D_PE))
    return ((mBT, mSeqlens, mOut, mLse, mPO, mPL), (atom, sQ_layout, sKV_layout, sPE_layout, sRaw_layout),
            (tma_q, mQ_tma, tma_raw, mRaw_tma, tma_pe, mPE_tma))


def fp8_split_storage(sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
                      sPE_layout: cute.ComposedLayout, sRaw_layout: cute.Layout, sP_layout: cute.ComposedLayout):
    """The shared storage of the FP8 kernels with the split consumer pair (this one, the FP8 sparse MLA):
    the 1024-aligned buffers first (all multiples of 1 KB: no padding), the small arrays after them."""
    @cute.struct
    class SharedStorage:
        sQ: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(sQ_layout)], 1024]
        sKV: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(sKV_layout)], 1024]
        sPE: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(sPE_layout)], 1024]
        sRaw: cute.struct.Align[cute.struct.MemRange[Int32, cute.cosize(sRaw_layout)], 1024]
        sP: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(sP_layout)], 1024]
        raw_mbar: cute.struct.MemRange[cutlass.Int64, RAW_STAGES * 2]
        q_mbar: cute.struct.MemRange[cutlass.Int64, 2]
        kv_mbar: cute.struct.MemRange[cutlass.Int64, KV_BLOCKS + 1]
        row_stat: cute.struct.MemRange[Float32, TILE_M * 2]

    return SharedStorage


def fp8_kernel_setup(tidx: Int32, storage, consumer_threads: int, q_rows: int, sQ_layout: cute.ComposedLayout,
                     sKV_layout: cute.ComposedLayout, sPE_layout: cute.ComposedLayout, sRaw_layout: cute.Layout,
                     tiles: int = 1, raw_pe: bool = True):
    """In the FP8 dense kernels, before the warp roles split: thread 0 initializes the bf16 tiles' barriers in
    `storage.kv_mbar` (per tile KV_BLOCKS kv_full, each completed by the loader's 128 threads; then a kv_empty a
    tile, by the `consumer_threads`); the raw ring's pipeline (a stage is freed by the 4 loader warps,
    dequantized, and, where k_pe travels in the raw stage (`raw_pe`), by the consumer warps once S used it: one
    elected lane per warp) and Q's (creating them fences the inits and syncs the CTA); the smem tensors.
    -> (raw_pipe, q_pipe, sQ, sKV, sPE, sRaw)."""
    _init_tile_barriers(tidx, storage.kv_mbar.data_ptr(), consumer_threads, tiles)
    raw_pipe = pipeline.PipelineTmaAsync.create(
        barrier_storage=storage.raw_mbar.data_ptr(), num_stages=RAW_STAGES,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(
            pipeline.Agent.Thread, (LOADER_THREADS + (consumer_threads if raw_pe else 0)) // 32),
        tx_count=TILE_N * (RAW_WORDS * 4 + (D_PE * 2 if raw_pe else 0)))
    q_pipe = pipeline.PipelineTmaAsync.create(
        barrier_storage=storage.q_mbar.data_ptr(), num_stages=1,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_threads // 32),
        tx_count=q_rows * D_QK * 2)
    return (raw_pipe, q_pipe,
            storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner),
            storage.sKV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner),
            storage.sPE.get_tensor(sPE_layout.outer, swizzle=sPE_layout.inner),
            storage.sRaw.get_tensor(sRaw_layout))


@cute.jit
def _init_tile_barriers(tidx: Int32, kv_full: cute.Pointer, consumer_threads: cutlass.Constexpr[int],
                        tiles: cutlass.Constexpr[int]):
    if tidx == 0:
        for cb in cutlass.range_constexpr(tiles * KV_BLOCKS):
            cute.arch.mbarrier_init(kv_full + cb, LOADER_THREADS)
        for tile in cutlass.range_constexpr(tiles):
            cute.arch.mbarrier_init(kv_full + tiles * KV_BLOCKS + tile, consumer_threads)


@cute.jit
def fp8_loader(tidx: Int32, warp_idx: Int32, tma_q: cute.CopyAtom, mQ_tma: cute.Tensor, sQ: cute.Tensor, q_pipe,
               m_block: Int32, q_rows: cutlass.Constexpr[int], tma_raw: cute.CopyAtom, mRaw_tma: cute.Tensor,
               sRaw: cute.Tensor, tma_pe: cute.CopyAtom, mPE_tma: cute.Tensor, sPE: cute.Tensor, raw_pipe,
               raw_base: Int32, kv_base: Int32, kv_full: cute.Pointer, kv_empty: cute.Pointer, mBT: cute.Tensor,
               batch: Int32, first_page: Int32, n_tiles: Int32, seqlen: Int32, start: Int32,
               tiles: cutlass.Constexpr[int] = 1, raw_pe: cutlass.Constexpr[bool] = True,
               release_every: cutlass.Constexpr[int] = 1):
    """The loader warpgroup of the FP8 dense kernels (this one and mla_decode_fp8_narrow_kernel.py): warp 0
    loads the CTA's Q tile [q_rows, 576] (row block m_block) and the pages' raw bytes (and, `raw_pe`, their
    k_pe) by TMA into the raw ring; all four warps dequantize page t into bf16 c_kv tile t % `tiles` (the
    tiles side by side from shared address kv_base) once the consumers freed it (kv_empty + tile), releasing
    it every `release_every` blocks on kv_full + tile * KV_BLOCKS + block // release_every, then free the raw
    stage."""
    gRaw = cute.local_tile(mRaw_tma, (TILE_N, RAW_WORDS), (None, 0))     # [64, 132, pages]
    gPE = cute.local_tile(mPE_tma, (TILE_N, D_PE), (None, 0))           # [64, 64, pages]
    tRs, tRg = cpasync.tma_partition(tma_raw, 0, cute.make_layout(1), cute.group_modes(sRaw, 0, 2),
                                     cute.group_modes(gRaw, 0, 2))
    tPs, tPg = cpasync.tma_partition(tma_pe, 0, cute.make_layout(1), cute.group_modes(sPE, 0, 2),
                                     cute.group_modes(gPE, 0, 2))
    raw_p = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, RAW_STAGES)
    if warp_idx == 0:
        gQ = cute.local_tile(mQ_tma[None, None, batch], (q_rows, D_QK), (m_block, 0))
        tQs, tQg = cpasync.tma_partition(tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2),
                                         cute.group_modes(gQ, 0, 2))
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        q_pipe.producer_acquire(q_state)
        cute.copy(tma_q, tQg, tQs, tma_bar_ptr=q_pipe.producer_get_barrier(q_state))
    for t in cutlass.range(cutlass.min(n_tiles, RAW_STAGES), unroll=1):
        if warp_idx == 0:
            _load_page(raw_pipe, raw_p, tma_raw, tRg, tRs, tma_pe, tPg, tPs, mBT[batch, first_page + t], raw_pe)
        raw_p.advance()

    raw_c = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, RAW_STAGES)
    for t in cutlass.range(n_tiles, unroll=1):
        valid = seqlen - (start + t * TILE_N)      # rows of this page inside the request (may be > 64)
        tile = t % tiles
        raw_pipe.consumer_wait(raw_c)
        cute.arch.mbarrier_wait(kv_empty + tile, (t // tiles + 1) % 2)
        dequant_tile(tidx, raw_base + raw_c.index * (TILE_N * RAW_WORDS * 4), kv_base + tile * (TILE_N * D_V * 2),
                     kv_full + tile * KV_BLOCKS, valid, release_every)
        cute.arch.sync_warp()
        raw_pipe.consumer_release(raw_c)
        raw_c.advance()
        if warp_idx == 0:
            if t + RAW_STAGES < n_tiles:
                _load_page(raw_pipe, raw_p, tma_raw, tRg, tRs, tma_pe, tPg, tPs,
                           mBT[batch, first_page + t + RAW_STAGES], raw_pe)
        raw_p.advance()


@cute.jit
def _load_page(raw_pipe, state, tma_raw: cute.CopyAtom, tRg: cute.Tensor, tRs: cute.Tensor,
               tma_pe: cute.CopyAtom, tPg: cute.Tensor, tPs: cute.Tensor, page: Int32,
               raw_pe: cutlass.Constexpr[bool]):
    """One page's e4m3 bytes + scales into raw stage state.index, on that stage's full barrier, and its k_pe
    there too (`raw_pe`) or into L2 (for the consumers' own load of it later)."""
    raw_pipe.producer_acquire(state)
    bar = raw_pipe.producer_get_barrier(state)
    cute.copy(tma_raw, tRg[None, page], tRs[None, state.index], tma_bar_ptr=bar)
    if const_expr(raw_pe):
        cute.copy(tma_pe, tPg[None, page], tPs[None, state.index], tma_bar_ptr=bar)
    else:
        cute.prefetch(tma_pe, tPg[None, page])


@cute.jit
def _qk_gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tSrQ: cute.Tensor, tSrK: cute.Tensor,
             tSrQpe: cute.Tensor, tSrKpe: cute.Tensor, kv_full: cute.Pointer, phase: Int32,
             release_every: cutlass.Constexpr[int] = 1):
    """acc = Q_pe Kpe^T + Q_nope K^T as one wgmma group, waited for (the raw stage is released next).

    k_pe is in the raw stage already; K's k-steps on each 64-column block are issued once the loader's
    kv_full[block] completes its phase `phase`.
    """
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, False)
    for k in cutlass.range_constexpr(cute.size(tSrQpe.shape[2])):
        cute.gemm(atom, acc, tSrQpe[None, None, k], tSrKpe[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    steps = cute.size(tSrQ.shape[2])
    for k in cutlass.range_constexpr(steps):
        if const_expr(k % (steps // KV_BLOCKS * release_every) == 0):
            cute.arch.mbarrier_wait(kv_full + k // (steps // KV_BLOCKS * release_every), phase)
        cute.gemm(atom, acc, tSrQ[None, None, k], tSrK[None, None, k], acc)
    warpgroup.commit_group()
    warpgroup.wait_group(0)


@cute.jit
def _pv_gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tOrP: cute.Tensor, tOrV: cute.Tensor):
    """acc += P V over the tile's keys as one wgmma group, waited for (the bf16 tile is released next)."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, True)
    for k in cutlass.range_constexpr(cute.size(tOrP.shape[2])):
        cute.gemm(atom, acc, tOrP[None, None, k], tOrV[None, None, k], acc)
    warpgroup.commit_group()
    warpgroup.wait_group(0)
