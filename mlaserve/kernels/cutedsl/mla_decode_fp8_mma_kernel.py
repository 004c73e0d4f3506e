"""The Hopper (sm_90a) MLA decode over the FP8 656-byte KV format for requests of at most 16 query rows
(h 16 / h 8 with s_q 1, h 8 with s_q 2), keys on wgmma's M side, with FP8 tensor-core MMAs on the pages' e4m3
bytes as they arrive: nothing is converted to bf16 (bench/NOTES.md 68).

    S^T [64 keys, 16] = sum_g s_g(key) * (K_g Qh_g^T + K_g Ql_g^T) 2^-a + K_pe Q_pe^T
        K_g [64, 128]: scale group g's e4m3 box, TMA'd in the 128-byte swizzle (wgmma's A from smem, K-major);
        Q * 2^a (a per query row: its largest |q| lands in [128, 256)) = Qh + Ql, both e4m3, stacked on N: one
        m64n32k32 FP8 MMA reads K_g once for both; four group accumulators, the scales applied in fp32.
    O^T [512, 16] += V^T_m (P_g)^T per 64-dim tile m (g = m // 2)
        V^T_m [64 dims, 64 keys] as FP8 register A: ldmatrix .trans of the same boxes, one prmt per register;
        P_g = P * s_g(key) * 256 / max_page(s_g) = Ph + Pl in e4m3 on N (the page maximum rides on the column-max
        exchange), each tile's product in a fresh accumulator folded into O^T in fp32.

Values: entries are e4m3 * scale exactly (not the bf16 nearest them; fp8_format's docstring), Q and P carried
to ~2^-8 by their hi + lo parts (e4m3 hi holds 4 significant bits, lo 4 more), as triton's FP8-MMA kernel.

Warp roles (256 threads): two consumer warpgroups on alternate pages (consumer c: pages t = c mod 2 in raw
stages c and c + 2 of 4, which it refills itself), each with its own O^T, maxima and sums, merged at the end
through consumer 1's stages. A stage holds a page's four e4m3 boxes (32 KB), its scales [64, 4] fp32 and k_pe.
Both consumers build Q's hi/lo parts at the start (18 KB of Q from global memory).

Measured on the H200 (bench/NOTES.md 69; decode_ab against the bf16-tile kernel, 10 rounds): b128 h16 s_k
4k/8k/32k 118.3/212.4/765.1 us against 120.1/224.9/848.2 (1.01/1.06/1.11x; FP8 at 1.33x / 1.41x the bf16
kernel's 282.5 / 1076.1 us at 8k / 32k), s_q2 h8 8k 1.06x, b16 h16 32k 1.04x; b1 h16 32k 0.81x (4-page splits:
Q's parts and the ring's fill are paid per split), hence mla_decode.CONFIG.fp8_mma_min_pages (48 since NOTES
72). Nsight Compute at b128 h16 8k: 82 M instructions a call (the tile kernel 86 M), 476 k shared bank conflicts
(2067 k). Then (NOTES 71) P's parts through f16x2 and stored as 2-byte key pairs, and O^T's rescale skipped where
no maximum moved: ~13% fewer instructions a page, b128 h16 s_k 8k / 32k 200 / 702 us against 210 / 759 (1.05x /
1.08x). Then (NOTES 75) Q read and O stored in wide pieces (mla_decode.FP8_MMA_VEC_IO) and each stage refilled
right after its last V^T read (FP8_MMA_EARLY_REFILL): 1.003-1.02x and 1.001-1.006x.

A thread (lane = 4 q + c of warp w) holds S^T rows (keys) r = 16 w + q and r + 8. V^T's fragments put dims
2q, 2q + 1 of each 16-dim chunk on its rows r, r + 8 (the order boxed_pages.v_dim undoes) and, within each
16 keys, keys 2c, 2c + 8, 2c + 1, 2c + 9 on its K columns 4c .. 4c + 3, so that key j and j + 8 (j < 8) sit at
columns 2j, 2j + 1: P^T is stored in that key order, a thread's two keys of a column as one 2-byte pair.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import dsl_user_op

from mlaserve.kernels.cutedsl.boxed_pages import (
    BAR_RED, CONSUMER_THREADS, GROUPS, KV_BYTES, M_TILES, STAGES, THREADS, WARPS, first_pages, kernel_start,
    load_page, page_host_setup, v_dim, wait_page)
from mlaserve.kernels.cutedsl.consumer_ends import one_consumer_end, stash_tensors, store_rows
from mlaserve.kernels.cutedsl.fp8_pages import D_PE, D_QK, D_V, TILE_N, fp8_io_tensors
from mlaserve.kernels.cutedsl.fragment_ops import (
    bf16x2_to_f32, ld_global_v4_b32, pow2_scale, prmt, st_shared_words, v_fragment)
from mlaserve.kernels.cutedsl.keys_on_m import (
    col_slot, columns, exp_columns, mask_keys, rescale_moved, store_lse, take_column_max)
from mlaserve.kernels.cutedsl.request_rows import first_masked_key, ordered_tensors, visible_keys

N = 16                # query rows a CTA
NH = 2 * N            # hi and lo parts on wgmma's N
BAR_Q = 1             # both consumers: Q's parts stored
# boxed_pages.BAR_RED + 2 c: consumer c's 4 warps: column and scale maxima (then sums); a page's stage read
BAR_P = 4             # + 2 c: consumer c's P^T complete (also: a last page's rows past the request zeroed)
P_RANGE = 256.0
RED_SLOTS = N + GROUPS  # per warp and parity: the column maxima, then the scale groups' maxima


class MLADecodeFP8MmaSm90:
    """Compiled per (causal, split); q, out bf16. Launched by mla_decode.py through `__call__`, with the arguments
    of MLADecodeFP8SeesawSm90.__call__ (s_q * h <= 16)."""

    def __init__(self, causal: bool, is_split: bool, bt_ahead: bool = True, vec_io: bool = True,
                 early_refill: bool = False, ordered: bool = False):
        self.dtype = cutlass.BFloat16
        self.causal = causal
        self.is_split = is_split
        self.bt_ahead = bt_ahead
        self.vec_io = vec_io
        self.early_refill = early_refill
        self.ordered = ordered      # the grid's requests through an order (request_rows.ordered_tensors)

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, kv_ptr: cute.Pointer, rope_ptr: cute.Pointer, bt_ptr: cute.Pointer,
                 seqlens_ptr: cute.Pointer, out_ptr: cute.Pointer, lse_ptr: cute.Pointer, po_ptr: cute.Pointer,
                 pl_ptr: cute.Pointer, batch: Int32, s_q: Int32, h: Int32, num_pages: Int32, max_pages: Int32,
                 num_splits: Int32, scale_log2: Float32, stream):
        rows = s_q * h
        f8 = cutlass.Float8E4M3FN
        mQ = cute.make_tensor(q_ptr, cute.make_layout((rows, D_QK, batch), stride=(D_QK, 1, rows * D_QK)))
        (sK_layout, sPE_layout, sSc_layout), (tma_kv, mKV_tma, tma_sc, mSc_tma, tma_pe, mPE_tma) = page_host_setup(
            kv_ptr, rope_ptr, num_pages, STAGES)
        mBT, mSeqlens, mOut, mLse, mPO, mPL = fp8_io_tensors(bt_ptr, seqlens_ptr, out_ptr, lse_ptr, po_ptr, pl_ptr,
                                                             batch, rows, max_pages, num_splits)
        if const_expr(self.ordered):
            mLse, mPO = ordered_tensors(mLse, mPO, lse_ptr, po_ptr, batch, self.is_split)

        atom8 = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, f8, D_V), f8)
        atom16 = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, self.dtype, D_PE), self.dtype)
        sQ8_layout = cute.tile_to_shape(atom8, (NH, D_V), order=(0, 1))
        atom8p = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, f8, TILE_N), f8)
        sPt_layout = cute.tile_to_shape(atom8p, (NH, TILE_N, 2 * GROUPS), order=(0, 1, 2))
        sQpe_layout = cute.tile_to_shape(atom16, (N, D_PE), order=(0, 1))

        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            f8, f8, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32, (1, 1, 1), (64, NH))
        tiled_mma_pe = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            Float32, (1, 1, 1), (64, N))
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            f8, f8, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32, (1, 1, 1), (64, NH),
            a_source=warpgroup.OperandSource.RMEM)

        @cute.struct
        class SharedStorage:
            sK: cute.struct.Align[cute.struct.MemRange[f8, cute.cosize(sK_layout)], 1024]
            sPE: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sPE_layout)], 1024]
            sQ8: cute.struct.Align[cute.struct.MemRange[f8, cute.cosize(sQ8_layout)], 1024]
            sPt: cute.struct.Align[cute.struct.MemRange[f8, cute.cosize(sPt_layout)], 1024]
            sQpe: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQpe_layout)], 1024]
            sSc: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sSc_layout)], 128]
            full: cute.struct.MemRange[cutlass.Int64, STAGES]
            inv2a: cute.struct.MemRange[Float32, N]
            red: cute.struct.MemRange[Float32, 2 * 2 * WARPS * RED_SLOTS]

        self.shared_storage = SharedStorage
        self.kernel(mQ, tma_kv, mKV_tma, tma_sc, mSc_tma, tma_pe, mPE_tma, mBT, mSeqlens, mOut, mLse, mPO, mPL,
                    s_q, h, rows, num_splits, scale_log2, sK_layout, sPE_layout, sQ8_layout, sPt_layout,
                    sQpe_layout, sSc_layout, tiled_mma_qk, tiled_mma_pe, tiled_mma_pv).launch(
            grid=(1, num_splits, batch), block=[THREADS, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, tma_kv: cute.CopyAtom, mKV_tma: cute.Tensor, tma_sc: cute.CopyAtom,
               mSc_tma: cute.Tensor, tma_pe: cute.CopyAtom, mPE_tma: cute.Tensor, mBT: cute.Tensor,
               mSeqlens: cute.Tensor, mOut: cute.Tensor, mLse: cute.Tensor, mPO: cute.Tensor, mPL: cute.Tensor,
               s_q: Int32, h: Int32, rows: Int32, num_splits: Int32, scale_log2: Float32,
               sK_layout: cute.ComposedLayout, sPE_layout: cute.ComposedLayout, sQ8_layout: cute.ComposedLayout,
               sPt_layout: cute.ComposedLayout, sQpe_layout: cute.ComposedLayout, sSc_layout: cute.Layout,
               tiled_mma_qk: cute.TiledMma, tiled_mma_pe: cute.TiledMma, tiled_mma_pv: cute.TiledMma):
        tidx, split, batch, lane, c, ctid, warp, storage, full = kernel_start(
            self.shared_storage, mLse, mPO, self.ordered, self.is_split)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sPE = storage.sPE.get_tensor(sPE_layout.outer, swizzle=sPE_layout.inner)
        sQ8 = storage.sQ8.get_tensor(sQ8_layout.outer, swizzle=sQ8_layout.inner)
        sPt = storage.sPt.get_tensor(sPt_layout.outer, swizzle=sPt_layout.inner)
        sQpe = storage.sQpe.get_tensor(sQpe_layout.outer, swizzle=sQpe_layout.inner)
        sSc = storage.sSc.get_tensor(sSc_layout)
        sInv = storage.inv2a.get_tensor(cute.make_layout(N))
        sRed = storage.red.get_tensor(cute.make_layout((RED_SLOTS, WARPS, 2, 2),
                                                       stride=(1, RED_SLOTS, WARPS * RED_SLOTS, 2 * WARPS * RED_SLOTS)))
        k_base = storage.sK.data_ptr().toint()

        seqlen, start, n_tiles, first_page, (tKs, tKg, tSs, tSg, tPs, tPg) = first_pages(
            tma_kv, mKV_tma, tma_sc, mSc_tma, tma_pe, mPE_tma, sK, sSc, sPE, mBT, mSeqlens, batch, split, num_splits,
            c, warp, lane, full)

        # -- Q's parts, both consumers: 16 threads a row --
        if const_expr(self.vec_io):
            _store_q_parts_16b(mQ.iterator.toint(), batch, rows, tidx, storage.sQ8.data_ptr().toint(),
                               storage.sQpe.data_ptr().toint(), sInv)
        else:
            _store_q_parts(mQ, batch, rows, tidx, _u8_view(sQ8, sQ8_layout.inner), sQpe, sInv)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=BAR_Q, number_of_threads=THREADS)

        thr_qk = tiled_mma_qk.get_slice(ctid)
        thr_pe = tiled_mma_pe.get_slice(ctid)
        thr_pv = tiled_mma_pv.get_slice(ctid)
        tSrK = tiled_mma_qk.make_fragment_A(thr_qk.partition_A(sK))                 # [.., 1, 16 k, stages]
        tSrQ = tiled_mma_qk.make_fragment_B(thr_qk.partition_B(sQ8))                # [.., 1, 16 k]
        tSrKpe = tiled_mma_pe.make_fragment_A(thr_pe.partition_A(sPE))
        tSrQpe = tiled_mma_pe.make_fragment_B(thr_pe.partition_B(sQpe))
        tOrP = tiled_mma_pv.make_fragment_B(thr_pv.partition_B(sPt))                # [.., 1, 2 k, 8 buffers]
        acc_g = [cute.make_rmem_tensor(thr_qk.partition_shape_C((TILE_N, NH)), Float32) for _ in range(GROUPS)]
        acc_s = cute.make_rmem_tensor(thr_pe.partition_shape_C((TILE_N, N)), Float32)
        acc_t = [cute.make_rmem_tensor(thr_pv.partition_shape_C((64, NH)), Float32) for _ in range(2)]
        acc_o = [cute.make_rmem_tensor(thr_pe.partition_shape_C((64, N)), Float32) for _ in range(M_TILES)]
        for m in cutlass.range_constexpr(M_TILES):
            acc_o[m].fill(0.0)
        frag_v = [tiled_mma_pv.make_fragment_A(thr_pv.partition_shape_A((64, TILE_N))) for _ in range(2)]
        tOcO = thr_pe.partition_C(cute.make_identity_tensor((64, N)))

        k0 = warp * 16 + lane // 4
        slots = N // 4
        cols = columns(lane, N)
        # P^T's pair stores: this thread's keys k0, k0 + 8 sit at K columns 16 w + 2 q, + 1 (module docstring) of
        # rows n = cols[s] (hi) and 16 + n (lo) of consumer c's [32, 64] buffers, in the 64-byte swizzle (16-byte
        # chunk j of row n at j ^ ((n // 2) % 4))
        p_addr = cute.make_rmem_tensor(slots, Int32)
        for s in cutlass.range_constexpr(slots):
            p_addr[s] = (storage.sPt.data_ptr().toint() + GROUPS * c * (NH * TILE_N) + cols[s] * TILE_N
                         + 16 * (warp ^ ((cols[s] // 2) % 4)) + 2 * (lane // 4))
        vis = cute.make_rmem_tensor(slots, Int32)
        col_m = cute.make_rmem_tensor(slots, Float32)
        m_prev = cute.make_rmem_tensor(slots, Float32)
        col_l = cute.make_rmem_tensor(slots, Float32)
        alpha = cute.make_rmem_tensor(slots, Float32)
        m_base = cute.make_rmem_tensor(slots, Float32)
        inv2a = cute.make_rmem_tensor(slots, Float32)
        sc = cute.make_rmem_tensor((2, GROUPS), Float32)
        smax = cute.make_rmem_tensor(GROUPS, Float32)
        for s in cutlass.range_constexpr(slots):
            vis[s] = visible_keys(seqlen, s_q, h, cols[s], self.causal)
            col_m[s] = -Float32.inf
            col_l[s] = 0.0
            inv2a[s] = sInv[cols[s]]
        min_vis = first_masked_key(seqlen, s_q, self.causal)
        bar_red = BAR_RED + 2 * c
        bar_p = BAR_P + 2 * c

        # the block table's entries for the refills, read a page ahead of their use: a read at the refill would
        # hold warp 0, and with it the warpgroup's next wgmma, for a global load's latency every page
        next_page = Int32(0)
        if const_expr(self.bt_ahead):
            if warp == 0 and c + STAGES < n_tiles:
                next_page = mBT[batch, first_page + c + STAGES]
        for u in cutlass.range((n_tiles - c + 1) // 2, unroll=1):
            t = c + 2 * u
            later_page = Int32(0)
            if const_expr(self.bt_ahead):
                if warp == 0 and t + 2 + STAGES < n_tiles:
                    later_page = mBT[batch, first_page + t + 2 + STAGES]
            st, tok0, valid, stage_base = wait_page(full, t, k_base, start, seqlen, ctid, bar_p)
            for hr in cutlass.range_constexpr(2):
                keep = k0 + 8 * hr < valid
                for g in cutlass.range_constexpr(GROUPS):
                    v = sSc[k0 + 8 * hr, g, st]
                    sc[hr, g] = 0.0
                    if keep:
                        sc[hr, g] = v
            # -- S^T: four FP8 groups (K_g from the stage, Q's hi | lo on N), k_pe in bf16 --
            warpgroup.fence()
            atom = cute.make_mma_atom(tiled_mma_qk.op)
            for g in cutlass.range_constexpr(GROUPS):
                for k in cutlass.range_constexpr(4):
                    atom.set(warpgroup.Field.ACCUMULATE, k > 0)
                    cute.gemm(atom, acc_g[g], tSrK[None, None, 4 * g + k, st], tSrQ[None, None, 4 * g + k], acc_g[g])
            atom_pe = cute.make_mma_atom(tiled_mma_pe.op)
            for k in cutlass.range_constexpr(cute.size(tSrKpe.shape[2])):
                atom_pe.set(warpgroup.Field.ACCUMULATE, k > 0)
                cute.gemm(atom_pe, acc_s, tSrKpe[None, None, k, st], tSrQpe[None, None, k], acc_s)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            half = cute.size(acc_s)
            for i in cutlass.range_constexpr(half):
                hr = (i // 2) % 2
                s_val = Float32(0.0)
                for g in cutlass.range_constexpr(GROUPS):
                    s_val = s_val + (acc_g[g][i] + acc_g[g][i + half]) * sc[hr, g]
                acc_s[i] = (s_val * inv2a[col_slot(i, N)] + acc_s[i]) * scale_log2
            mask_keys(acc_s, tok0, k0, vis, min_vis, N)
            # -- column maxima and the scale groups' page maxima: own rows, the warp, then the 4 warps --
            # (keys_on_m.publish_column_max's loop, written out: through the helper ptxas schedules the scale
            # maxima's shuffles below differently)
            mx = cute.make_rmem_tensor(slots, Float32)
            for s in cutlass.range_constexpr(slots):
                i0 = 4 * (s // 2) + s % 2
                mx[s] = cute.arch.fmax(acc_s[i0], acc_s[i0 + 2])
                for off in (4, 8, 16):
                    mx[s] = cute.arch.fmax(mx[s], cute.arch.shuffle_sync_bfly(mx[s], offset=off))
                if lane < 4:
                    sRed[cols[s], warp, u % 2, c] = mx[s]
            for g in cutlass.range_constexpr(GROUPS):
                smax[g] = cute.arch.fmax(sc[0, g], sc[1, g])
                for off in (4, 8, 16):
                    smax[g] = cute.arch.fmax(smax[g], cute.arch.shuffle_sync_bfly(smax[g], offset=off))
                if lane == 0:
                    sRed[N + g, warp, u % 2, c] = smax[g]
            cute.arch.barrier(barrier_id=bar_red, number_of_threads=CONSUMER_THREADS)
            for s in cutlass.range_constexpr(slots):
                m_prev[s] = col_m[s]
            take_column_max(col_m, col_l, alpha, m_base, cols, sRed, (u % 2, c))
            for g in cutlass.range_constexpr(GROUPS):
                m_g = sRed[N + g, 0, u % 2, c]
                for w in cutlass.range_constexpr(1, WARPS):
                    m_g = cute.arch.fmax(m_g, sRed[N + g, w, u % 2, c])
                smax[g] = cute.arch.fmax(m_g, Float32(1e-30))
            exp_columns(acc_s, m_base, col_l, N)
            # -- P_g = P s_g(key) 256 / max_page(s_g), hi | lo on N, into consumer c's buffer g: keys k0, k0 + 8
            # of a column as one e4m3 pair (a 2-byte store each for hi and lo) --
            for g in cutlass.range_constexpr(GROUPS):
                f = P_RANGE * cute.arch.rcp_approx(smax[g])
                for s in cutlass.range_constexpr(slots):
                    i = 4 * (s // 2) + s % 2          # value i: key k0 of column cols[s]; i + 2: key k0 + 8
                    hl = _e4m3_parts(acc_s[i] * (sc[0, g] * f), acc_s[i + 2] * (sc[1, g] * f))
                    addr = p_addr[s] + g * (NH * TILE_N)
                    _st_shared_u16(addr, hl)
                    _st_shared_u16(addr + N * TILE_N, hl >> 16)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=bar_p, number_of_threads=CONSUMER_THREADS)
            # -- O^T = alpha O^T + sum_m V^T_m P_g^T, each tile's product folded in fp32 (O^T rescaled only
            # where a column's max moved) --
            rescale_moved(acc_o, col_m, m_prev, alpha, N)
            atom_pv = cute.make_mma_atom(tiled_mma_pv.op)
            for m in cutlass.range_constexpr(M_TILES + 1):
                if const_expr(m < M_TILES):
                    buf = frag_v[m % 2]
                    v_fragment(cute.recast_tensor(buf, Int32), stage_base, warp, lane, m)
                    warpgroup.fence()
                    for k in cutlass.range_constexpr(TILE_N // 32):
                        atom_pv.set(warpgroup.Field.ACCUMULATE, k > 0)
                        cute.gemm(atom_pv, acc_t[m % 2], buf[None, None, k],
                                  tOrP[None, None, k, GROUPS * c + m // 2], acc_t[m % 2])
                    warpgroup.commit_group()
                    if const_expr(self.early_refill and m == M_TILES - 1):
                        # the stage's last ldmatrix is done: refill it now, before the last two tiles' folds
                        cute.arch.fence_proxy("async.shared", space="cta")
                        cute.arch.barrier(barrier_id=bar_red, number_of_threads=CONSUMER_THREADS)
                        if warp == 0 and t + STAGES < n_tiles:
                            if const_expr(not self.bt_ahead):
                                next_page = mBT[batch, first_page + t + STAGES]
                            load_page(tma_kv, tKg, tKs, tma_sc, tSg, tSs, tma_pe, tPg, tPs, full, next_page, st,
                                      lane)
                if const_expr(m > 0):
                    # tile m - 1's product is complete once at most one group (tile m's) is pending
                    if const_expr(m < M_TILES):
                        warpgroup.wait_group(1)
                    else:
                        warpgroup.wait_group(0)
                    f = smax[(m - 1) // 2] * (1.0 / P_RANGE)
                    tt = acc_t[(m - 1) % 2]
                    for i in cutlass.range_constexpr(cute.size(acc_o[m - 1])):
                        acc_o[m - 1][i] = acc_o[m - 1][i] + (tt[i] + tt[i + half]) * f
            if const_expr(not self.early_refill):
                # the stage's generic reads (ldmatrix) before its next TMA; warp 0 refills it with page t + 4
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=bar_red, number_of_threads=CONSUMER_THREADS)
                if warp == 0 and t + STAGES < n_tiles:
                    if const_expr(not self.bt_ahead):
                        next_page = mBT[batch, first_page + t + STAGES]
                    load_page(tma_kv, tKg, tKs, tma_sc, tSg, tSs, tma_pe, tPg, tPs, full, next_page, st, lane)
            next_page = later_page

        # -- consumer 1 leaves O^T in its stage 1, maxima and sums in its stage 3 (no page lands there any more) --
        vals = cute.size(acc_o[0])
        merge, merge_ml = stash_tensors([cute.recast_ptr(storage.sK.data_ptr() + KV_BYTES, dtype=Float32)],
                                        cute.recast_ptr(storage.sK.data_ptr() + 3 * KV_BYTES, dtype=Float32),
                                        vals, slots, CONSUMER_THREADS)

        def store(inv_l, lse):
            if self.vec_io:
                store_rows(acc_o, inv_l, lse, tOcO, cols, lane, warp, rows, batch, split, mOut, mLse, mPO, mPL,
                           N, self.is_split)
            else:
                _store_values(acc_o, inv_l, tOcO, rows, batch, split, mOut, mPO, self.dtype, self.is_split)
                store_lse(lse, cols, lane, warp, rows, mLse, mPL, batch, split, self.is_split)
        one_consumer_end(c, acc_o, col_m, col_l, ctid, merge, merge_ml, n_tiles, cols, lane, warp, sRed, N, store)


@cute.jit
def _store_values(acc_o: list, inv_l: cute.Tensor, tOcO: cute.Tensor, rows: Int32, batch: Int32, split: Int32,
                  mOut: cute.Tensor, mPO: cute.Tensor, dtype: cutlass.Constexpr, is_split: cutlass.Constexpr[bool]):
    """O^T normalized into the request's rows value by value (FP8_MMA_VEC_IO off): bf16 out, or the split's fp32
    partials."""
    for m in cutlass.range_constexpr(M_TILES):
        for i in cutlass.range_constexpr(cute.size(acc_o[m])):
            r = tOcO[i][1]
            d = 64 * m + v_dim(tOcO[i][0])
            if r < rows:
                val = acc_o[m][i] * inv_l[col_slot(i, N)]
                if const_expr(is_split):
                    mPO[batch, split, r, d] = val
                else:
                    mOut[batch, r, d] = val.to(dtype)


@cute.jit
def _store_q_parts(mQ: cute.Tensor, batch: Int32, rows: Int32, tidx: Int32, q8: cute.Tensor, sQpe: cute.Tensor,
                   sInv: cute.Tensor):
    """Q * 2^a = hi + lo in e4m3 into sQ8 rows r (hi) and 16 + r (lo), a per query row r (its largest |q| in
    [2^7, 2^8)), 2^-a into sInv, the rope part into sQpe. 16 threads a row (one half warp), 32 columns each.
    q8: sQ8 as bytes (_u8_view)."""
    r = tidx // 16
    part = tidx % 16
    vals = cute.make_rmem_tensor(D_V // 16, Float32)
    amax = Float32(0.0)
    for j in cutlass.range_constexpr(D_V // 16):
        v = Float32(0.0)
        if r < rows:
            v = mQ[r, (D_V // 16) * part + j, batch].to(Float32)
        vals[j] = v
        amax = cute.arch.fmax(amax, cute.arch.fmax(v, -v))
    for off in (1, 2, 4, 8):
        amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=off))
    scale = pow2_scale(amax)             # 2^a as fp32 (1 for a zero row)
    for j in cutlass.range_constexpr(0, D_V // 16, 2):
        x0 = vals[j] * scale
        x1 = vals[j + 1] * scale
        hl = _e4m3_parts(x0, x1)
        col = (D_V // 16) * part + j
        q8[r, col] = cutlass.Uint8(hl & 0xFF)
        q8[r, col + 1] = cutlass.Uint8((hl >> 8) & 0xFF)
        q8[N + r, col] = cutlass.Uint8((hl >> 16) & 0xFF)
        q8[N + r, col + 1] = cutlass.Uint8((hl >> 24) & 0xFF)
    if part == 0:
        sInv[r] = 1.0 / scale
    for j in cutlass.range_constexpr(D_PE // 16):
        col = (D_PE // 16) * part + j
        v = Float32(0.0)
        if r < rows:
            v = mQ[r, D_V + col, batch].to(Float32)
        sQpe[r, col] = v.to(cutlass.BFloat16)


@cute.jit
def _store_q_parts_16b(q_base: cutlass.Int64, batch: Int32, rows: Int32, tidx: Int32, q8_base: Int32,
                       qpe_base: Int32, sInv: cute.Tensor):
    """_store_q_parts in 16-byte pieces: the 16 threads of row r take its 16-byte chunks k = part + 16 j, j < 4
    (a half warp's load is 256 contiguous bytes), and parts < 8 the rope chunk 64 + part. Rows past `rows` read
    row 0 and are zeroed. Byte addresses: q_base (q row b * rows + r at 1152 (b * rows + r)); q8_base: sQ8
    [32, 512] e4m3 in the 128-byte swizzle (atoms of 8 rows of 128 bytes, 4 atoms down at 1024, then 4 across at
    4096; 16-byte chunk c of a row's 128 bytes sits at c ^ (row % 8)); qpe_base: sQpe [16, 64] bf16, likewise."""
    r = tidx // 16
    part = tidx % 16
    rr = r
    if r >= rows:
        rr = 0
    row_addr = q_base + cutlass.Int64(batch * rows + rr) * (D_QK * 2)
    words = cute.make_rmem_tensor(16, Int32)
    for j in cutlass.range_constexpr(4):
        w = ld_global_v4_b32(row_addr + (part + 16 * j) * 16)
        for e in cutlass.range_constexpr(4):
            words[4 * j + e] = w[e]
    pe = cute.make_rmem_tensor(4, Int32)
    pe.fill(0)
    if part < D_PE // 8:
        w = ld_global_v4_b32(row_addr + (D_V + 8 * part) * 2)
        for e in cutlass.range_constexpr(4):
            pe[e] = w[e]
    if r >= rows:
        words.fill(0)
        pe.fill(0)
    vals = cute.make_rmem_tensor(32, Float32)
    amax = Float32(0.0)
    for e in cutlass.range_constexpr(16):
        lo, hi = bf16x2_to_f32(words[e])
        vals[2 * e] = lo
        vals[2 * e + 1] = hi
        amax = cute.arch.fmax(amax, cute.arch.fmax(cute.arch.fmax(lo, -lo), cute.arch.fmax(hi, -hi)))
    for off in (1, 2, 4, 8):
        amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=off))
    scale = pow2_scale(amax)             # 2^a as fp32 (1 for a zero row)
    for j in cutlass.range_constexpr(4):
        hl = [_e4m3_parts(vals[8 * j + 2 * e] * scale, vals[8 * j + 2 * e + 1] * scale) for e in range(4)]
        chunk = ((part // 2) ^ (r % 8)) * 16 + 8 * (part % 2) + 4096 * j
        hi_addr = q8_base + (r // 8) * 1024 + (r % 8) * 128 + chunk
        lo_addr = q8_base + ((N + r) // 8) * 1024 + (r % 8) * 128 + chunk    # row N + r: (N + r) % 8 is r % 8
        st_shared_words(hi_addr, [prmt(hl[0], hl[1], 0x5410), prmt(hl[2], hl[3], 0x5410)])
        st_shared_words(lo_addr, [prmt(hl[0], hl[1], 0x7632), prmt(hl[2], hl[3], 0x7632)])
    if part == 0:
        sInv[r] = 1.0 / scale
    if part < D_PE // 8:
        st_shared_words(qpe_base + (r // 8) * 1024 + (r % 8) * 128 + (part ^ (r % 8)) * 16,
                          [pe[0], pe[1], pe[2], pe[3]])


def _u8_view(t: cute.Tensor, swizzle) -> cute.Tensor:
    """An e4m3 smem tensor as bytes, its swizzle kept (recast_tensor drops it from the pointer)."""
    return cute.make_tensor(cute.recast_ptr(t.iterator, swizzle_=swizzle, dtype=cutlass.Uint8), t.layout)


@dsl_user_op
def _e4m3_parts(x0: Float32, x1: Float32, *, loc=None, ip=None) -> Int32:
    """(x0, x1) as e4m3 hi + lo: bits 0..15 the hi pair (x0's byte first), 16..31 the lo pair. Through f16x2,
    whose 11 significant bits hold what hi and lo keep together (4 + 4)."""
    return Int32(llvm.inline_asm(
        Int32.mlir_type, [Float32(x0).ir_value(loc=loc, ip=ip), Float32(x1).ir_value(loc=loc, ip=ip)],
        "{\n.reg .b32 x, h, d;\n.reg .b16 hi, lo;\ncvt.rn.f16x2.f32 x, $2, $1;\n"
        "cvt.rn.satfinite.e4m3x2.f16x2 hi, x;\ncvt.rn.f16x2.e4m3x2 h, hi;\nsub.rn.f16x2 d, x, h;\n"
        "cvt.rn.satfinite.e4m3x2.f16x2 lo, d;\nmov.b32 $0, {hi, lo};\n}\n", "=r,f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def _st_shared_u16(addr: Int32, v: Int32, *, loc=None, ip=None) -> None:
    """v's bits 0..15 to shared memory at addr."""
    llvm.inline_asm(None, [Int32(addr).ir_value(loc=loc, ip=ip), Int32(v).ir_value(loc=loc, ip=ip)],
                    "{\n.reg .b16 t;\ncvt.u16.u32 t, $1;\nst.shared.b16 [$0], t;\n}\n", "r,r",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


