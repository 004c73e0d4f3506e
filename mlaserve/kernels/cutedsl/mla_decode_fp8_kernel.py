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

The half ring (MLADecodeFP8Sm90(half_ring=True), what mla_decode launches while FP8_HALF_RING is on, the default:
1.03-1.06x the whole tile above on an H100, bench/NOTES.md 118): the tile's space
plus 32 KB as three slots of a column half [64, 256] (98304 B), page t's half h in slot (2 t + h) % 3, with one raw
stage (33792 B: the loader takes the page's bytes into 80 registers, frees the stage and issues page t + 1's TMA
before converting: fp8_pages.fp8_loader's one-stage form) and k_pe in two buffers of its own (16384 B) that
consumer 0's first warp fills by TMA two pages ahead, once both consumers' S of the page before is done (BAR_MAX).
Q 73728 + 98304 + 33792 + 16384 + P 8192 + barriers and row maxima = 231424 B. Slot (t, h) is read by both
consumers' S(t) and by consumer h's P V(t), which comes after both S(t) (it needs the other's P), so consumer h
frees it (kv_empty + slot, 128 arrivals). Page t + 1's first half goes into the slot page t - 1's second half
left, so it is converted while page t is still read; only its second half waits for consumer 0's P V(t), and
consumers issue S(t + 1) over the first half meanwhile. Registers: loader 104, consumers 200 (ptxas: no spills).

The softmax on one barrier a page (MLADecodeFP8Sm90(one_barrier=True), mla_decode.FP8_ONE_BARRIER, the default:
1.06-1.07x the two barriers on an H100 at b128 h64 / h128 4k, bench/NOTES.md 125): split_consumers.one_barrier_p,
the pair meeting once a page, on BAR_P, where no row's max rose by more than 2^8; BAR_MAX and then BAR_P only
where one did. BAR_P also says both consumers' S of the page is done, for the half ring's k_pe refill.

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
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from mlaserve.kernels.cutedsl.common import register_split_fits
from mlaserve.kernels.cutedsl.fp8_dequant import KV_BLOCKS
from mlaserve.kernels.cutedsl.fp8_pages import (
    D_PE, D_V, HALF_SLOTS, LOADER_THREADS, RAW_STAGES, TILE_N, _qk_gemm, fp8_host_setup, fp8_kernel_setup,
    fp8_loader, load_pe, pv_and_release)
from mlaserve.kernels.cutedsl.request_rows import (
    first_masked_key, grid_request, ordered_tensors, page_split, visible_keys)
from mlaserve.kernels.cutedsl.split_consumers import (
    CONSUMER_THREADS, finish_rows, one_barrier_p, publish_p, rescale_to_tile_max, scale_rows, split_tiled_mmas,
    store_dense_block, store_dense_lse)

TILE_M = 64           # query rows per CTA: one wgmma M
HALF_N = TILE_N // 2
HALF_V = D_V // 2
LOADER_REGS = 56
CONSUMER_REGS = 224   # 128 * 56 + 256 * 224 = 64512 = 384 * 168
THREADS = 3 * 128
# the half ring (MLADecodeFP8Sm90(half_ring=True)): the loader holds a page's raw bytes in registers (80 of them)
HALF_RING_LOADER_REGS = 104
HALF_RING_CONSUMER_REGS = 200  # 128 * 104 + 256 * 200 = 64512
PE_STAGES = 2         # the half ring's k_pe buffers, filled by the consumers' TMA two pages ahead
# the loader hands the bf16 tile over every RELEASE_EVERY of its 8 column blocks (fp8_dequant.dequant_tile)
RELEASE_EVERY = 4
assert register_split_fits((128, LOADER_REGS), (2 * 128, CONSUMER_REGS))
assert register_split_fits((128, HALF_RING_LOADER_REGS), (2 * 128, HALF_RING_CONSUMER_REGS))


class MLADecodeFP8Sm90:
    """Compiled per (causal, split, ordered); q, out bf16. Launched by mla_decode.py through `__call__`."""

    def __init__(self, causal: bool, is_split: bool, ordered: bool = False, store16: bool = False,
                 half_ring: bool = False, one_barrier: bool = False):
        self.dtype = cutlass.BFloat16
        # the bf16 c_kv tile as HALF_SLOTS slots of a column half (module docstring, "The half ring")
        self.half_ring = half_ring
        # the consumers' softmax on one barrier a page where no row's max rises (split_consumers.one_barrier_p)
        self.one_barrier = one_barrier
        self.causal = causal
        self.is_split = is_split
        self.store16 = store16    # whole 64-row blocks (O or split partials) stored 16 bytes at a time
        # the grid's request axis runs through an int32 order (work_order.grid_order: longest first), passed in
        # partial out's place (unsplit) or lse's (split; request_rows.ordered_tensors)
        self.ordered = ordered

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, kv_ptr: cute.Pointer, rope_ptr: cute.Pointer, bt_ptr: cute.Pointer,
                 seqlens_ptr: cute.Pointer, out_ptr: cute.Pointer, lse_ptr: cute.Pointer, po_ptr: cute.Pointer,
                 pl_ptr: cute.Pointer, batch: Int32, s_q: Int32, h: Int32, num_pages: Int32, max_pages: Int32,
                 num_splits: Int32, scale_log2: Float32, stream):
        """q bf16 [b, s_q * h, 576]; kv: the cache uint8 [num_pages * 64, 656] as int32 words; rope: the same
        cache as bf16 from byte 528 (k_pe, row stride 328 elements); bt int32 [b, max_pages]; seqlens int32
        [b]; out bf16 [b, s_q * h, 512], lse fp32 [b, s_q * h]; partials (split only) fp32
        [b, num_splits, s_q * h, 512] and [b, num_splits, s_q * h]. Ordered launches pass the requests' int32
        order [b] in partial out's place (unsplit) or lse's (split)."""
        rows = s_q * h
        (mBT, mSeqlens, mOut, mLse, mPO, mPL), (atom, sQ_layout, sKV_layout, sPE_layout, sRaw_layout), \
            (tma_q, mQ_tma, tma_raw, mRaw_tma, tma_pe, mPE_tma) = fp8_host_setup(
                TILE_M, q_ptr, kv_ptr, rope_ptr, bt_ptr, seqlens_ptr, out_ptr, lse_ptr, po_ptr, pl_ptr, batch, s_q,
                h, num_pages, max_pages, num_splits, 1 if self.half_ring else RAW_STAGES)
        if const_expr(self.half_ring):
            sKV_layout = cute.tile_to_shape(atom, (TILE_N, HALF_V, HALF_SLOTS), order=(0, 1, 2))
            sPE_layout = cute.tile_to_shape(atom, (TILE_N, D_PE, PE_STAGES), order=(0, 1, 2))
        if const_expr(self.ordered):
            mLse, mPO = ordered_tensors(mLse, mPO, lse_ptr, po_ptr, batch, self.is_split)
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
        batch = grid_request(batch, mLse, mPO, self.ordered, self.is_split)
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
        pe_full = kv_full
        if const_expr(self.half_ring):
            # a barrier pair per slot (the loader's 128 threads fill it; the consumer that reads it in P V frees
            # it), one per k_pe buffer (its TMA)
            kv_empty = kv_full + HALF_SLOTS
            pe_full = kv_empty + HALF_SLOTS
            if tidx == 0:
                for slot in cutlass.range_constexpr(HALF_SLOTS):
                    cute.arch.mbarrier_init(kv_full + slot, LOADER_THREADS)
                    cute.arch.mbarrier_init(kv_empty + slot, CONSUMER_THREADS // 2)
                for stage in cutlass.range_constexpr(PE_STAGES):
                    cute.arch.mbarrier_init(pe_full + stage, 1)
        raw_pipe, q_pipe, sQ, sKV, sPE, sRaw = fp8_kernel_setup(
            tidx, storage, CONSUMER_THREADS, TILE_M, sQ_layout, sKV_layout, sPE_layout, sRaw_layout,
            raw_pe=not self.half_ring, raw_stages=1 if self.half_ring else RAW_STAGES,
            tile_barriers=not self.half_ring)
        sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
        sStat = storage.row_stat.get_tensor(cute.make_layout((TILE_M, 2)))

        seqlen = mSeqlens[batch]
        start, n_tiles = page_split(seqlen, split, num_splits)
        first_page = start // TILE_N

        if wg == 0:
            # ---------------- loader: TMA (warp 0) and dequantization (all four warps) ----------------
            cute.arch.setmaxregister_decrease(HALF_RING_LOADER_REGS if self.half_ring else LOADER_REGS)
            fp8_loader(tidx, warp_idx, tma_q, mQ_tma, sQ, q_pipe, m_block, TILE_M, tma_raw, mRaw_tma, sRaw,
                       tma_pe, mPE_tma, sPE, raw_pipe, storage.sRaw.data_ptr().toint(),
                       storage.sKV.data_ptr().toint(), kv_full, kv_empty, mBT, batch, first_page, n_tiles, seqlen,
                       start, raw_pe=not self.half_ring, release_every=RELEASE_EVERY,
                       raw_stages=1 if self.half_ring else RAW_STAGES, half_ring=self.half_ring)
        else:
            # ---------------- consumers (the bf16 kernel's math; K/V from the bf16 tile and the raw stage) --------
            cute.arch.setmaxregister_increase(HALF_RING_CONSUMER_REGS if self.half_ring else CONSUMER_REGS)
            cw = wg - 1                  # which half: keys 32cw.. of S, columns 256cw.. of O
            ctid = tidx % 128
            (tSrQ, tSrQpe, tSrK, tSrKpe, tOrP, tOrV, tPsP, acc_s, acc_o, tScS, tOcO, rP) = _consumer_operands(
                tiled_mma_qk, tiled_mma_pv, ctid, cw, sQ, sKV, sPE, sP, self.half_ring)
            if const_expr(self.half_ring):
                # consumer 0's first warp loads the k_pe buffers by TMA, two pages ahead
                warp = cute.arch.make_warp_uniform(ctid // 32)
                lane = ctid % 32
                gPE = cute.local_tile(mPE_tma, (TILE_N, D_PE), (None, 0))           # [64, 64, pages]
                tPs, tPg = cpasync.tma_partition(tma_pe, 0, cute.make_layout(1), cute.group_modes(sPE, 0, 2),
                                                 cute.group_modes(gPE, 0, 2))
                if cw == 0 and warp == 0:
                    for stage in cutlass.range_constexpr(PE_STAGES):
                        if stage < n_tiles:
                            load_pe(tma_pe, tPg, tPs, pe_full + stage, mBT[batch, first_page + stage], lane, stage)

            # a wgmma m64 accumulator gives each thread rows r0 and r0 + 8 (value index bit 1 picks the row)
            r0 = (ctid // 32) * 16 + (ctid % 32) // 4
            vis = cute.make_rmem_tensor(2, Int32)      # keys visible to each of the thread's rows
            row_m = cute.make_rmem_tensor(2, Float32)  # running max (log2 units)
            row_l = cute.make_rmem_tensor(2, Float32)  # this thread's part of the running sum
            alpha = cute.make_rmem_tensor(2, Float32)
            m_base = cute.make_rmem_tensor(2, Float32)
            # a row with no key yet exponentiates against 0 (move_row_max's rule): one_barrier_p's fast path can
            # come first, on a tile where every row's keys are masked (a sparse top-k's -1s), before any move
            m_base.fill(0.0)
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
                if const_expr(self.half_ring):
                    # the k_pe refill's block-table entry, read before S hides its latency
                    later_page = Int32(0)
                    if cw == 0 and warp == 0 and t + PE_STAGES < n_tiles:
                        later_page = mBT[batch, first_page + t + PE_STAGES]
                    _qk_half_ring(tiled_mma_qk, acc_s, tSrQ, tSrK, tSrQpe, tSrKpe, t % PE_STAGES, kv_full, t,
                                  pe_full, (t // PE_STAGES) % 2)
                else:
                    stage = raw_c.index
                    raw_pipe.consumer_wait(raw_c)
                    # -- S_w = Q_pe Kpe_w^T + Q_nope K_w^T, each 64-column block of K as soon as it is converted --
                    _qk_gemm(tiled_mma_qk, acc_s, tSrQ, tSrK, tSrQpe, tSrKpe[None, None, None, stage], kv_full,
                             t % 2, RELEASE_EVERY)
                    cute.arch.sync_warp()
                    raw_pipe.consumer_release(raw_c)
                    raw_c.advance()
                for i in cutlass.range_constexpr(cute.size(acc_s)):
                    acc_s[i] = acc_s[i] * scale_log2
                if tok0 + TILE_N > min_vis:
                    for i in cutlass.range_constexpr(cute.size(acc_s)):
                        if tok0 + cw * HALF_N + tScS[i][1] >= vis[(i // 2) % 2]:
                            acc_s[i] = -Float32.inf
                if const_expr(self.one_barrier):
                    moved = one_barrier_p(acc_s, row_m, row_l, alpha, m_base, rP, tPsP, sStat, r0, cw, ctid, t > 0)
                    if const_expr(self.half_ring):
                        # both consumers' S of page t is done (BAR_P): its k_pe buffer takes page t + PE_STAGES's
                        if cw == 0 and warp == 0 and t + PE_STAGES < n_tiles:
                            load_pe(tma_pe, tPg, tPs, pe_full + t % PE_STAGES, later_page, lane, t % PE_STAGES)
                    if moved != 0:
                        scale_rows(acc_o, alpha)
                else:
                    rescale_to_tile_max(acc_s, row_m, row_l, alpha, m_base, sStat, r0, cw, ctid)
                    if const_expr(self.half_ring):
                        # both consumers' S of page t is done (BAR_MAX): its k_pe buffer takes page t + PE_STAGES's
                        if cw == 0 and warp == 0 and t + PE_STAGES < n_tiles:
                            load_pe(tma_pe, tPg, tPs, pe_full + t % PE_STAGES, later_page, lane, t % PE_STAGES)
                    publish_p(acc_s, m_base, row_l, rP, tPsP)
                    # -- O_w = alpha O_w + P V_w --
                    scale_rows(acc_o, alpha)
                pv_and_release(tiled_mma_pv, acc_o, tOrP, tOrV, kv_empty, t, cw, n_tiles, self.half_ring,
                               self.one_barrier)

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
                       sKV: cute.Tensor, sPE: cute.Tensor, sP: cute.Tensor, half_ring: bool = False):
    """Consumer cw's wgmma operands over the FP8 kernels' smem (Q [64, 576]; the bf16 c_kv tile [64, 512];
    the raw ring's k_pe [64, 64, stages]; P [64, 64]) and its accumulators (O zeroed), traced inline:
    (tSrQ, tSrQpe, tSrK, tSrKpe, tOrP, tOrV, tPsP, acc_s, acc_o, tScS, tOcO, rP). With `half_ring` the tile is
    HALF_SLOTS slots [64, 256] and k_pe PE_STAGES buffers: K's and V's fragments take a last mode, the slot (K
    16 k-steps of one column half, V^T this consumer's half)."""
    thr_qk = tiled_mma_qk.get_slice(ctid)
    thr_pv = tiled_mma_pv.get_slice(ctid)
    sQ_nope = cute.local_tile(sQ, (TILE_M, D_V), (0, 0))
    sQ_pe = cute.local_tile(sQ, (TILE_M, D_PE), (0, D_V // D_PE))
    if half_ring:
        sK_w = cute.local_tile(sKV, (HALF_N, HALF_V, HALF_SLOTS), (cw, 0, 0))
        sKpe_w = cute.local_tile(sPE, (HALF_N, D_PE, PE_STAGES), (cw, 0, 0))
        # V^T [256, 64 keys] of a slot as MN-major B: (column, key, slot) -> the slot's (key, column)
        sVt_w = cute.composition(sKV, cute.make_layout((HALF_V, TILE_N, HALF_SLOTS),
                                                       stride=(TILE_N, 1, TILE_N * HALF_V)))
    else:
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


@cute.jit
def _qk_half_ring(tiled_mma: cute.TiledMma, acc: cute.Tensor, tSrQ: cute.Tensor, tSrK: cute.Tensor,
                  tSrQpe: cute.Tensor, tSrKpe: cute.Tensor, pe: Int32, kv_full: cute.Pointer, t: Int32,
                  pe_full: cute.Pointer = None, pe_phase: Int32 = None):
    """The half ring's S_w of tile t as one wgmma group, waited for: k_pe's k-steps from its buffer `pe` (with
    `pe_full`, once barrier pe_full + pe completes phase `pe_phase`), then each column half's from its slot
    (2 t + half) % HALF_SLOTS once the loader has handed it over (also sparse_mla_fp8_kernel.py's)."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, False)
    if const_expr(pe_full is not None):
        cute.arch.mbarrier_wait(pe_full + pe, pe_phase)
    for k in cutlass.range_constexpr(cute.size(tSrQpe.shape[2])):
        cute.gemm(atom, acc, tSrQpe[None, None, k], tSrKpe[None, None, k, pe], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    steps = cute.size(tSrK.shape[2])
    for half in cutlass.range_constexpr(2):
        use = 2 * t + half
        slot = use % HALF_SLOTS
        cute.arch.mbarrier_wait(kv_full + slot, (use // HALF_SLOTS) % 2)
        for k in cutlass.range_constexpr(steps):
            cute.gemm(atom, acc, tSrQ[None, None, half * steps + k], tSrK[None, None, k, slot], acc)
    warpgroup.commit_group()
    warpgroup.wait_group(0)


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
