"""The Hopper (sm_90a) MLA decode over the FP8 656-byte KV format for requests of at most 32 query rows
(h 16 / h 32 with s_q 1, h 16 with s_q 2), keys on wgmma's M side, each page's e4m3 bytes turned into f16 in
the consumers' registers and multiplied there: no bf16 tile in shared memory, no hi / lo parts.

    S^T [64 keys, N] = K [64, 512] (Q * 2^a)^T + K_pe (Q_pe * 2^a)^T
        K as f16 register A: ldmatrix of the e4m3 boxes (as the 128-byte swizzle puts them), cvt e4m3x2 ->
        f16x2 and one f16x2 multiply by the row's scale of its 128-column group; B = Q * 2^a in f16 (its
        largest |value| a row in [128, 256)), its columns permuted as the fragments' (below); K_pe and
        Q_pe * 2^a (exact in bf16) in bf16 from smem, into the same accumulator.
        At 16 rows (group_s, mla_decode.FP8_F16_GROUP_S, the default there): K's exact e4m3 values (cvt only) into
        one accumulator per scale group, S^T = the k_pe product + sum_g S^T_g * scale_g[key] in fp32 (32 FFMA a
        page and thread against 128 HMUL2): K read exactly, as fast (bench/NOTES.md 150).
    O^T [512, N] += V^T_m P^T per 64-dim tile m
        V^T_m as f16 register A: ldmatrix .trans of the same boxes (fragment_ops.v_fragment's e4m3 fragment),
        cvt and one multiply by the keys' scales of the tile's group; B = P^T in f16, its keys permuted likewise.

Against mla_decode_fp8_mma_kernel.py (FP8 wgmma on the bytes): N query rows on N, not 2 N (Q's hi | lo), one
S^T accumulator, not one per scale group, P once, not four scaled hi / lo parts, and O^T accumulated in
place, not folded from a fresh product a tile. The cost moves to the conversions: ~5 instructions per 4 bytes,
for K and again for V^T, independent of N, which is what makes 32 rows cost little more than 16.
Against mla_decode_fp8_narrow_kernel.py (a loader warpgroup dequantizes into a bf16 tile): no tile stores
and reads through shared memory (~150 KB a page against ~300) and two consumers on alternate pages.

Values: e4m3 -> f16 is exact; e4m3 * scale (V, and K unless group_s) is rounded once to f16 (11 significant
bits, so within half an f16 ulp of the format's value; products below 2^-24, a scale under ~2^-15 on the smallest
e4m3, flush to zero);
Q * 2^a in f16 keeps bf16 q exactly down to 2^-22 of the row's largest; P in f16.

Fragments (lane = 4 q + c of warp w; the wgmma m64nNk16 f16 A fragment: words (row q, k 2c..2c+1), (row
q + 8, same), (row q, k 2c + 8..2c + 9), (row q + 8, same)):
- K: one ldmatrix .x4 (b16) per 32 columns gives the e4m3 A fragment of m64nNk32 (fragment_ops.ldsm_x4's
  docstring: words (key q, columns 4c..4c + 3), (key q + 8, same), then the same 16 columns on). Each word's low
  and high byte pairs become the k-step's first and third words: logical column 2c + j (j < 2) of a 16-column
  step is column 4c + j, and 2c + 8 + j is 4c + 2 + j (Q_PERM). Q is stored in that order.
- V^T: fragment_ops.v_fragment's word (dim row r, keys 2c, 2c + 8, 2c + 1, 2c + 9 of 16) gives the step's first word
  (keys 2c, 2c + 8) and its third (2c + 1, 2c + 9): logical key l of a 16-key step is key l with bits 0 and 3
  swapped. P^T is stored in that order; a thread's keys q and q + 8 land side by side, one 4-byte store.

Warp roles (256 threads): two consumer warpgroups on alternate pages (consumer c: pages t = c mod 2 in stages
c and c + 2 of 4, which it refills itself), each with its own O^T, maxima and sums, merged at the end
through consumer 1's stages. A stage holds a page's four e4m3 boxes (32 KB), its scales [64, 4] fp32 and k_pe
(8 KB). Smem at N 32: stages 4 x 41 KB + Q 36 KB + P^T 2 x 4 KB + the V scales' table 4 KB = 214 KB.

SASS (sm_90a, N 32): 255 registers, 96 bytes of stack, the page loop 1506 instructions (the FP8-MMA kernel at
N 32: 2012), of them 256 F2FP.F16.E4M3.UNPACK_B and 256 HMUL2 (the conversions), 68 HGMMA, 22 LDL.
Measured on an H100 (bench/NOTES.md 126; decode_ab against the kernels it replaces, --sustain-ms 20): b128 h32
8k / 32k 1.064 / 1.127x, h16 s_q2 8k 1.067x, h16 4k / 8k / 32k 1.018 / 1.013 / 1.007x, h32 4k 0.996x; FP8 over
the bf16 kernel at b128 h32 1.44 / 1.54 / 1.59 / 1.62x (4k-32k; 1.46-1.49x before), h16 1.53-1.65x.
With few pages a split (b4 h32 32k, b1 h16 32k) 0.95-0.99x: Q is built per split, so mla_decode takes it from
48 pages a split, as the FP8-MMA kernel.

Start and end (bench/NOTES.md 134-136): with early_start (mla_decode.FP8_EARLY_START, on) every warp issues its
Q reads before the first pages' loads, and unsplit launches read those pages' block-table entries beside the
request's length (1.008-1.014x on an H100); with split_epilogue (FP8_SPLIT_EPILOGUE, on) both consumers merge and
store half of O^T each instead of consumer 0 all of it (1.001-1.006x on an H100; the same bits).
With stagger (FP8_F16_STAGGER, on) each consumer asks for its second page once its first has landed, not both at
the start (h32 1.009-1.016x on an H100, h16 level; the same bits). Measured slower on an H100 and taken out
(bench/NOTES.md 169-178, bench/wip/fp8-f16-open-end-pairs-one-block.patch): a page's next page started under its
last products (open ends, 0.978-0.991x), two pages a loop iteration at 16 rows (0.986-1.000x), one K block a wgmma
group at 32 rows (0.962x).

A wide form for more rows (64 a CTA, each consumer 32 of them over every page, converting each page twice a
CTA) measured 0.74-0.80x the 64-row kernel on an H100 and was taken out (bench/NOTES.md 129,
bench/wip/fp8-f16-wide-form.patch).
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import dsl_user_op

from mlaserve.kernels.cutedsl.f16_query import load_q, store_q_f16
from mlaserve.kernels.cutedsl.fp8_pages import D_PE, D_QK, D_V, TILE_N, fp8_io_tensors
from mlaserve.kernels.cutedsl.fragment_ops import (
    cvt_pair, e4m3x4_to_f16, e4m3x4_to_f16_exact, ld_shared_v4, ldsm_x4, st_shared_words, v_fragment)
from mlaserve.kernels.cutedsl.keys_on_m import (
    col_slot, columns, exp_columns, mask_keys, publish_column_max, rescale_moved, take_column_max)
from mlaserve.kernels.cutedsl.boxed_pages import (
    BAR_RED, CONSUMER_THREADS, GROUPS, KV_BYTES, M_TILES, STAGES, THREADS, WARPS, first_pages, kernel_start,
    load_page, page_host_setup, wait_page)
from mlaserve.kernels.cutedsl.consumer_ends import one_consumer_end, split_consumer_end, stash_tensors, store_rows
from mlaserve.kernels.cutedsl.request_rows import first_masked_key, ordered_tensors, visible_keys

K_BLOCKS = D_V // 32  # ldmatrix .x4 blocks of K a page (two k-steps each)
CHUNK = 2             # K blocks converted a wgmma group (4 k-steps, 16 registers; two such buffers)
BAR_Q = 1             # both consumers: Q stored
BAR_P = 4             # + 2 c: consumer c's P^T complete (also: a last page's rows past the request zeroed)
VS_WORDS = GROUPS * 4 * 8  # the V scales' table a page: group, lane % 4, 8 f16x2 words
# traced launches (mla_decode.TRACE; unsplit, unordered), int32 per CTA in po's place: SM, start ns, start clock
# (thread 0); thread 0's clock once Q is stored; per consumer c (its thread 0) at 4 + c its first page's arrival, at
# 6 + c its loop's end, at 8 + c its end (stores issued); end ns (consumer 0); the CTA's pages; then for each of its
# first TRACE_PAGES pages t, at T_PAGES_AT + 2 t and + 1, the clocks of the page's arrival and of its products' end
TRACE_PAGES = 128
T_SM, T_NS0, T_C0, T_Q, T_PAGE0, T_LOOP, T_END, T_NS1, T_PAGES, T_PAGES_AT = 0, 1, 2, 3, 4, 6, 8, 10, 11, 12
TRACE_FIELDS = T_PAGES_AT + 2 * TRACE_PAGES
# Q_PERM[l]: the column of a 16-column k-step that logical column l of the K fragments holds
Q_PERM = tuple(4 * ((l % 8) // 2) + 2 * (l // 8) + l % 2 for l in range(16))


class MLADecodeFP8F16Sm90:
    """Compiled per (causal, split, n); q, out bf16. Launched by mla_decode.py through `__call__`, with the
    arguments of MLADecodeFP8SeesawSm90.__call__: s_q * h <= n (n 16 or 32)."""

    def __init__(self, causal: bool, is_split: bool, n: int = 32, ordered: bool = False, early_start: bool = False,
                 split_epilogue: bool = False, trace: bool = False, group_s: bool = False, stagger: bool = False):
        if n not in (16, 32):
            raise ValueError(f"the FP8 f16 kernel takes 16 or 32 query rows, got n={n}")
        if trace and (is_split or ordered):
            raise ValueError("the FP8 f16 kernel's trace is an option of unsplit launches in batch order")
        self.dtype = cutlass.BFloat16
        self.causal = causal
        self.is_split = is_split
        self.n = n
        self.ordered = ordered      # the grid's requests through an order (request_rows.ordered_tensors)
        # Q's global reads issued before the first pages' loads (which they otherwise queue behind), and, unsplit,
        # those pages' block-table entries read beside the request's length (mla_decode.FP8_EARLY_START)
        self.early_start = early_start
        # both consumers merge and store half of O^T each, instead of consumer 0 all of it while consumer 1 waits
        # (mla_decode.FP8_SPLIT_EPILOGUE)
        self.split_epilogue = split_epilogue
        # a diagnostic: each CTA's phase clocks in po's place (TRACE_FIELDS)
        self.trace = trace
        # S^T from the exact e4m3 values into one accumulator per scale group, the groups' scales applied to the
        # accumulators in fp32 (mla_decode.FP8_F16_GROUP_S), instead of each K value times its scale in f16
        self.group_s = group_s
        # each consumer's second page asked for once its first has landed, instead of both at the start, so that
        # the grid's first pages do not share the memory with its second ones (mla_decode.FP8_F16_STAGGER)
        self.stagger = stagger

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, kv_ptr: cute.Pointer, rope_ptr: cute.Pointer, bt_ptr: cute.Pointer,
                 seqlens_ptr: cute.Pointer, out_ptr: cute.Pointer, lse_ptr: cute.Pointer, po_ptr: cute.Pointer,
                 pl_ptr: cute.Pointer, batch: Int32, s_q: Int32, h: Int32, num_pages: Int32, max_pages: Int32,
                 num_splits: Int32, scale_log2: Float32, stream):
        n = self.n
        rows = s_q * h
        f8 = cutlass.Float8E4M3FN
        f16 = cutlass.Float16
        mQ = cute.make_tensor(q_ptr, cute.make_layout((rows, D_QK, batch), stride=(D_QK, 1, rows * D_QK)))
        (sK_layout, sPE_layout, sSc_layout), (tma_kv, mKV_tma, tma_sc, mSc_tma, tma_pe, mPE_tma) = page_host_setup(
            kv_ptr, rope_ptr, num_pages, STAGES)
        mBT, mSeqlens, mOut, mLse, mPO, mPL = fp8_io_tensors(bt_ptr, seqlens_ptr, out_ptr, lse_ptr, po_ptr, pl_ptr,
                                                             batch, rows, max_pages, num_splits)
        if const_expr(self.ordered):
            mLse, mPO = ordered_tensors(mLse, mPO, lse_ptr, po_ptr, batch, self.is_split)

        atom16 = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, self.dtype, D_PE), self.dtype)
        atomh = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, f16, D_V), f16)
        sPt_layout = cute.tile_to_shape(atomh, (n, TILE_N, 2), order=(0, 1, 2))
        sQ_layout = cute.tile_to_shape(atomh, (n, D_V), order=(0, 1))
        sQpe_layout = cute.tile_to_shape(atom16, (n, D_PE), order=(0, 1))

        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            f16, f16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32, (1, 1, 1), (64, n),
            a_source=warpgroup.OperandSource.RMEM)
        tiled_mma_pe = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            Float32, (1, 1, 1), (64, n))

        @cute.struct
        class SharedStorage:
            sK: cute.struct.Align[cute.struct.MemRange[f8, cute.cosize(sK_layout)], 1024]
            sPE: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sPE_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[f16, cute.cosize(sQ_layout)], 1024]
            sPt: cute.struct.Align[cute.struct.MemRange[f16, cute.cosize(sPt_layout)], 1024]
            sQpe: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQpe_layout)], 1024]
            sSc: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sSc_layout)], 128]
            vsc: cute.struct.Align[cute.struct.MemRange[Int32, 2 * 2 * VS_WORDS], 16]
            full: cute.struct.MemRange[cutlass.Int64, STAGES]
            inv2a: cute.struct.MemRange[Float32, n]
            red: cute.struct.MemRange[Float32, 2 * 2 * WARPS * n]

        self.shared_storage = SharedStorage
        self.kernel(mQ, tma_kv, mKV_tma, tma_sc, mSc_tma, tma_pe, mPE_tma, mBT, mSeqlens, mOut, mLse, mPO, mPL,
                    s_q, h, rows, num_splits, scale_log2, sK_layout, sPE_layout, sQ_layout, sPt_layout,
                    sQpe_layout, sSc_layout, tiled_mma_qk, tiled_mma_pe).launch(
            grid=(1, num_splits, batch), block=[THREADS, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, tma_kv: cute.CopyAtom, mKV_tma: cute.Tensor, tma_sc: cute.CopyAtom,
               mSc_tma: cute.Tensor, tma_pe: cute.CopyAtom, mPE_tma: cute.Tensor, mBT: cute.Tensor,
               mSeqlens: cute.Tensor, mOut: cute.Tensor, mLse: cute.Tensor, mPO: cute.Tensor, mPL: cute.Tensor,
               s_q: Int32, h: Int32, rows: Int32, num_splits: Int32, scale_log2: Float32,
               sK_layout: cute.ComposedLayout, sPE_layout: cute.ComposedLayout, sQ_layout: cute.ComposedLayout,
               sPt_layout: cute.ComposedLayout, sQpe_layout: cute.ComposedLayout, sSc_layout: cute.Layout,
               tiled_mma_qk: cute.TiledMma, tiled_mma_pe: cute.TiledMma):
        n = self.n
        tidx, split, batch, lane, c, ctid, warp, storage, full = kernel_start(
            self.shared_storage, mLse, mPO, self.ordered, self.is_split)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sPE = storage.sPE.get_tensor(sPE_layout.outer, swizzle=sPE_layout.inner)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sPt = storage.sPt.get_tensor(sPt_layout.outer, swizzle=sPt_layout.inner)
        sQpe = storage.sQpe.get_tensor(sQpe_layout.outer, swizzle=sQpe_layout.inner)
        sSc = storage.sSc.get_tensor(sSc_layout)
        sInv = storage.inv2a.get_tensor(cute.make_layout(n))
        sRed = storage.red.get_tensor(cute.make_layout((n, WARPS, 2, 2),
                                                       stride=(1, n, WARPS * n, 2 * WARPS * n)))
        k_base = storage.sK.data_ptr().toint()
        vs_base = storage.vsc.data_ptr().toint() + c * (2 * VS_WORDS * 4)
        trace_at = mPO.iterator.toint() + cutlass.Int64(batch) * (TRACE_FIELDS * 4)   # used only where traced
        if const_expr(self.trace):
            if tidx == 0:
                _stamp(trace_at, T_SM, cute.arch.smid())
                _stamp(trace_at, T_NS0, cute.arch.globaltimer_lo())
                _stamp(trace_at, T_C0, cute.arch.clock())

        # -- Q * 2^a in f16 (columns in Q_PERM's order) and Q_pe * 2^a in bf16 (f16_query.py), both consumers; its
        # reads go out first where early_start --
        if const_expr(self.early_start):
            q_words, q_pe = load_q(mQ.iterator.toint(), batch, rows, tidx, n)
        seqlen, start, n_tiles, first_page, (tKs, tKg, tSs, tSg, tPs, tPg) = first_pages(
            tma_kv, mKV_tma, tma_sc, mSc_tma, tma_pe, mPE_tma, sK, sSc, sPE, mBT, mSeqlens, batch, split, num_splits,
            c, warp, lane, full, bt_early=self.early_start and not self.is_split, loads=1 if self.stagger else 2)
        if const_expr(not self.early_start):
            q_words, q_pe = load_q(mQ.iterator.toint(), batch, rows, tidx, n)
        store_q_f16(q_words, q_pe, rows, tidx, n, storage.sQ.data_ptr().toint(), storage.sQpe.data_ptr().toint(),
                    sInv)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=BAR_Q, number_of_threads=THREADS)
        if const_expr(self.trace):
            if tidx == 0:
                _stamp(trace_at, T_Q, cute.arch.clock())
                _stamp(trace_at, T_PAGES, n_tiles)

        thr_qk = tiled_mma_qk.get_slice(ctid)
        thr_pe = tiled_mma_pe.get_slice(ctid)
        tSrQ = tiled_mma_qk.make_fragment_B(thr_qk.partition_B(sQ))                 # [.., 1, 32 k]
        tSrKpe = tiled_mma_pe.make_fragment_A(thr_pe.partition_A(sPE))             # [.., 1, 4 k, stages]
        tSrQpe = tiled_mma_pe.make_fragment_B(thr_pe.partition_B(sQpe))            # [.., 1, 4 k]
        tOrP = tiled_mma_qk.make_fragment_B(thr_qk.partition_B(sPt))                # [.., 1, 4 k, 2]
        acc_s = cute.make_rmem_tensor(thr_pe.partition_shape_C((TILE_N, n)), Float32)
        acc_o = [cute.make_rmem_tensor(thr_pe.partition_shape_C((64, n)), Float32) for _ in range(M_TILES)]
        for m in cutlass.range_constexpr(M_TILES):
            acc_o[m].fill(0.0)
        frag_k = [tiled_mma_qk.make_fragment_A(thr_qk.partition_shape_A((TILE_N, 32 * CHUNK))) for _ in range(2)]
        frag_v = [tiled_mma_qk.make_fragment_A(thr_qk.partition_shape_A((64, TILE_N))) for _ in range(2)]
        tOcO = thr_pe.partition_C(cute.make_identity_tensor((64, n)))

        q = lane // 4
        k0 = warp * 16 + q
        slots = n // 4
        cols = columns(lane, n)
        # P^T's pair stores: keys k0, k0 + 8 at logical K positions 16 w + p, + 1 (p = q, or q + 7 for odd q: the
        # V^T fragments' key order, module docstring) of row cols[s], 128-byte swizzle (16-byte chunk j of a
        # row at j ^ (row % 8))
        p_pos = q + 7 * (q % 2)
        p_addr = cute.make_rmem_tensor(slots, Int32)
        for s in cutlass.range_constexpr(slots):
            p_addr[s] = (storage.sPt.data_ptr().toint() + c * (n * TILE_N * 2) + (cols[s] // 8) * 1024
                         + (cols[s] % 8) * 128 + ((2 * warp + p_pos // 8) ^ (cols[s] % 8)) * 16 + (p_pos % 8) * 2)
        vis = cute.make_rmem_tensor(slots, Int32)
        col_m = cute.make_rmem_tensor(slots, Float32)
        m_prev = cute.make_rmem_tensor(slots, Float32)
        col_l = cute.make_rmem_tensor(slots, Float32)
        alpha = cute.make_rmem_tensor(slots, Float32)
        m_base = cute.make_rmem_tensor(slots, Float32)
        fac = cute.make_rmem_tensor(slots, Float32)
        ks = cute.make_rmem_tensor((2, GROUPS), Float32 if self.group_s else Int32)
        acc_g = None
        if const_expr(self.group_s):
            acc_g = [cute.make_rmem_tensor(thr_pe.partition_shape_C((TILE_N, n)), Float32) for _ in range(GROUPS)]
        for s in cutlass.range_constexpr(slots):
            vis[s] = visible_keys(seqlen, s_q, h, cols[s], self.causal)
            col_m[s] = -Float32.inf
            col_l[s] = 0.0
            m_base[s] = 0.0
            fac[s] = sInv[cols[s]] * scale_log2
        min_vis = first_masked_key(seqlen, s_q, self.causal)
        bar_red = BAR_RED + 2 * c
        bar_p = BAR_P + 2 * c
        # the ldmatrix rows of K: lane l reads key 16 w + l % 8 + 8 ((l // 8) % 2), its 16-byte chunk l // 16 of
        # each pair of the block
        k_key = warp * 16 + lane % 8 + 8 * ((lane // 8) % 2)
        k_row = k_key * 128
        k_half = lane // 16
        # the V scales' table: this thread builds word (g, c4, j) of its consumer's table a page, and reads the
        # 8 words of lane % 4 for a group
        vb_g = ctid // 32
        vb_c = (ctid // 8) % 4
        vb_j = ctid % 8
        vb_key = 32 * (vb_j // 4) + 16 * ((vb_j // 2) % 2) + 2 * vb_c + vb_j % 2

        next_page = Int32(0)
        if warp == 0 and c + STAGES < n_tiles:
            next_page = mBT[batch, first_page + c + STAGES]
        if const_expr(self.stagger):
            # the consumer's second page, once its first has landed (its stage's first phase)
            if warp == 0 and c + 2 < n_tiles:
                second = mBT[batch, first_page + c + 2]
                cute.arch.mbarrier_wait(full + c, 0)
                load_page(tma_kv, tKg, tKs, tma_sc, tSg, tSs, tma_pe, tPg, tPs, full, second, c + 2, lane)
        page_io = (full, k_base, start, seqlen, ctid, bar_p, trace_at, c)
        scale_io = (sSc, ks, k0, vb_key, vb_g, vb_c, vb_j, vs_base)
        ios = ((page_io, scale_io,
                (tma_kv, tKg, tKs, tma_sc, tSg, tSs, tma_pe, tPg, tPs, mBT, batch, first_page, n_tiles),
                (tiled_mma_pe, tiled_mma_qk, tSrKpe, tSrQpe, tSrQ, tOrP, acc_s, acc_o, acc_g, frag_k, frag_v),
                (vis, min_vis, col_m, m_prev, col_l, alpha, m_base, fac, cols, sRed, p_addr),
                (warp, lane, k0, k_key, k_row, k_half, bar_red, vs_base)))
        count = (n_tiles - c + 1) // 2     # this consumer's pages
        for u in cutlass.range(count, unroll=1):
            next_page = self._page(u, next_page, ios)

        if const_expr(self.trace):
            if ctid == 0:
                _stamp(trace_at, T_LOOP + c, cute.arch.clock())
        vals = cute.size(acc_o[0])
        if const_expr(self.split_epilogue):
            # -- each consumer merges, normalizes and stores half of O^T's dims (consumer c: tiles 4 c .. 4 c + 3) --
            out_io = (tOcO, cols, lane, warp, rows, batch, split, mOut, mLse, mPO, mPL)
            if c == 0:
                split_consumer_end(0, acc_o, col_m, col_l, ctid, storage, sRed, n_tiles, out_io, n, self.is_split)
            else:
                split_consumer_end(1, acc_o, col_m, col_l, ctid, storage, sRed, n_tiles, out_io, n, self.is_split)
        else:
            # -- consumer 1 leaves O^T in its stages 1 and 3, maxima and sums in its k_pe stage 1 --
            merge, merge_ml = stash_tensors(
                [cute.recast_ptr(storage.sK.data_ptr() + (1 + 2 * p) * KV_BYTES, dtype=Float32) for p in range(2)],
                cute.recast_ptr(storage.sPE.data_ptr() + TILE_N * D_PE, dtype=Float32), vals, slots,
                CONSUMER_THREADS)

            def store(inv_l, lse):
                store_rows(acc_o, inv_l, lse, tOcO, cols, lane, warp, rows, batch, split, mOut, mLse, mPO, mPL,
                           n, self.is_split)
            one_consumer_end(c, acc_o, col_m, col_l, ctid, merge, merge_ml, n_tiles, cols, lane, warp, sRed, n,
                             store)
        if const_expr(self.trace):
            if ctid == 0:
                _stamp(trace_at, T_END + c, cute.arch.clock())
                if c == 0:
                    _stamp(trace_at, T_NS1, cute.arch.globaltimer_lo())

    @cute.jit
    def _page(self, u: Int32, next_page: Int32, ios: tuple):
        """A consumer's u-th page, t = c + 2 u: its start (_start_page), S^T, its column maxima, P^T, O^T's rescale
        and its P V products, and the refill of its stage with page t + STAGES (whose block-table entry, next_page,
        warp 0 read a page before). Returns the entry of page t + 2 + STAGES, for the next page's refill."""
        page_io, scale_io, load_io, mma_io, soft_io, lane_io = ios
        full, k_base, start, seqlen, ctid, bar_p, trace_at, c = page_io
        ks = scale_io[1]
        tma_kv, tKg, tKs, tma_sc, tSg, tSs, tma_pe, tPg, tPs, mBT, batch, first_page, n_tiles = load_io
        tiled_mma_pe, tiled_mma_qk, tSrKpe, tSrQpe, tSrQ, tOrP, acc_s, acc_o, acc_g, frag_k, frag_v = mma_io
        vis, min_vis, col_m, m_prev, col_l, alpha, m_base, fac, cols, sRed, p_addr = soft_io
        warp, lane, k0, k_key, k_row, k_half, bar_red, vs_base = lane_io
        n = self.n
        slots = n // 4
        t = c + 2 * u
        later_page = Int32(0)
        if warp == 0 and t + 2 + STAGES < n_tiles:
            later_page = mBT[batch, first_page + t + 2 + STAGES]
        st, tok0, valid, stage_base = self._start_page(t, u, page_io, scale_io)
        vs_page = vs_base + (u % 2) * (VS_WORDS * 4)
        # -- S^T: k_pe (bf16, smem), then c_kv in groups of CHUNK ldmatrix blocks (f16, registers) --
        warpgroup.fence()
        atom_pe = cute.make_mma_atom(tiled_mma_pe.op)
        for k in cutlass.range_constexpr(cute.size(tSrKpe.shape[2])):
            atom_pe.set(warpgroup.Field.ACCUMULATE, k > 0)
            cute.gemm(atom_pe, acc_s, tSrKpe[None, None, k, st], tSrQpe[None, None, k], acc_s)
        warpgroup.commit_group()
        atom_qk = cute.make_mma_atom(tiled_mma_qk.op)
        atom_qk.set(warpgroup.Field.ACCUMULATE, True)
        for j in cutlass.range_constexpr(K_BLOCKS // CHUNK):
            buf = cute.recast_tensor(frag_k[j % 2], Int32)
            if const_expr(j >= 2):
                warpgroup.wait_group(1)     # group j - 2 (the last reader of this buffer) is done
            for b in cutlass.range_constexpr(CHUNK):
                blk = CHUNK * j + b
                chunk = 2 * (blk % 4) + k_half
                w = ldsm_x4(stage_base + (blk // 4) * (TILE_N * 128) + k_row + ((chunk ^ (k_key % 8)) * 16))
                g = blk // 4
                for st2 in cutlass.range_constexpr(2):
                    if const_expr(self.group_s):
                        lo0, hi0 = e4m3x4_to_f16_exact(w[2 * st2])
                        lo1, hi1 = e4m3x4_to_f16_exact(w[2 * st2 + 1])
                    else:
                        lo0, hi0 = e4m3x4_to_f16(w[2 * st2], ks[0, g], ks[0, g])
                        lo1, hi1 = e4m3x4_to_f16(w[2 * st2 + 1], ks[1, g], ks[1, g])
                    kk = 2 * b + st2
                    buf[4 * kk + 0] = lo0
                    buf[4 * kk + 1] = lo1
                    buf[4 * kk + 2] = hi0
                    buf[4 * kk + 3] = hi1
            warpgroup.fence()
            for kk in cutlass.range_constexpr(2 * CHUNK):
                if const_expr(self.group_s):
                    # group (CHUNK * j) // 4's accumulator, started by its first k-step
                    grp = (CHUNK * j) // 4
                    atom_g = cute.make_mma_atom(tiled_mma_qk.op)
                    atom_g.set(warpgroup.Field.ACCUMULATE, not ((CHUNK * j) % 4 == 0 and kk == 0))
                    cute.gemm(atom_g, acc_g[grp], frag_k[j % 2][None, None, kk],
                              tSrQ[None, None, 2 * CHUNK * j + kk], acc_g[grp])
                else:
                    cute.gemm(atom_qk, acc_s, frag_k[j % 2][None, None, kk],
                              tSrQ[None, None, 2 * CHUNK * j + kk], acc_s)
            warpgroup.commit_group()
        warpgroup.wait_group(0)
        if const_expr(self.group_s):
            # S^T = k_pe's product + sum over groups of the group's product times its keys' scales (value i
            # of the fragment: key k0 + 8 ((i // 2) % 2))
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                v = acc_s[i]
                for g in cutlass.range_constexpr(GROUPS):
                    v = v + acc_g[g][i] * ks[(i // 2) % 2, g]
                acc_s[i] = v * fac[col_slot(i, n)]
        else:
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                acc_s[i] = acc_s[i] * fac[col_slot(i, n)]
        mask_keys(acc_s, tok0, k0, vis, min_vis, n)
        # -- column maxima: own rows, the warp, then the 4 warps --
        publish_column_max(acc_s, cols, lane, warp, sRed, (u % 2, c))
        cute.arch.barrier(barrier_id=bar_red, number_of_threads=CONSUMER_THREADS)
        for s in cutlass.range_constexpr(slots):
            m_prev[s] = col_m[s]
        take_column_max(col_m, col_l, alpha, m_base, cols, sRed, (u % 2, c))
        exp_columns(acc_s, m_base, col_l, n)
        # -- P^T in f16: keys k0, k0 + 8 of a column as one pair --
        for s in cutlass.range_constexpr(slots):
            i = 4 * (s // 2) + s % 2          # value i: key k0 of column cols[s]; i + 2: key k0 + 8
            st_shared_words(p_addr[s], [cvt_pair(acc_s[i], acc_s[i + 2])])
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=bar_p, number_of_threads=CONSUMER_THREADS)
        # -- O^T = alpha O^T + sum_m V^T_m P^T (rescaled only where a column's max moved) --
        rescale_moved(acc_o, col_m, m_prev, alpha, n)
        vsw = cute.make_rmem_tensor(8, Int32)
        for m in cutlass.range_constexpr(M_TILES):
            if const_expr(m % 2 == 0):
                vs_row = vs_page + ((m // 2) * 4 + lane % 4) * 32
                for e in cutlass.range_constexpr(2):
                    wv = ld_shared_v4(vs_row + 16 * e)
                    for x in cutlass.range_constexpr(4):
                        vsw[4 * e + x] = wv[x]
            raw = cute.make_rmem_tensor(8, Int32)
            v_fragment(raw, stage_base, warp, lane, m)
            vbuf = cute.recast_tensor(frag_v[m % 2], Int32)
            if const_expr(m >= 2):
                warpgroup.wait_group(1)     # tile m - 2's product (the last reader of this buffer) is done
            for k in cutlass.range_constexpr(TILE_N // 32):
                for hf in cutlass.range_constexpr(2):
                    # the e4m3 words of keys 32 k + 16 hf + (2c, 2c + 8, 2c + 1, 2c + 9), rows r and r + 8
                    lo0, hi0 = e4m3x4_to_f16(raw[4 * k + 2 * hf], vsw[4 * k + 2 * hf], vsw[4 * k + 2 * hf + 1])
                    lo1, hi1 = e4m3x4_to_f16(raw[4 * k + 2 * hf + 1], vsw[4 * k + 2 * hf],
                                              vsw[4 * k + 2 * hf + 1])
                    kk = 2 * k + hf
                    vbuf[4 * kk + 0] = lo0
                    vbuf[4 * kk + 1] = lo1
                    vbuf[4 * kk + 2] = hi0
                    vbuf[4 * kk + 3] = hi1
            if const_expr(m == M_TILES - 1):
                # the stage's last ldmatrix is done: refill it with page t + 4 before the last products
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=bar_red, number_of_threads=CONSUMER_THREADS)
                if warp == 0 and t + STAGES < n_tiles:
                    load_page(tma_kv, tKg, tKs, tma_sc, tSg, tSs, tma_pe, tPg, tPs, full, next_page, st, lane)
            warpgroup.fence()
            for kk in cutlass.range_constexpr(TILE_N // 16):
                cute.gemm(atom_qk, acc_o[m], frag_v[m % 2][None, None, kk], tOrP[None, None, kk, c], acc_o[m])
            warpgroup.commit_group()
        warpgroup.wait_group(0)
        self._stamp_end(trace_at, ctid, t)
        return later_page

    @cute.jit
    def _start_page(self, t: Int32, u: Int32, page_io: tuple, scale_io: tuple):
        """A consumer's start of page t, its u-th: the wait for it (wait_page), its arrival's clock where traced,
        and its scales (_page_scales) -> (stage, first token, the request's tokens from it, stage base)."""
        full, k_base, start, seqlen, ctid, bar_p, trace_at, c = page_io
        st, tok0, valid, stage_base = wait_page(full, t, k_base, start, seqlen, ctid, bar_p)
        if const_expr(self.trace):
            if ctid == 0:
                now = cute.arch.clock()
                if t == c:
                    _stamp(trace_at, T_PAGE0 + c, now)
                if t < TRACE_PAGES:
                    _stamp(trace_at, T_PAGES_AT + 2 * t, now)
        _page_scales(st, valid, u, scale_io, self.group_s)
        return st, tok0, valid, stage_base

    @cute.jit
    def _stamp_end(self, trace_at: cutlass.Int64, ctid: Int32, t: Int32):
        """A traced launch's clock of page t's products' end."""
        if const_expr(self.trace):
            if ctid == 0 and t < TRACE_PAGES:
                _stamp(trace_at, T_PAGES_AT + 2 * t + 1, cute.arch.clock())


@dsl_user_op
def _stamp(base: cutlass.Int64, field, value: Int32, *, loc=None, ip=None) -> None:
    """A traced launch's int32 `field` (an int, or Int32) of the CTA whose fields start at global address `base`."""
    addr = cutlass.Int64(base + field * 4).ir_value(loc=loc, ip=ip)
    llvm.inline_asm(None, [addr, Int32(value).ir_value(loc=loc, ip=ip)], "st.global.b32 [$0], $1;", "l,r",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@cute.jit
def _page_scales(st: Int32, valid: Int32, u: Int32, scale_io: tuple, group_s: cutlass.Constexpr[bool]):
    """A landed page's scales (stage st, `valid` of its rows the request's): K's rows k0, k0 + 8 into ks (fp32 where
    group_s, else f16x2 pairs; rows past the request zero), and this thread's word of the page's V-scale table
    (parity u % 2; its consumer reads it after BAR_RED)."""
    sSc, ks, k0, vb_key, vb_g, vb_c, vb_j, vs_base = scale_io
    for hr in cutlass.range_constexpr(2):
        keep = k0 + 8 * hr < valid
        for g in cutlass.range_constexpr(GROUPS):
            v = sSc[k0 + 8 * hr, g, st]
            if not keep:
                v = Float32(0.0)
            if const_expr(group_s):
                ks[hr, g] = v
            else:
                ks[hr, g] = cvt_pair(v, v)
    sa = sSc[vb_key, vb_g, st]
    sb = sSc[vb_key + 8, vb_g, st]
    if vb_key >= valid:
        sa = Float32(0.0)
    if vb_key + 8 >= valid:
        sb = Float32(0.0)
    vs_page = vs_base + (u % 2) * (VS_WORDS * 4)
    st_shared_words(vs_page + ((vb_g * 4 + vb_c) * 8 + vb_j) * 4, [cvt_pair(sa, sb)])
