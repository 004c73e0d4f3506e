"""A balanced static schedule for a persistent decode launch: every slot (SM, or cluster of SMs) gets the same
share of the step's KV tiles, cutting work items where a share ends (stream-K).

A persistent launch of whole work items (a request's row tiles, all of its KV) over S slots finishes after
ceil(items / S) item-times when the items are equal: at b 128, s_q 2, h 128 that is 256 items on 66 cluster
slots, 3.88 rounds run as 4, so 12% of the slots idle through the last round (3% of the step). Here the
step's work is laid out as one sequence, item after item (A_i: item i's first tile in it), and slot s takes
the tiles [W_s, W_s+1): the items that start there, whole where they end before W_s+1, and at its start the
rest of an item begun in an earlier slot. An item cut into pieces has its pieces' results merged through their
log-sum-exps by whichever piece finishes last (the consuming kernel's business; this module only plans).

Item i is row-tile pair i // b of request i % b: the sequence runs through every request's first pair, then
every request's second, so that (with S a multiple of the pairs) a request's pairs run in slots S / pairs
apart at the same time and its pages come from HBM once for all of them. Request by request, one slot read a
request's pages again for its second pair long after the first, from HBM: 6% slower at b 128, s_q 2, h 128
on the H200.

The boundaries balance cost, not just tiles: each piece pays a fixed cost (Q load, the last tile's
exchange, the epilogue) of about `overhead` tiles, so item i counts as tiles_i + overhead and W_s is the tile
where a cost of s / S of the total is reached (a boundary inside an item's overhead falls on its first tile).

Computed on the GPU from the lengths by a small Triton kernel, one program a slot (no host sync: a decode step
stays capturable in a CUDA graph; one program for all slots took 24-36 us at b 128), into an int32 buffer
laid out as
    W [S + 1]          the slots' first tiles in the sequence (W_0 = 0, W_S = the total)
    I [S + 1]          the first item that starts in slot s: #{i : A_i < W_s} (I_0 = 0, I_S = items)
    CONT [S]           > 0: slot s starts inside item I_s - 1, at this tile of it; 0: it starts at an item
so slot s runs the pieces (I_s - 1 from tile CONT_s, if CONT_s > 0), then items I_s .. I_s+1 - 1 from tile 0,
each up to its end or to W_s+1 (`pieces` spells it out). An item of no tiles (an empty request) is a piece
of its own in the slot where it starts, so that its output (zeros, lse -inf) is still written. After the
schedule, `flags` int32 are zeroed: the consuming kernel's counters and ready flags, which so start every
launch cleared.
"""

import torch
import triton
import triton.language as tl

TILE = 64             # tokens per KV tile (page)
ITEM_BLOCK = 256


def schedule_numel(slots: int, flags: int = 0) -> int:
    """int32 values of a schedule: W, I (slots + 1 each) and CONT (slots), then `flags` zeroed values."""
    return 3 * slots + 2 + flags


@triton.jit
def _item_block(lens_ptr, i0, n, b, carry, ITEM_BLOCK: tl.constexpr, TILE: tl.constexpr):
    """Items i0 .. i0 + ITEM_BLOCK - 1 (item i: request i % b, pair i // b): -> (i, tiles, first tiles A_i
    given the tiles before i0 in `carry`, carry past them). Items past n count 0 tiles."""
    i = i0 + tl.arange(0, ITEM_BLOCK)
    lens = tl.load(lens_ptr + i % b, mask=i < n, other=0)
    tiles = (lens + TILE - 1) // TILE
    return i, tiles, carry + tl.cumsum(tiles, axis=0) - tiles, carry + tl.sum(tiles, axis=0)


