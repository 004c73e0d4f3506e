"""The Hopper (sm_90a) sparse MLA (DSA) kernel over the FP8 656-byte KV format, in CuTe DSL.

One CTA = 64 heads of one query token x one split of that token's top-k, the grid of the bf16 sparse kernel
(sparse_mla_kernel.py, whose host setup, CTA prelude, Q load and gather pieces it shares). The rows are
gathered as there, the e4m3 bytes dequantized by fp8_pages.py's and fp8_dequant.py's helpers, and the consumers'
math is the split consumer pair's (split_consumers.py) with the sparse kernel's per-key mask.

Each cached token is 656 bytes (mlaserve/kernels/fp8_format.py): 512 e4m3 c_kv bytes, 4 fp32 scales, 64 bf16
k_pe values. Per tile of 64 gathered rows:

    raw ring stage (cp.async)  e4m3 + scales  [64, 528 B] row-major (16-byte chunks 0..32 of the row)  33792 B
                               k_pe           [64, 64] bf16, 128-byte swizzle (chunks 33..40)         8192 B
    bf16 tile (loader)         c_kv           [64, 512] bf16, 128-byte swizzle                        65536 B

Warp roles (384 threads):
- WG 0, the loader (setmaxnreg 56). Warp 0 loads Q once (TMA). All 128 threads gather each tile's rows with
  cp.async into a 2-stage raw ring: thread p owns rows p // 8 + 16 i (i < 4) and, of each, the raw chunks
  p % 8 + 8 j (chunk 32, the scales, by the threads with p % 8 = 0) and the k_pe chunk p % 8. A row whose
  index is -1, or past the split's end, is zero-filled by the copy (src-size 0): its e4m3 bytes and scales
  are 0, so it dequantizes to 0, and 0 * P keeps poison in an unused slot out of O. Each thread ends a stage
  with cp.async.mbarrier.arrive.noinc on the stage's full barrier (128 arrivals). Then the same threads
  wait for the stage and dequantize it into the one bf16 c_kv tile (fp8_dequant.dequant_tile:
  the bit trick, 8 column blocks each released on its own mbarrier), and gather the tile two ahead into
  the freed stage.
- WG 1 and WG 2, the consumers (setmaxnreg 224): S_w = Q K_w^T over keys 32w..32w+32 (k_pe from the raw
  stage, then c_kv from the bf16 tile block by block), keys whose index is -1 or past the end at -inf,
  P_w to smem, O_w += P V_w over columns 256w..256w+256.

Smem: Q, the bf16 tile, the raw stage in its row-major part and the swizzled k_pe part, P: Q 73728 + bf16 tile 65536
+ k_pe 2 x 8192 + raw 2 x 33792 + P 8192 + mbarriers and row statistics = 232056 B (232448 with the struct's
1024-byte alignment, the sm_90 limit). One bf16 tile: dequantizing tile t + 1 waits for the consumers' P V of tile t;
the QK of tile t overlaps its conversion block by block. Measured on the H200 at b128 s_q2 h128 topk 2048: 244
TFLOP/s converting whole tiles, 277 with the blocks and the loads issued a block ahead.

The half ring (SparseMLAFP8Sm90(half_ring=True), sparse_mla.FP8_HALF_RING; first built for the dense 64-row FP8
decode kernel that the FP8 seesaw replaced, bench/NOTES.md 118-119): the bf16 tile as three slots of a column half,
tile t's half h in slot (2 t + h) % 3, each freed by the consumer whose P V reads it (kv_empty + slot, 128 arrivals)
and handed over on kv_full + slot. The e4m3 bytes and scales have one buffer: each loader thread reads its share into
80 registers (fp8_dequant.load_raw_page), the four warps meet on BAR_LOADER, and tile t + 1 is gathered into the
buffer while tile t is converted. The pipeline's two stages are then k_pe's two buffers (the consumers still free a
stage after S). Smem: Q 73728 + slots 98304 + k_pe 16384 + raw 33792 + P 8192 + barriers = 231424 B. Registers:
loader 112, consumers 192. The default since bench/NOTES.md 125 (H100, s_q 1, top-k 2048: 1.062x at b64 h128, 1.004x
at b128 h64). So is the consumers' softmax on one barrier a tile (SparseMLAFP8Sm90(one_barrier=True),
sparse_mla.FP8_ONE_BARRIER; split_consumers.one_barrier_p): 1.008-1.011x on the half ring (NOTES 127).

Barriers per tile t (stage s = t % 2):
  raw full[s]  128 loader arrivals (cp.async noinc)   loader waits (dequantize), consumers wait (k_pe)
  raw empty[s] 12 warp arrivals: 4 loader warps after dequantizing, 8 consumer warps after S
  kv_empty     256 consumer threads after P V of t-1 -> loader may overwrite the bf16 tile
  kv_full[b]   128 loader threads after converting column block b of t (fence.proxy.async first) ->
               the consumers' wgmma on that block (8 barriers)
cp.async writes through the generic proxy, wgmma reads through the async proxy: the consumers fence after
their raw-full wait (k_pe), the loader before its kv_full arrival (c_kv).
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from mlaserve.kernels.cutedsl.common import register_split_fits
from mlaserve.kernels.cutedsl.fp8_dequant import KV_BLOCKS, dequant_tile, load_raw_page
from mlaserve.kernels.cutedsl.fp8_pages import HALF_SLOTS, _qk_gemm, pv_and_release, store_halves
from mlaserve.kernels.cutedsl.sparse_mla_kernel import (
    D_QK, D_V, HALF_N, PRODUCER_THREADS, ROW_PASSES, ROWS_PER_PASS, THREADS, TILE_M, TILE_N, consumer_rows, cp16,
    cta_coords, drain_copies, load_q, make_q_pipe, row_slots, slot_source, sparse_host_setup, split_range,
    wait_gathered, wait_q)
from mlaserve.kernels.cutedsl.split_consumers import (
    CONSUMER_THREADS, finish_rows, key_of, one_barrier_p, publish_p, rescale_to_tile_max, scale_rows,
    sparse_key_bias, split_tiled_mmas, store_sparse)

D_PE = D_QK - D_V
RAW_WORDS = 132       # the e4m3 bytes and the 4 scales of a row, in 32-bit words (528 B)
ROW_WORDS = 164       # 656 B
RAW_CHUNKS = RAW_WORDS // 4   # 33 16-byte chunks
RAW_STAGES = 2
PE_STAGES = 2         # the half ring's k_pe buffers (the pipeline's two stages)
LOADER_REGS = 56
CONSUMER_REGS = 224   # 128 * 56 + 256 * 224 = 64512 = 384 * 168
LOADER_THREADS = PRODUCER_THREADS   # 128, gathering 8 threads per row as sparse_mla_kernel.row_slots assumes
HALF_V = D_V // 2
# the half ring: the loader holds a tile's raw bytes in 80 registers beside the gather's (104 spilled 16 bytes)
HALF_RING_LOADER_REGS = 112
HALF_RING_CONSUMER_REGS = 192   # 128 * 112 + 256 * 192 = 64512
BAR_LOADER = 3        # the half ring: the loader's 4 warps, each thread's share of the raw stage in registers
assert register_split_fits((LOADER_THREADS, LOADER_REGS), (CONSUMER_THREADS, CONSUMER_REGS))
assert register_split_fits((LOADER_THREADS, HALF_RING_LOADER_REGS), (CONSUMER_THREADS, HALF_RING_CONSUMER_REGS))


class SparseMLAFP8Sm90:
    """Compiled per split; q, out bf16. Launched by sparse_mla.py through `__call__`."""

    def __init__(self, is_split: bool, store16: bool = False, half_ring: bool = False, one_barrier: bool = False):
        self.dtype = cutlass.BFloat16
        self.is_split = is_split
        self.store16 = store16    # blocks of 64 heads (out or split partials) stored 16 bytes at a time
        # the bf16 tile as HALF_SLOTS column-half slots, one raw buffer (module docstring, "The half ring")
        self.half_ring = half_ring
        # the consumers' softmax on one barrier a page where no row's max rises (split_consumers.one_barrier_p)
        self.one_barrier = one_barrier

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, kv_ptr: cute.Pointer, idx_ptr: cute.Pointer, out_ptr: cute.Pointer,
                 lse_ptr: cute.Pointer, po_ptr: cute.Pointer, pl_ptr: cute.Pointer,
                 tokens: Int32, h: Int32, num_slots: Int32, topk: Int32, num_splits: Int32, split_len: Int32,
                 scale_log2: Float32, stream):
        """q bf16 [tokens, h, 576]; kv: the cache uint8 [num_slots, 656] as int32 words; idx int32
        [tokens, topk]; out bf16 [tokens, h, 512], lse fp32 [tokens, h]; partials (split only) fp32
        [num_splits, tokens, h, 512] and [num_splits, tokens, h]. Split s covers indices [s * split_len, +split_len)."""
        mKV = cute.make_tensor(kv_ptr, cute.make_layout((num_slots, ROW_WORDS), stride=(ROW_WORDS, 1)))
        (mIdx, mOut, mLse, mPO, mPL), (atom, sQ_layout, sP_layout), (tma_q, mQ_tma), (m_blocks, grid) = \
            sparse_host_setup(self.dtype, q_ptr, idx_ptr, out_ptr, lse_ptr, po_ptr, pl_ptr, tokens, h, topk,
                              num_splits)
        sKV_layout = cute.tile_to_shape(atom, (TILE_N, D_V), order=(0, 1))
        sPE_layout = cute.tile_to_shape(atom, (TILE_N, D_PE, RAW_STAGES), order=(0, 1, 2))
        raw_buffers = RAW_STAGES
        if const_expr(self.half_ring):
            sKV_layout = cute.tile_to_shape(atom, (TILE_N, HALF_V, HALF_SLOTS), order=(0, 1, 2))
            raw_buffers = 1
        sRaw_layout = cute.make_layout((TILE_N, RAW_WORDS, raw_buffers),
                                       stride=(RAW_WORDS, 1, TILE_N * RAW_WORDS))
        tiled_mma_qk, tiled_mma_pv = split_tiled_mmas(self.dtype)

        self.shared_storage = fp8_split_storage(sQ_layout, sKV_layout, sPE_layout, sRaw_layout, sP_layout)
        self.kernel(tma_q, mQ_tma, mKV, mIdx, mOut, mLse, mPO, mPL, h, m_blocks, split_len, topk, scale_log2,
                    sQ_layout, sKV_layout, sPE_layout, sP_layout, sRaw_layout, tiled_mma_qk, tiled_mma_pv).launch(
            grid=grid, block=[THREADS, 1, 1], smem=self.shared_storage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ_tma: cute.Tensor, mKV: cute.Tensor, mIdx: cute.Tensor,
               mOut: cute.Tensor, mLse: cute.Tensor, mPO: cute.Tensor, mPL: cute.Tensor, h: Int32,
               m_blocks: Int32, split_len: Int32, topk: Int32, scale_log2: Float32,
               sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout, sPE_layout: cute.ComposedLayout,
               sP_layout: cute.ComposedLayout, sRaw_layout: cute.Layout, tiled_mma_qk: cute.TiledMma,
               tiled_mma_pv: cute.TiledMma):
        tidx, warp_idx, wg, m_block, token, split = cta_coords(tma_q, m_blocks)
        storage = utils.SmemAllocator().allocate(self.shared_storage)
        kv_full = storage.kv_mbar.data_ptr()       # KV_BLOCKS barriers, one per 64-column block of the tile
        kv_empty = kv_full + KV_BLOCKS
        if const_expr(self.half_ring):
            kv_empty = kv_full + HALF_SLOTS         # a pair per slot (the half ring)
            if tidx == 0:
                for slot in cutlass.range_constexpr(HALF_SLOTS):
                    cute.arch.mbarrier_init(kv_full + slot, LOADER_THREADS)
                    cute.arch.mbarrier_init(kv_empty + slot, CONSUMER_THREADS // 2)
        else:
            if tidx == 0:
                for cb in cutlass.range_constexpr(KV_BLOCKS):
                    cute.arch.mbarrier_init(kv_full + cb, LOADER_THREADS)
                cute.arch.mbarrier_init(kv_empty, CONSUMER_THREADS)
        # (the pipelines' creation fences the mbarrier inits and syncs the CTA)
        # raw full: 128 loader threads, one cp.async noinc arrival each; raw empty: one lane of each of the
        # 4 loader warps (dequantized) and the 8 consumer warps (k_pe used in S)
        raw_pipe = pipeline.PipelineCpAsync.create(
            barrier_storage=storage.raw_mbar.data_ptr(), num_stages=RAW_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, LOADER_THREADS),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, (LOADER_THREADS + CONSUMER_THREADS) // 32))
        q_pipe = make_q_pipe(storage, self.dtype)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sKV = storage.sKV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sPE = storage.sPE.get_tensor(sPE_layout.outer, swizzle=sPE_layout.inner)
        sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
        sStat = storage.row_stat.get_tensor(cute.make_layout((TILE_M, 2)))
        start, end, n_tiles = split_range(split, split_len, topk)

        if wg == 0:
            # ---------------- loader: Q (TMA, warp 0), gather (cp.async) and dequantization (all four warps) ----
            cute.arch.setmaxregister_decrease(HALF_RING_LOADER_REGS if self.half_ring else LOADER_REGS)
            load_q(warp_idx, tma_q, mQ_tma, sQ, q_pipe, token, m_block)
            raw_p = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, RAW_STAGES)
            if const_expr(self.half_ring):
                self._half_ring_loader(tidx, token, start, end, n_tiles, mKV, mIdx, storage.sRaw.data_ptr(),
                                       storage.sPE.data_ptr(), storage.sKV.data_ptr().toint(), raw_pipe, raw_p,
                                       kv_full, kv_empty)
            else:
                for t in cutlass.range(cutlass.min(n_tiles, RAW_STAGES), unroll=1):
                    self._gather(tidx, token, start + t * TILE_N, end, mKV, mIdx, storage.sRaw.data_ptr(),
                                 storage.sPE.data_ptr(), raw_pipe, raw_p)
                    raw_p.advance()

                raw_base = storage.sRaw.data_ptr().toint()
                kv_base = storage.sKV.data_ptr().toint()
                raw_c = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, RAW_STAGES)
                for t in cutlass.range(n_tiles, unroll=1):
                    raw_pipe.consumer_wait(raw_c)
                    cute.arch.mbarrier_wait(kv_empty, (t + 1) % 2)
                    # every row converts: a zero-filled one (index -1 or past the end) has bytes and scale 0 -> 0
                    dequant_tile(tidx, raw_base + raw_c.index * (TILE_N * RAW_WORDS * 4), kv_base, kv_full,
                                  Int32(TILE_N))
                    cute.arch.sync_warp()
                    if cute.arch.lane_idx() == 0:
                        raw_pipe.consumer_release(raw_c)
                    raw_c.advance()
                    if t + RAW_STAGES < n_tiles:
                        self._gather(tidx, token, start + (t + RAW_STAGES) * TILE_N, end, mKV, mIdx,
                                     storage.sRaw.data_ptr(), storage.sPE.data_ptr(), raw_pipe, raw_p)
                    raw_p.advance()
            drain_copies()
        else:
            # ---------------- consumers ----------------
            cute.arch.setmaxregister_increase(HALF_RING_CONSUMER_REGS if self.half_ring else CONSUMER_REGS)
            cw = wg - 1                  # which half: keys 32cw.. of S, columns 256cw.. of O
            ctid = tidx % 128
            (tSrQ, tSrQpe, tSrK, tSrKpe, tOrP, tOrV, tPsP, acc_s, acc_o, tScS, tOcO, rP) = _consumer_operands(
                tiled_mma_qk, tiled_mma_pv, ctid, cw, sQ, sKV, sPE, sP, self.half_ring)
            n_vals = cute.size(acc_s)
            bias = cute.make_rmem_tensor(n_vals // 2, Float32)   # 0 or -inf per distinct key (key_of) of this thread
            r0, row_m, row_l = consumer_rows(ctid)
            alpha = cute.make_rmem_tensor(2, Float32)
            m_base = cute.make_rmem_tensor(2, Float32)
            # a row with no key yet exponentiates against 0 (move_row_max's rule): one_barrier_p's fast path can
            # come first, on a tile where every row's keys are masked (a sparse top-k's -1s), before any move
            m_base.fill(0.0)

            wait_q(q_pipe)
            raw_c = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, RAW_STAGES)
            for t in cutlass.range(n_tiles, unroll=1):
                stage = raw_c.index
                # -- this half's keys: -inf where the index is -1 or past the split (read before the waits) --
                sparse_key_bias(bias, tScS, start + t * TILE_N + cw * HALF_N, end, mIdx, token)
                wait_gathered(raw_pipe, raw_c)      # k_pe, read by wgmma straight from the raw stage
                # -- S_w = Q_pe Kpe_w^T + Q_nope K_w^T, each 64-column block of K as soon as it is converted --
                if const_expr(self.half_ring):
                    _qk_half_ring(tiled_mma_qk, acc_s, tSrQ, tSrK, tSrQpe, tSrKpe, stage, kv_full, t)
                else:
                    _qk_gemm(tiled_mma_qk, acc_s, tSrQ, tSrK, tSrQpe, tSrKpe[None, None, None, stage], kv_full,
                             t % 2)
                # the wgmma wait is warp-wide: one lane per warp frees the raw stage
                if cute.arch.lane_idx() == 0:
                    raw_pipe.consumer_release(raw_c)
                raw_c.advance()
                for i in cutlass.range_constexpr(n_vals):
                    acc_s[i] = acc_s[i] * scale_log2 + bias[key_of(i)]
                # -- O_w = alpha O_w + P V_w --
                if const_expr(self.one_barrier):
                    if one_barrier_p(acc_s, row_m, row_l, alpha, m_base, rP, tPsP, sStat, r0, cw, ctid, t > 0) != 0:
                        scale_rows(acc_o, alpha)
                else:
                    rescale_to_tile_max(acc_s, row_m, row_l, alpha, m_base, sStat, r0, cw, ctid)
                    publish_p(acc_s, m_base, row_l, rP, tPsP)
                    scale_rows(acc_o, alpha)
                pv_and_release(tiled_mma_pv, acc_o, tOrP, tOrV, kv_empty, t, cw, n_tiles, self.half_ring,
                               self.one_barrier)

            # -- epilogue: row sums through the maxima's smem, normalize, store --
            inv_l = cute.make_rmem_tensor(2, Float32)
            lse = cute.make_rmem_tensor(2, Float32)
            finish_rows(row_m, row_l, sStat, r0, cw, ctid, inv_l, lse)
            store_sparse(acc_o, inv_l, lse, tOcO, r0, cw, ctid, m_block * TILE_M, h, token, split, mOut, mLse,
                         mPO, mPL, self.is_split, self.store16)

    @cute.jit
    def _half_ring_loader(self, tidx: Int32, token: Int32, start: Int32, end: Int32, n_tiles: Int32,
                          mKV: cute.Tensor, mIdx: cute.Tensor, raw_ptr: cute.Pointer, pe_ptr: cute.Pointer,
                          kv_base: Int32, raw_pipe: pipeline.PipelineCpAsync, raw_p: pipeline.PipelineState,
                          kv_full: cute.Pointer, kv_empty: cute.Pointer):
        """The loader's gather and conversion on the half ring. The pipeline's two stages are k_pe's two buffers;
        the e4m3 bytes and scales have one buffer, which each thread reads into registers (fp8_dequant.
        load_raw_page) before tile t + 1 is gathered into it (after BAR_LOADER: every thread's share read), so
        that tile t + 1 lands while tile t is converted into its two slots (fp8_pages.store_halves)."""
        raw_base = raw_ptr.toint()
        if n_tiles > 0:
            self._gather(tidx, token, start, end, mKV, mIdx, raw_ptr, pe_ptr, raw_pipe, raw_p, False)
        raw_p.advance()
        raw_c = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, RAW_STAGES)
        for t in cutlass.range(n_tiles, unroll=1):
            raw_pipe.consumer_wait(raw_c)
            page = load_raw_page(tidx, raw_base)
            cute.arch.sync_warp()
            if cute.arch.lane_idx() == 0:
                raw_pipe.consumer_release(raw_c)
            raw_c.advance()
            cute.arch.barrier(barrier_id=BAR_LOADER, number_of_threads=LOADER_THREADS)
            if t + 1 < n_tiles:
                self._gather(tidx, token, start + (t + 1) * TILE_N, end, mKV, mIdx, raw_ptr, pe_ptr, raw_pipe,
                             raw_p, False)
            raw_p.advance()
            # every row converts: a zero-filled one (index -1 or past the end) has bytes and scale 0 -> 0
            store_halves(tidx, page, t, kv_base, kv_full, kv_empty, Int32(TILE_N))

    @cute.jit
    def _gather(self, tidx: Int32, token: Int32, pos0: Int32, end: Int32, mKV: cute.Tensor, mIdx: cute.Tensor,
                raw_ptr: cute.Pointer, pe_ptr: cute.Pointer, raw_pipe: pipeline.PipelineCpAsync,
                state: pipeline.PipelineState, raw_staged: cutlass.Constexpr[bool] = True):
        """One tile's 64 rows (indices pos0 .. pos0 + 64 of the token) into raw stage state.index by cp.async.

        Raw chunk c (16 bytes) of row r lands at word r * 132 + 4 c of the stage; k_pe chunk k at the
        swizzled K-major position r * 64 + ((k ^ (r % 8)) * 8) (bf16 elements) of the stage's [64, 64] tile --
        the layout TMA writes for sPE_layout (one 64-column atom block of 8-row, 1024-byte atoms). Without
        `raw_staged` (the half ring) the raw part goes to the one raw buffer whatever the stage.
        """
        prow = tidx // 8
        pc = tidx % 8
        slots = row_slots(mIdx, token, pos0 + prow, end)
        raw_pipe.producer_acquire(state)
        raw_stage = raw_ptr
        if const_expr(raw_staged):
            raw_stage = raw_ptr + state.index * (TILE_N * RAW_WORDS)
        pe_stage = pe_ptr + state.index * (TILE_N * D_PE)
        kv_base = mKV.iterator
        swz = (pc ^ (prow % 8)) * 8
        for i in cutlass.range_constexpr(ROW_PASSES):
            r = prow + ROWS_PER_PASS * i
            nbytes, row_off = slot_source(slots[i], ROW_WORDS)
            for j in cutlass.range_constexpr((RAW_CHUNKS + 7) // 8):
                if const_expr(8 * j + 8 <= RAW_CHUNKS):
                    cp16(raw_stage + (r * RAW_WORDS + (pc + 8 * j) * 4), kv_base + (row_off + (pc + 8 * j) * 4),
                         nbytes)
                else:
                    if pc + 8 * j < RAW_CHUNKS:      # the last chunk (the scales): one thread of the 8
                        cp16(raw_stage + (r * RAW_WORDS + (pc + 8 * j) * 4),
                             kv_base + (row_off + (pc + 8 * j) * 4), nbytes)
            cp16(pe_stage + (r * D_PE + swz), kv_base + (row_off + RAW_WORDS + pc * 4), nbytes)
        # fires once this thread's copies so far have landed (the barrier counts 128 such arrivals)
        raw_pipe.producer_commit(state)


def _consumer_operands(tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, ctid, cw, sQ: cute.Tensor,
                       sKV: cute.Tensor, sPE: cute.Tensor, sP: cute.Tensor, half_ring: bool = False):
    """Consumer cw's wgmma operands over the kernel's smem (Q [64, 576]; the bf16 c_kv tile [64, 512];
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
                  tSrQpe: cute.Tensor, tSrKpe: cute.Tensor, pe: Int32, kv_full: cute.Pointer, t: Int32):
    """The half ring's S_w of tile t as one wgmma group, waited for: k_pe's k-steps from its buffer `pe`, then each
    column half's from its slot (2 t + half) % HALF_SLOTS once the loader has handed it over."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, False)
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
    """The shared storage of the FP8 sparse MLA kernel with its split consumer pair:
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
