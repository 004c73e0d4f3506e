"""The Hopper (sm_90a) MLA decode over the FP8 656-byte KV format for requests of at most 32 query rows
(h 16 / h 32 with s_q 1, h 16 with s_q 2), with the keys on wgmma's M side. At <= 16 rows with splits of >= 32
pages, mla_decode.py takes mla_decode_fp8_mma_kernel.py instead (FP8 wgmma on the e4m3 bytes, no bf16 tile).

A kernel with a request's query rows on M, where a wgmma takes 64, pads them: at h 16 three quarters
of its MMA work is padding, about 1.2 us a page at the tensor cores' peak, more than the ~1.3 us in which
HBM delivers the page's 42 KB of FP8 to an SM (1.3 us is what FP8 at 1.6x the bf16 kernel's speed needs).
Here the same page costs N / 64 of that, N = 16 or 32 the query rows padded:

    S^T [64 keys, N] = K [64, 576] Q^T          A = the page (c_kv from a bf16 tile, k_pe from the raw
                                                stage or its own buffer), K-major; B = Q [N, 576], K-major;
                                                m64nN, 36 k-steps
    O^T [512, N]    += V^T [512, 64 keys] P^T    A = the bf16 tile read as V^T (MN-major, no copy);
                                                B = P^T [N, 64 keys] in smem, K-major; 8 x m64nN, 4 k-steps

The softmax runs down the columns of S^T (a query row's keys are one column): each thread holds N / 4
columns in two rows, warps reduce over their 16 keys by shuffles and the four warps meet in smem.

Warp roles (256 threads): WG 0 is the FP8 kernels' loader (fp8_pages.fp8_loader: TMA of Q
and of each page's raw bytes into the raw ring, dequantization of page t into bf16 c_kv tile t % tiles,
handed over on kv_full); WG 1, the consumer, per page t:
  QK (each group of converted column blocks as it is handed over, k_pe last) -> mask, column maxima (warp
  shuffles, then the 4 warps through red[t % 2] and named barrier BAR_RED) -> P^T into smem, fence, BAR_P
  -> O^T rescaled and += V^T P^T -> arrive kv_empty[tile] (the loader may convert page t + tiles there).
P^T of page t is written after BAR_RED of page t, which every warp reaches only after waiting for its
P V of page t - 1: no warp's wgmma still reads the old P^T.

Layouts (`tiles`, raw_stages()):
- Two bf16 tiles (N 16; N 32 while mla_decode.FP8_N32_TWO_TILES is on), so that the loader converts page t + 1
  while the consumer works on page t, handed over whole (RELEASE_EVERY 8: one proxy fence a page). The
  raw ring then has no room for k_pe: one k_pe buffer, which the consumer's warp 0 fills by TMA for page
  t + 1 once every warp's S of page t is done (after BAR_RED), the loader having prefetched it into L2 with
  the page's raw bytes; QK takes k_pe's k-steps last. N 16: Q 18432 + tiles 131072 + raw 2 x 33792 + k_pe
  8192 + P^T 2048 = 227328 B of 232448. N 32: Q 36864 leaves room for one raw stage (214016 B), which the
  loader frees as soon as its threads hold the page's bytes in registers (fp8_dequant.load_raw_page), so
  that page t + 1 lands while page t is converted.
- One tile (N 32 with FP8_N32_TWO_TILES off, for A/B runs), handed over block by block so that QK overlaps the
  conversion; k_pe travels in the raw stage (2 x 41984), which the consumer releases too once S is done.

Measured on the H200 (b 128, s_k 8192, scripts/cutedsl_check.py --fp8 --bench-only, bench/NOTES.md 63-67):
h 16 223.0-224.8 us (3.08-3.11 TB/s of FP8 bytes), 1.30-1.31x the bf16 kernel; s_q 2 h 8 the same; h 32 with
one tile 295.3-295.8 us, 1.02-1.03x; with two tiles 275.1 against 298.4 us (decode_ab, 10 rounds; 1.07-1.12x
over five N 32 shapes). One tile at
N 16 took 270.6-273.7 us. Two tiles handed over block by block took 254 us: Nsight Compute put the loader's
proxy fences (each waits for the warp's stores) and the barrier arrivals after them at ~30% of the loader warps'
samples. What bounds N 16 now is shared memory: ~295 KB a page (TMA writes, the loader's loads and tile
stores, wgmma's reads of K, V and Q^T), ~94 B a cycle at 223 us; a second consumer warpgroup on alternate
pages, and freeing the raw stage before the conversion, both measured 4-5% slower.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from mlaserve.kernels.cutedsl.fp8_dequant import KV_BLOCKS
from mlaserve.kernels.cutedsl.fp8_pages import (
    D_PE, D_V, RAW_STAGES, TILE_N, _pv_gemm, _qk_gemm, fp8_host_setup, fp8_kernel_setup, fp8_loader, load_pe)
from mlaserve.kernels.cutedsl.keys_on_m import (
    col_slot, columns, exp_columns, finish_columns, mask_keys, publish_column_max, store_lse, take_column_max)
from mlaserve.kernels.cutedsl.request_rows import (
    first_masked_key, grid_request, ordered_tensors, page_split, visible_keys)

THREADS = 256
CONSUMER_THREADS = 128
BAR_RED = 1           # the consumer's 4 warps: column maxima (then sums) in smem
BAR_P = 2             # the consumer's 4 warps: P^T complete in smem
WARPS = 4
# with two bf16 tiles, the loader hands a tile over every RELEASE_EVERY of its 8 column blocks (each hand-over
# is a proxy fence that waits for the loader's stores; the consumer works on the other tile meanwhile)
RELEASE_EVERY = 8


def raw_stages(n: int, tiles: int) -> int:
    """Raw ring stages beside Q and the tiles: two, or one where two tiles sit beside N 32's Q (36864 + 131072 +
    33792 + k_pe 8192 + P^T 4096 = 214016 B; a second stage would be 247808)."""
    return 1 if (n, tiles) == (32, 2) else RAW_STAGES


class MLADecodeFP8NarrowSm90:
    """Compiled per (causal, split, n, tiles) with n = 16 or 32 query rows per CTA and 1 or 2 bf16 c_kv tiles
    (two: the loader converts page t + 1 while the consumer computes on page t, and k_pe has a buffer of its own;
    one: k_pe travels in the raw stage); q, out bf16. Launched by mla_decode.py through `__call__`, with the
    arguments of MLADecodeFP8SeesawSm90.__call__."""

    def __init__(self, causal: bool, is_split: bool, n: int, tiles: int, bt_ahead: bool = True,
                 ordered: bool = False):
        assert n in (16, 32) and tiles in (1, 2)
        self.dtype = cutlass.BFloat16
        self.causal = causal
        self.is_split = is_split
        self.n = n
        self.tiles = tiles
        self.raw_pe = self.tiles == 1
        self.release_every = 1 if self.raw_pe else RELEASE_EVERY
        self.raw_stages = raw_stages(n, self.tiles)
        self.bt_ahead = bt_ahead
        self.ordered = ordered      # the grid's requests through an order (request_rows.ordered_tensors)

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, kv_ptr: cute.Pointer, rope_ptr: cute.Pointer, bt_ptr: cute.Pointer,
                 seqlens_ptr: cute.Pointer, out_ptr: cute.Pointer, lse_ptr: cute.Pointer, po_ptr: cute.Pointer,
                 pl_ptr: cute.Pointer, batch: Int32, s_q: Int32, h: Int32, num_pages: Int32, max_pages: Int32,
                 num_splits: Int32, scale_log2: Float32, stream):
        """As MLADecodeFP8SeesawSm90.__call__ (s_q * h <= n)."""
        n = self.n
        rows = s_q * h
        (mBT, mSeqlens, mOut, mLse, mPO, mPL), (atom, sQ_layout, sKV_layout, sPE_layout, sRaw_layout), \
            (tma_q, mQ_tma, tma_raw, mRaw_tma, tma_pe, mPE_tma) = fp8_host_setup(
                n, q_ptr, kv_ptr, rope_ptr, bt_ptr, seqlens_ptr, out_ptr, lse_ptr, po_ptr, pl_ptr, batch, s_q, h,
                num_pages, max_pages, num_splits, self.raw_stages)
        if const_expr(self.ordered):
            mLse, mPO = ordered_tensors(mLse, mPO, lse_ptr, po_ptr, batch, self.is_split)
        sPt_layout = cute.tile_to_shape(atom, (n, TILE_N), order=(0, 1))     # P^T [n, 64 keys], K-major
        # the bf16 tiles side by side; k_pe in the raw stages, or in one buffer of its own (the consumer loads
        # page t + 1's once S of page t is done)
        sKV_layout = cute.tile_to_shape(atom, (TILE_N, D_V, self.tiles), order=(0, 1, 2))
        if const_expr(not self.raw_pe):
            sPE_layout = cute.tile_to_shape(atom, (TILE_N, D_PE, 1), order=(0, 1, 2))

        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            Float32, (1, 1, 1), (64, n))
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.MN, warpgroup.OperandMajorMode.K,
            Float32, (1, 1, 1), (64, n))

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sPE: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sPE_layout)], 1024]
            sRaw: cute.struct.Align[cute.struct.MemRange[Int32, cute.cosize(sRaw_layout)], 1024]
            sPt: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sPt_layout)], 1024]
            raw_mbar: cute.struct.MemRange[cutlass.Int64, self.raw_stages * 2]
            q_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            kv_mbar: cute.struct.MemRange[cutlass.Int64, self.tiles * (KV_BLOCKS + 1) + (not self.raw_pe)]
            red: cute.struct.MemRange[Float32, 2 * WARPS * n]

        self.shared_storage = SharedStorage
        self.kernel(tma_q, mQ_tma, tma_raw, mRaw_tma, tma_pe, mPE_tma, mBT, mSeqlens, mOut, mLse, mPO, mPL,
                    s_q, h, rows, num_splits, scale_log2, sQ_layout, sKV_layout, sPE_layout, sPt_layout,
                    sRaw_layout, tiled_mma_qk, tiled_mma_pv).launch(
            grid=(1, num_splits, batch), block=[THREADS, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ_tma: cute.Tensor, tma_raw: cute.CopyAtom, mRaw_tma: cute.Tensor,
               tma_pe: cute.CopyAtom, mPE_tma: cute.Tensor, mBT: cute.Tensor, mSeqlens: cute.Tensor,
               mOut: cute.Tensor, mLse: cute.Tensor, mPO: cute.Tensor, mPL: cute.Tensor, s_q: Int32, h: Int32,
               rows: Int32, num_splits: Int32, scale_log2: Float32, sQ_layout: cute.ComposedLayout,
               sKV_layout: cute.ComposedLayout, sPE_layout: cute.ComposedLayout, sPt_layout: cute.ComposedLayout,
               sRaw_layout: cute.Layout, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma):
        n = self.n
        tidx, _, _ = cute.arch.thread_idx()
        _, split, batch = cute.arch.block_idx()
        batch = grid_request(batch, mLse, mPO, self.ordered, self.is_split)
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = cute.arch.make_warp_uniform(tidx // 128)
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_raw)
            cpasync.prefetch_descriptor(tma_pe)

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        tiles = self.tiles
        raw_pe = self.raw_pe
        kv_full = storage.kv_mbar.data_ptr()                 # [tiles][KV_BLOCKS]
        kv_empty = kv_full + tiles * KV_BLOCKS               # [tiles]
        pe_full = kv_empty + tiles                           # the k_pe buffer's TMA (one phase a page)
        if const_expr(not raw_pe):
            if tidx == 0:
                cute.arch.mbarrier_init(pe_full, 1)
        raw_pipe, q_pipe, sQ, sKV, sPE, sRaw = fp8_kernel_setup(
            tidx, storage, CONSUMER_THREADS, n, sQ_layout, sKV_layout, sPE_layout, sRaw_layout, tiles, raw_pe,
            self.raw_stages)
        sPt = storage.sPt.get_tensor(sPt_layout.outer, swizzle=sPt_layout.inner)
        sRed = storage.red.get_tensor(cute.make_layout((n, WARPS, 2), stride=(1, n, WARPS * n)))

        seqlen = mSeqlens[batch]
        start, n_tiles = page_split(seqlen, split, num_splits)
        first_page = start // TILE_N

        if wg == 0:
            fp8_loader(tidx, warp_idx, tma_q, mQ_tma, sQ, q_pipe, 0, n, tma_raw, mRaw_tma, sRaw,
                       tma_pe, mPE_tma, sPE, raw_pipe, storage.sRaw.data_ptr().toint(),
                       storage.sKV.data_ptr().toint(), kv_full, kv_empty, mBT, batch, first_page, n_tiles, seqlen,
                       start,
                       tiles, raw_pe, self.release_every, self.raw_stages, self.bt_ahead)
        else:
            ctid = tidx - 128
            warp = ctid // 32
            lane = ctid % 32
            thr_qk = tiled_mma_qk.get_slice(ctid)
            thr_pv = tiled_mma_pv.get_slice(ctid)
            sQ_nope = cute.local_tile(sQ, (n, D_V), (0, 0))
            sQ_pe = cute.local_tile(sQ, (n, D_PE), (0, D_V // D_PE))
            tSrK = tiled_mma_qk.make_fragment_A(thr_qk.partition_A(sKV))
            tSrKpe = tiled_mma_qk.make_fragment_A(thr_qk.partition_A(sPE))
            tSrQ = tiled_mma_qk.make_fragment_B(thr_qk.partition_B(sQ_nope))
            tSrQpe = tiled_mma_qk.make_fragment_B(thr_qk.partition_B(sQ_pe))
            # V^T [512, 64 keys] (a tile) and P^T as [64 keys, n]: views of the K-major tiles, (a, b) -> their (b, a)
            sVt = cute.composition(sKV, cute.make_layout((D_V, TILE_N, tiles), stride=(TILE_N, 1, TILE_N * D_V)))
            sP_keys = cute.composition(sPt, cute.make_layout((TILE_N, n), stride=(n, 1)))
            tOrV = tiled_mma_pv.make_fragment_A(thr_pv.partition_A(sVt))
            tOrP = tiled_mma_pv.make_fragment_B(thr_pv.partition_B(sPt))
            tPsP = thr_qk.partition_C(sP_keys)
            acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((TILE_N, n)), Float32)
            acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((D_V, n)), Float32)
            acc_o.fill(0.0)
            tOcO = thr_pv.partition_C(cute.make_identity_tensor((D_V, n)))
            rP = cute.make_fragment_like(acc_s, self.dtype)
            # without raw_pe this warp group loads each page's k_pe (its warp 0, once every warp's S of the page
            # before is done; the loader prefetched it into L2 with the page's raw bytes)
            if const_expr(not raw_pe):
                gPE = cute.local_tile(mPE_tma, (TILE_N, D_PE), (None, 0))           # [64, 64, pages]
                tPs, tPg = cpasync.tma_partition(tma_pe, 0, cute.make_layout(1), cute.group_modes(sPE, 0, 2),
                                                 cute.group_modes(gPE, 0, 2))
                if warp == 0 and n_tiles > 0:
                    load_pe(tma_pe, tPg, tPs, pe_full, mBT[batch, first_page], lane)

            # this thread's keys: rows k0 and k0 + 8 of each page; its columns (query rows): slot s is
            # column 8 (s // 2) + 2 (lane % 4) + s % 2
            k0 = warp * 16 + lane // 4
            slots = n // 4
            cols = columns(lane, n)
            vis = cute.make_rmem_tensor(slots, Int32)       # keys visible to each column
            col_m = cute.make_rmem_tensor(slots, Float32)   # running max (log2 units)
            col_l = cute.make_rmem_tensor(slots, Float32)   # this thread's part of the running sum
            alpha = cute.make_rmem_tensor(slots, Float32)
            m_base = cute.make_rmem_tensor(slots, Float32)
            for s in cutlass.range_constexpr(slots):
                vis[s] = visible_keys(seqlen, s_q, h, cols[s], self.causal)
                col_m[s] = -Float32.inf
                col_l[s] = 0.0
            min_vis = first_masked_key(seqlen, s_q, self.causal)

            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            q_pipe.consumer_wait(q_state)
            raw_c = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.raw_stages)
            # (not raw_pe) the k_pe refills' block-table entries, read a page ahead (as fp8_loader's)
            next_page = Int32(0)
            if const_expr(not raw_pe and self.bt_ahead):
                if warp == 0 and 1 < n_tiles:
                    next_page = mBT[batch, first_page + 1]
            for t in cutlass.range(n_tiles, unroll=1):
                tok0 = start + t * TILE_N
                tile = t % tiles
                later_page = Int32(0)
                if const_expr(not raw_pe and self.bt_ahead):
                    if warp == 0 and t + 2 < n_tiles:
                        later_page = mBT[batch, first_page + t + 2]
                # -- S^T = K Q_nope^T + Kpe Q_pe^T, K's column blocks as soon as the loader hands them over --
                if const_expr(raw_pe):
                    raw_pipe.consumer_wait(raw_c)
                    _qk_gemm(tiled_mma_qk, acc_s, tSrK[None, None, None, tile], tSrQ,
                             tSrKpe[None, None, None, raw_c.index], tSrQpe, kv_full + tile * KV_BLOCKS,
                             (t // tiles) % 2)
                    cute.arch.sync_warp()
                    raw_pipe.consumer_release(raw_c)
                    raw_c.advance()
                else:
                    _qk_gemm(tiled_mma_qk, acc_s, tSrK[None, None, None, tile], tSrQ, tSrKpe[None, None, None, 0],
                             tSrQpe, kv_full + tile * KV_BLOCKS, (t // tiles) % 2, self.release_every, pe_full, t % 2)
                for i in cutlass.range_constexpr(cute.size(acc_s)):
                    acc_s[i] = acc_s[i] * scale_log2
                mask_keys(acc_s, tok0, k0, vis, min_vis, n)
                # -- column maxima: own two rows, the warp's 16 keys, then the 4 warps --
                publish_column_max(acc_s, cols, lane, warp, sRed, (t % 2,))
                cute.arch.barrier(barrier_id=BAR_RED, number_of_threads=CONSUMER_THREADS)
                # every warp's S of page t is done: the k_pe buffer takes page t + 1's
                if const_expr(not raw_pe):
                    if warp == 0 and t + 1 < n_tiles:
                        if const_expr(not self.bt_ahead):
                            next_page = mBT[batch, first_page + t + 1]
                        load_pe(tma_pe, tPg, tPs, pe_full, next_page, lane)
                    next_page = later_page
                take_column_max(col_m, col_l, alpha, m_base, cols, sRed, (t % 2,))
                exp_columns(acc_s, m_base, col_l, n)
                rP.store(acc_s.load().to(self.dtype))
                for i in cutlass.range_constexpr(cute.size(rP)):
                    tPsP[i] = rP[i]
                # generic-proxy writes of P^T -> visible to wgmma (async proxy), then to all 4 warps' wgmma
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=BAR_P, number_of_threads=CONSUMER_THREADS)
                # -- O^T = alpha O^T + V^T P^T, then the bf16 tile is free for page t + tiles --
                for i in cutlass.range_constexpr(cute.size(acc_o)):
                    acc_o[i] = acc_o[i] * alpha[col_slot(i, n)]
                _pv_gemm(tiled_mma_pv, acc_o, tOrV[None, None, None, tile], tOrP)
                cute.arch.mbarrier_arrive(kv_empty + tile)

            # -- epilogue: whole column sums (shuffles, then the 4 warps), normalize, store --
            par = n_tiles % 2              # the maxima buffer no warp reads any more
            inv_l, lse = finish_columns(col_m, col_l, cols, lane, warp, sRed, (par,), BAR_RED,
                                        CONSUMER_THREADS)
            for i in cutlass.range_constexpr(cute.size(acc_o)):
                r = tOcO[i][1]
                if r < rows:
                    val = acc_o[i] * inv_l[col_slot(i, n)]
                    if const_expr(self.is_split):
                        mPO[batch, split, r, tOcO[i][0]] = val
                    else:
                        mOut[batch, r, tOcO[i][0]] = val.to(self.dtype)
            store_lse(lse, cols, lane, warp, rows, mLse, mPL, batch, split, self.is_split)
