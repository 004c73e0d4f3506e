"""The balanced persistent-launch schedule (mlaserve.kernels.triton.stream_k), through Triton's CPU interpreter
here, against its plain-Python reference, and the properties a kernel relies on: every tile of every item in
exactly one piece, each item's pieces in slot order, every empty item a piece of its own, and slots that carry
equal cost."""

import pytest
import torch

from mlaserve.kernels.triton.stream_k import (TILE, balanced_schedule, item_tiles, pieces, reference_schedule,
                                             schedule_numel)

CASES = [  # lens kind, b, pairs, slots, overhead
    ("fixed", 128, 2, 66, 2), ("fixed", 128, 1, 66, 2), ("var", 128, 2, 66, 2), ("var", 300, 1, 132, 3),
    ("var", 5, 2, 8, 0), ("empty", 40, 2, 16, 2), ("short", 70, 1, 66, 2), ("one", 1, 2, 4, 2),
]


def _lens(kind: str, b: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    if kind == "fixed":
        return [4096] * b
    if kind == "var":
        return torch.randint(2048, 6145, (b,), generator=gen).tolist()
    if kind == "empty":    # some requests of no keys, some of a partial page
        return [0 if i % 3 == 0 else int(x) for i, x in enumerate(torch.randint(1, 700, (b,), generator=gen))]
    if kind == "short":
        return torch.randint(1, 3 * TILE, (b,), generator=gen).tolist()
    return [100000]


@pytest.mark.parametrize("kind, b, pairs, slots, overhead", CASES)
def test_schedule_matches_reference_and_covers_every_tile_once(kind, b, pairs, slots, overhead):
    lens = _lens(kind, b, b + slots)
    got = balanced_schedule(torch.tensor(lens, dtype=torch.int32), pairs, slots, overhead)
    assert got.dtype == torch.int32 and got.shape == (schedule_numel(slots),)
    want = reference_schedule(lens, pairs, slots, overhead)
    assert got.tolist() == want

    tiles = item_tiles(lens, pairs)
    seen = [[] for _ in tiles]
    for s, slot in enumerate(pieces(want, slots, tiles)):
        for item, lo, hi in slot:
            assert 0 <= lo <= hi <= tiles[item]
            seen[item].append((s, lo, hi))
    for item, got_pieces in enumerate(seen):
        assert got_pieces, f"item {item} is in no piece"
        # in slot order, contiguous from tile 0 to the end; only an empty item may be a piece of 0 tiles
        assert [p[0] for p in got_pieces] == sorted({p[0] for p in got_pieces})
        assert got_pieces[0][1] == 0 and got_pieces[-1][2] == tiles[item]
        for (_, _, hi), (_, lo, _) in zip(got_pieces, got_pieces[1:]):
            assert hi == lo
        if tiles[item]:
            assert all(hi > lo for _, lo, hi in got_pieces[:-1])


@pytest.mark.parametrize("kind, b, pairs, slots, overhead", [c for c in CASES if c[0] in ("fixed", "var")])
def test_slots_carry_equal_cost(kind, b, pairs, slots, overhead):
    lens = _lens(kind, b, 7)
    tiles = item_tiles(lens, pairs)
    sched = reference_schedule(lens, pairs, slots, overhead)
    cost = [sum(hi - lo + overhead for _, lo, hi in slot) for slot in pieces(sched, slots, tiles)]
    ideal = (sum(tiles) + len(tiles) * overhead) / slots
    # one piece's overhead more than the share at most (the cut item is paid for in both slots)
    assert max(cost) <= ideal + overhead + 1, (max(cost), ideal)
    # whole items, one after another, would run ceil(items / slots) rounds of the longest item
    if kind == "fixed":
        whole = -(-len(tiles) // slots) * (tiles[0] + overhead)
        assert max(cost) < whole


def test_writes_into_a_given_buffer_and_rejects_bad_input():
    out = torch.full((schedule_numel(4, 200) + 3,), -7, dtype=torch.int32)
    lens = torch.tensor([64, 640, 0], dtype=torch.int32)
    assert balanced_schedule(lens, 1, 4, flags=200, out=out) is out
    assert out[:schedule_numel(4)].tolist() == reference_schedule([64, 640, 0], 1, 4)
    # the flags after the schedule cleared, nothing past them touched
    assert out[schedule_numel(4):schedule_numel(4, 200)].tolist() == [0] * 200
    assert out[schedule_numel(4, 200):].tolist() == [-7] * 3
    with pytest.raises(ValueError, match="int32"):
        balanced_schedule(torch.tensor([1, 2]), 1, 4)
    with pytest.raises(ValueError, match=r"int32 \[>= 14\]"):
        balanced_schedule(lens, 1, 4, out=torch.empty(5, dtype=torch.int32))
    with pytest.raises(ValueError, match="pairs and slots"):
        balanced_schedule(lens, 1, 4, flags=-1)
    with pytest.raises(ValueError, match="pairs and slots"):
        balanced_schedule(lens, 0, 4)
