"""The Hopper (sm_90a) MLA decode over the FP8 656-byte KV format on the bf16 kernel's seesaw consumers, in CuTe DSL.

One CTA = 64 query rows x one KV split of one request, a grid launch (FP8 requests of more than 32 query rows). The
consumers are the bf16 dense decode's (mla_decode_consumer.SeesawConsumer, whose schedule mla_decode_kernel.py's
docstring gives: one consumer owns a page's S and softmax while the other runs the previous page's P V) on its
2-stage ring of bf16 [64, 576] pages; what differs is who fills the ring. In place of the TMA producer, a loader
warpgroup reads each page's e4m3 bytes and scales into registers and writes them as bf16 into the stage
(fp8_register_loader.py), and k_pe lands there by TMA. The 64-row FP8 kernel this replaced (removed after
bench/NOTES.md 157) split S by keys and O by columns with the maxima exchanged every page and took ~2.76 us a page on
an H100 where this schedule takes ~2.07 in bf16 (bench/NOTES.md 151). On an H100 this kernel runs 1.06-1.15x as fast
as that one (NOTES 156); the loader, not the consumers, sets its pace (NOTES 155: the consumers hold both stages, so
a page's fill sits between two seesaw steps).

Warp roles (384 threads): WG 0 the loader (setmaxnreg LOADER_REGS; warp 0 also loads Q by TMA), WG 1 and WG 2 the
consumers (setmaxnreg CONSUMER_REGS, where the seesaw still compiles without spills: NOTES 151).

Smem: Q 73728 + two stages 147456 + P 8192 + barriers and row statistics: the bf16 grid kernel's.

Barriers a stage: full (LOADER_THREADS + 1 arrivals: the loader's threads after their proxy fence, warp 0's with
k_pe's TMA bytes), empty (the 8 consumer warps, as in the bf16 kernel: both consumers read every page's V).
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from mlaserve.kernels.cutedsl.common import register_split_fits
from mlaserve.kernels.cutedsl.fp8_pages import D_PE, ROPE_ELEMS, fp8_io_tensors
from mlaserve.kernels.cutedsl.fp8_register_loader import (
    BT_WORDS, GROUP_ROWS, GROUPS_AHEAD, LOADER_THREADS, PREFETCH, WARP_ROWS, fp8_register_loader)
from mlaserve.kernels.cutedsl.mla_decode_kernel import THREADS, MLADecodeSm90
from mlaserve.kernels.cutedsl.request_rows import grid_request, ordered_tensors, page_split
from mlaserve.kernels.cutedsl.seesaw_consumers import (
    CONSUMER_THREADS, D_QK, D_V, NUM_STAGES, TILE_M, TILE_N, seesaw_operands, seesaw_smem_layouts, seesaw_tiled_mmas)

LOADER_REGS = 88
CONSUMER_REGS = 208   # 128 x 88 + 256 x 208 = 64512, the launch's 384 x 168
assert register_split_fits((LOADER_THREADS, LOADER_REGS), (THREADS - LOADER_THREADS, CONSUMER_REGS))


class MLADecodeFP8SeesawSm90(MLADecodeSm90):
    """Compiled per (causal, split, ordered, store16, the seesaw's softmax switches, the loader's groups and
    prefetch); q, out bf16. Launched by mla_decode.py through `__call__`, with the FP8 kernels' pointers
    (mla_decode._fp8_pointers)."""

    def __init__(self, causal: bool, is_split: bool, ordered: bool = False, store16: bool = False,
                 lazy_rescale: bool = False, fold_scale: bool = False, tree_max: bool = False, spec_exp: bool = False,
                 group_rows: int = GROUP_ROWS, groups_ahead: int = GROUPS_AHEAD, prefetch: bool = PREFETCH,
                 bt_smem: bool = False):
        if WARP_ROWS % group_rows or not 0 < groups_ahead <= WARP_ROWS // group_rows:
            raise ValueError(f"the loader's groups of {group_rows} rows must divide its {WARP_ROWS} rows a warp, and "
                             f"1 to all of them may be ahead, got {groups_ahead}")
        self.group_rows = group_rows      # the loader's loads: groups of this many rows a warp ...
        self.groups_ahead = groups_ahead  # ... this many ahead of the one it converts (fp8_register_loader)
        self.prefetch = prefetch          # the loader asks L2 for the page after next
        self.bt_smem = bt_smem            # ... and takes the pages' block-table entries from a ring in smem
        super().__init__(cutlass.BFloat16, causal, is_split, store16=store16, early_sums=True,
                         lazy_rescale=lazy_rescale, fold_scale=fold_scale, tree_max=tree_max, spec_exp=spec_exp,
                         ordered=ordered)

    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, kv_ptr: cute.Pointer, rope_ptr: cute.Pointer, bt_ptr: cute.Pointer,
                 seqlens_ptr: cute.Pointer, out_ptr: cute.Pointer, lse_ptr: cute.Pointer, po_ptr: cute.Pointer,
                 pl_ptr: cute.Pointer, batch: Int32, s_q: Int32, h: Int32, num_pages: Int32, max_pages: Int32,
                 num_splits: Int32, scale_log2: Float32, stream):
        """q bf16 [b, s_q * h, 576]; kv: the cache uint8 [num_pages * 64, 656] as int32 words; rope: the same
        cache as bf16 from byte 528 (k_pe, row stride 328 elements); bt int32 [b, max_pages]; seqlens int32
        [b]; out bf16 [b, s_q * h, 512], lse fp32 [b, s_q * h]; partials (split only) fp32
        [b, num_splits, s_q * h, 512] and [b, num_splits, s_q * h]. Ordered launches pass the requests' int32
        order [b] in partial out's place (unsplit) or lse's (split). The other FP8 dense kernels take the same."""
        rows = s_q * h
        mQ = cute.make_tensor(q_ptr, cute.make_layout((rows, D_QK, batch), stride=(D_QK, 1, rows * D_QK)))
        mRope = cute.make_tensor(rope_ptr, cute.make_layout((num_pages * TILE_N, D_PE), stride=(ROPE_ELEMS, 1)))
        mBT, mSeqlens, mOut, mLse, mPO, mPL = fp8_io_tensors(bt_ptr, seqlens_ptr, out_ptr, lse_ptr, po_ptr, pl_ptr,
                                                             batch, rows, max_pages, num_splits)
        if const_expr(self.ordered):
            mLse, mPO = ordered_tensors(mLse, mPO, lse_ptr, po_ptr, batch, self.is_split)

        atom, sQ_layout, sKV_layout, sP_layout = seesaw_smem_layouts(self.dtype)
        sPE_layout = cute.tile_to_shape(atom, (TILE_N, D_PE), order=(0, 1))

        tma_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, mQ_tma = cpasync.make_tiled_tma_atom(tma_op, mQ, sQ_layout, (TILE_M, D_QK))
        tma_pe, mPE_tma = cpasync.make_tiled_tma_atom(tma_op, mRope, sPE_layout, (TILE_N, D_PE))
        tiled_mma_qk, tiled_mma_pv, tiled_mma_pv_rs = seesaw_tiled_mmas(self.dtype)

        self.shared_storage = self._grid_storage(NUM_STAGES * 2, sQ_layout, sKV_layout, sP_layout,
                                                 BT_WORDS if self.bt_smem else 1)
        self.fp8_kernel(tma_q, mQ_tma, tma_pe, mPE_tma, kv_ptr.toint(), mBT, mSeqlens, mOut, mLse, mPO, mPL,
                        s_q, h, rows, num_splits, scale_log2, sQ_layout, sKV_layout, sP_layout,
                        tiled_mma_qk, tiled_mma_pv, tiled_mma_pv_rs).launch(
            grid=(cute.ceil_div(rows, TILE_M), num_splits, batch), block=[THREADS, 1, 1],
            smem=self.shared_storage.size_in_bytes(), stream=stream)

    @cute.kernel
    def fp8_kernel(self, tma_q: cute.CopyAtom, mQ_tma: cute.Tensor, tma_pe: cute.CopyAtom, mPE_tma: cute.Tensor,
                   kv_addr: cutlass.Int64, mBT: cute.Tensor, mSeqlens: cute.Tensor, mOut: cute.Tensor,
                   mLse: cute.Tensor, mPO: cute.Tensor, mPL: cute.Tensor, s_q: Int32, h: Int32, rows: Int32,
                   num_splits: Int32, scale_log2: Float32, sQ_layout: cute.ComposedLayout,
                   sKV_layout: cute.ComposedLayout, sP_layout: cute.ComposedLayout, tiled_mma_qk: cute.TiledMma,
                   tiled_mma_pv: cute.TiledMma, tiled_mma_pv_rs: cute.TiledMma):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, split, bz = cute.arch.block_idx()
        batch = grid_request(bz, mLse, mPO, self.ordered, self.is_split)
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = cute.arch.make_warp_uniform(tidx // 128)
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_pe)

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        # full: the loader's threads and warp 0's arrival with k_pe's bytes; empty: one lane of each consumer warp
        kv_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.kv_mbar.data_ptr(), num_stages=NUM_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, LOADER_THREADS + 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONSUMER_THREADS // 32),
            tx_count=TILE_N * D_PE * 2)
        q_pipe, sQ, sKV, sP, sMax, sSum = self._q_pipe_and_smem(storage, sQ_layout, sKV_layout, sP_layout)
        seqlen = mSeqlens[batch]
        start, n_tiles = page_split(seqlen, split, num_splits)

        if wg == 0:
            # ---------------- loader ----------------
            cute.arch.setmaxregister_decrease(LOADER_REGS)
            # k_pe: each stage's rope columns [64, 64] (block 8 of the stage's nine 64-column blocks)
            sRope = cute.local_tile(sKV, (TILE_N, D_PE, NUM_STAGES), (0, D_V // D_PE, 0))
            gPE = cute.local_tile(mPE_tma, (TILE_N, D_PE), (None, 0))           # [64, 64, pages]
            tPs, tPg = cpasync.tma_partition(tma_pe, 0, cute.make_layout(1), cute.group_modes(sRope, 0, 2),
                                             cute.group_modes(gPE, 0, 2))
            if warp_idx == 0:
                gQ = cute.local_tile(mQ_tma[None, None, batch], (TILE_M, D_QK), (m_block, 0))
                tQs, tQg = cpasync.tma_partition(tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2),
                                                 cute.group_modes(gQ, 0, 2))
                q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                q_pipe.producer_acquire(q_state)
                cute.copy(tma_q, tQg, tQs, tma_bar_ptr=q_pipe.producer_get_barrier(q_state))
            fp8_register_loader(tidx, warp_idx, kv_addr, storage.sKV.data_ptr().toint(), kv_pipe, tma_pe, tPg, tPs,
                                mBT, batch, start // TILE_N, n_tiles, seqlen, start, NUM_STAGES, self.group_rows,
                                self.groups_ahead, self.prefetch,
                                storage.extra.data_ptr().toint() if const_expr(self.bt_smem) else None)
        else:
            # ---------------- consumers: the bf16 kernel's ----------------
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            cw = wg - 1
            ctid = tidx % 128
            ops = seesaw_operands(tiled_mma_qk, tiled_mma_pv, tiled_mma_pv_rs, ctid, cw, sQ, sKV, sP)
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            self._consume_item(kv_pipe, q_pipe, q_state, ops, tiled_mma_qk, tiled_mma_pv, tiled_mma_pv_rs, sKV,
                               sMax, sSum, mOut, mLse, mPO, mPL, cw, ctid, seqlen, start, n_tiles, 0, batch,
                               split, m_block, s_q, h, rows, scale_log2)
