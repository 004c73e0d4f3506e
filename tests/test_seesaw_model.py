"""scripts/seesaw_model.py: the clock model of the CuTe decode's seesaw that compares consumer schedules."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "seesaw_model", Path(__file__).resolve().parents[1] / "scripts" / "seesaw_model.py")
model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(model)

FLOOR = model.S_CLOCKS + 2 * model.PV_CLOCKS


@pytest.mark.parametrize("early", [0, 12, 36])
@pytest.mark.parametrize("load", [600, 2000])
def test_the_tensor_cores_do_every_tiles_work_once(early, load):
    """Whatever the schedule, the tensor cores are busy for exactly the tiles' wgmma work (S and both P V halves
    of every tile), and the whole run takes at least that long."""
    tiles = 12
    clocks, busy = model.simulate(tiles, early, softmax=650, rescale=150, load=load)
    assert abs(busy - tiles * FLOOR) <= tiles
    assert clocks >= busy


def test_the_default_schedule_matches_the_h200s_clocks_a_tile():
    """Calibrated to the H200's traces (bench/NOTES.md 54: 3.02 k clocks a 64-key tile at 128 rows): the default
    schedule leaves the tensor cores idle through each softmax, so a tile takes about the floor plus a softmax."""
    tiles = 32
    clocks, _ = model.simulate(tiles, 0, softmax=650, rescale=150, load=1400)
    assert 0.95 * 3020 < clocks / tiles < 1.05 * 3020
    faster, _ = model.simulate(tiles, 0, softmax=450, rescale=150, load=1400)
    assert clocks - faster == pytest.approx(200 * tiles, rel=0.1)


def test_early_s_pays_only_while_pages_land_soon():
    """S's first k-blocks issued before the other consumer's P fill its softmax when the next page lands early,
    and cost time when it lands late (the early part then waits for the page and delays the stage's release)."""
    tiles = 32
    base_soon, _ = model.simulate(tiles, 0, load=800)
    early_soon, _ = model.simulate(tiles, 12, load=800)
    base_late, _ = model.simulate(tiles, 0, load=2400)
    early_late, _ = model.simulate(tiles, 12, load=2400)
    assert early_soon < 0.95 * base_soon
    assert early_late > base_late


@pytest.mark.parametrize("tiles", [1, 2, 7, 12])
@pytest.mark.parametrize("load", [0, 1600])
def test_the_pair_schedule_does_every_tiles_work_once(tiles, load):
    """FlashMLA's pair schedule (pair_program), odd tile counts and a lone tile included: it ends (no deadlock
    between the two consumers' events and the parts' releases), and the tensor cores are busy for exactly the
    tiles' wgmma work."""
    clocks, busy = model.simulate_pairs(tiles, softmax=650, rescale=150, load=load)
    assert abs(busy - tiles * FLOOR) <= tiles
    assert clocks >= busy


def test_the_pair_schedule_hides_a_softmax_only_while_pages_land_soon():
    """With pages landing at once, the pair schedule keeps the tensor cores busier than the default (one consumer's
    S runs during the other's softmax); with slow refills it is slower, as S of tile t + 2 waits for both halves of
    tile t, the other consumer's freed after its later P V (bench/NOTES.md 112)."""
    tiles = 32
    base_soon, _ = model.simulate(tiles, 0, load=0)
    pairs_soon, _ = model.simulate_pairs(tiles, load=0)
    base_late, _ = model.simulate(tiles, 0, load=1600)
    pairs_late, _ = model.simulate_pairs(tiles, load=1600)
    assert pairs_soon < 0.9 * base_soon
    assert pairs_late > base_late
