"""Where a CTA of the CuTe DSL dense decode kernels stands in its request: the request of a grid block (in batch
order or through an order), the pages of its KV split, and the keys each query row may see. Shared by the bf16 /
fp16 kernel (mla_decode_kernel.py) and the FP8 ones; everything here is inlined into the calling kernel."""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

TILE_N = 64           # cached tokens per page: one KV tile


def page_split(seqlen: Int32, split: Int32, num_splits: Int32):
    """This split's tokens of the dense decode kernels: the request's length cut into num_splits runs of
    whole pages -> (first token, pages to read; 0 for a split past the end)."""
    split_len = ((seqlen + num_splits - 1) // num_splits + TILE_N - 1) // TILE_N * TILE_N
    start = split * split_len
    end = cutlass.min(start + split_len, seqlen)
    return start, cutlass.max((end - start + TILE_N - 1) // TILE_N, 0)


def visible_keys(seqlen: Int32, s_q: Int32, h: Int32, row: Int32, causal: bool) -> Int32:
    """The keys query row `row` (= new token j * h + head) may see: the request's seqlen, or causally the
    first seqlen - s_q + 1 + j."""
    v = seqlen
    if causal:
        v = seqlen - s_q + 1 + row // h
    return cutlass.min(v, seqlen)


def ordered_tensors(mLse: cute.Tensor, mPO: cute.Tensor, lse_ptr: cute.Pointer, po_ptr: cute.Pointer, batch: Int32,
                    is_split: bool) -> tuple:
    """Ordered grid launches (work_order.grid_order: requests longest first): the int32 order [b] of the grid's
    request axis rides in lse's place in split launches (they write partial lse only) and in partial out's in
    unsplit ones (no partials) -> (mLse, mPO) with that one the order. The kernel reads its request as
    order[block z]."""
    if is_split:
        return cute.make_tensor(lse_ptr, cute.make_layout(batch)), mPO
    return mLse, cute.make_tensor(po_ptr, cute.make_layout(batch))


def grid_request(bz: Int32, mLse: cute.Tensor, mPO: cute.Tensor, ordered: bool, is_split: bool) -> Int32:
    """The request a grid CTA of block z takes: z, or order[z] in ordered launches (ordered_tensors)."""
    if not ordered:
        return bz
    return mLse[bz] if is_split else mPO[bz]


def first_masked_key(seqlen: Int32, s_q: Int32, causal: bool) -> Int32:
    """The smallest number of keys any row sees (tiles that end before it need no mask)."""
    return cutlass.max(seqlen - s_q + 1, 0) if causal else seqlen