@triton.jit
def _balanced_kernel(lens_ptr, out_ptr, b, pairs, S, overhead, flags, flags_per_program, ITEM_BLOCK: tl.constexpr,
                     TILE: tl.constexpr):
    # program s (0 .. S) computes W_s, I_s and CONT_s alone, over all items
    s = tl.program_id(0)
    n = b * pairs
    total = s * 0
    for i0 in range(0, n, ITEM_BLOCK):
        i = i0 + tl.arange(0, ITEM_BLOCK)
        total += tl.sum((tl.load(lens_ptr + i % b, mask=i < n, other=0) + TILE - 1) // TILE, axis=0)
    # the cost position x_s = s / S of the total cost; W_s = the tiles before it, each item counting its own tiles
    # up to x_s - (its start in cost units) - overhead
    x = (s.to(tl.int64) * (total.to(tl.int64) + n.to(tl.int64) * overhead) // S).to(tl.int32)
    w = s * 0
    carry = s * 0
    for i0 in range(0, n, ITEM_BLOCK):
        i, tiles, a, carry = _item_block(lens_ptr, i0, n, b, carry, ITEM_BLOCK, TILE)
        w += tl.sum(tl.minimum(tl.maximum(x - (a + i * overhead + overhead), 0), tiles), axis=0)
    w = tl.where(s == S, total, w)
    # I_s = #{i : A_i < W_s}; CONT_s = W_s - A_i for the item with A_i < W_s < A_i + tiles_i
    first = s * 0
    cont = s * 0
    carry = s * 0
    for i0 in range(0, n, ITEM_BLOCK):
        i, tiles, a, carry = _item_block(lens_ptr, i0, n, b, carry, ITEM_BLOCK, TILE)
        first += tl.sum(((i < n) & (a < w)).to(tl.int32), axis=0)
        cont += tl.sum(tl.where((i < n) & (a < w) & (w < a + tiles), w - a, 0), axis=0)
    first = tl.where(s == S, n, first)
    tl.store(out_ptr + s, w)
    tl.store(out_ptr + S + 1 + s, first)
    tl.store(out_ptr + 2 * S + 2 + s, cont, mask=s < S)
    for f0 in range(0, flags_per_program, ITEM_BLOCK):
        k = f0 + tl.arange(0, ITEM_BLOCK)
        f = s * flags_per_program + k
        tl.store(out_ptr + 3 * S + 2 + f, tl.zeros([ITEM_BLOCK], dtype=tl.int32),
                 mask=(f < flags) & (k < flags_per_program))


def balanced_schedule(lens: torch.Tensor, pairs: int, slots: int, overhead: int = 2, flags: int = 0,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """The schedule (module docstring) of b * pairs items over `slots` slots and `flags` zeros after it, int32
    [schedule_numel(slots, flags)] (or written into the first values of `out`). lens: int32 [b], the requests'
    KV lengths."""
    if lens.dim() != 1 or lens.dtype != torch.int32:
        raise ValueError(f"lens must be int32 [b], got {lens.dtype} {tuple(lens.shape)}")
    if pairs < 1 or slots < 1 or overhead < 0 or flags < 0:
        raise ValueError(f"pairs and slots must be >= 1, overhead and flags >= 0, got {pairs}, {slots}, {overhead}, "
                         f"{flags}")
    numel = schedule_numel(slots, flags)
    if out is None:
        out = torch.empty(numel, dtype=torch.int32, device=lens.device)
    elif out.dim() != 1 or out.numel() < numel or out.dtype != torch.int32 or out.device != lens.device:
        raise ValueError(f"out must be int32 [>= {numel}] on {lens.device}, got {out.dtype} {tuple(out.shape)} "
                         f"on {out.device}")
    per_program = triton.cdiv(flags, slots + 1)
    _balanced_kernel[(slots + 1,)](lens.contiguous(), out, lens.shape[0], pairs, slots, overhead, flags, per_program,
                                   ITEM_BLOCK=ITEM_BLOCK, TILE=TILE, num_warps=2)
    return out


def item_tiles(lens: list[int], pairs: int) -> list[int]:
    """Each item's KV tiles, in the sequence's order: item i is row-tile pair i // b of request i % b."""
    return [-(-n // TILE) for _ in range(pairs) for n in lens]


def reference_schedule(lens: list[int], pairs: int, slots: int, overhead: int = 2) -> list[int]:
    """The same schedule in plain Python (the tests' reference)."""
    tiles = item_tiles(lens, pairs)
    starts = [sum(tiles[:i]) for i in range(len(tiles))]
    total = sum(tiles)
    cost = total + len(tiles) * overhead
    w = []
    for s in range(slots + 1):
        x = s * cost // slots
        w.append(total if s == slots else
                 sum(min(max(x - (a + i * overhead + overhead), 0), t) for i, (a, t) in enumerate(zip(starts, tiles))))
    first = [len(tiles) if s == slots else sum(a < w[s] for a in starts) for s in range(slots + 1)]
    cont = [sum(w[s] - a for a, t in zip(starts, tiles) if a < w[s] < a + t) for s in range(slots)]
    return w + first + cont


def pieces(schedule: list[int], slots: int, tiles: list[int]) -> list[list[tuple[int, int, int]]]:
    """Each slot's pieces (item, first tile, end tile) from a schedule, as a kernel walks them; tiles: each item's
    tile count."""
    w, first, cont = schedule[:slots + 1], schedule[slots + 1:2 * slots + 2], schedule[2 * slots + 2:3 * slots + 2]
    out = []
    for s in range(slots):
        pos, end, got = w[s], w[s + 1], []
        item, lo = (first[s] - 1, cont[s]) if cont[s] > 0 else (first[s], 0)
        while item < first[s + 1]:
            hi = min(tiles[item], lo + end - pos)
            got.append((item, lo, hi))
            pos += hi - lo
            item, lo = item + 1, 0
        out.append(got)
    return out
