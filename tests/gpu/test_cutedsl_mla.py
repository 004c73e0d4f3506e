"""The CuTe DSL MLA decode on a Hopper GPU against the torch reference, and CUDA-graph replay equal to eager.

Shapes, inputs (NaN in unused cache slots, out-of-range page ids past each request's pages) and the
FlashMLA-like tolerances are scripts/cutedsl_check.py's, loaded from there so that both check one thing.
One command: python -m pytest -q tests/gpu/test_cutedsl_mla.py
"""

import importlib
import importlib.util
from pathlib import Path

import pytest
import torch

from mlaserve.kernels import reference
from mlaserve.ops.registry import BACKENDS


_UNAVAILABLE = BACKENDS["cutedsl"].unavailable_reason(torch.device("cuda"))
pytestmark = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"cutedsl: {_UNAVAILABLE}")

_spec = importlib.util.spec_from_file_location(
    "cutedsl_check", Path(__file__).resolve().parents[2] / "scripts" / "cutedsl_check.py")
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)
cd = importlib.import_module("mlaserve.kernels.cutedsl.mla_decode")
decode_plan = importlib.import_module("mlaserve.kernels.cutedsl.decode_plan")


def assert_reference(out, lse, q, kv, table, seqlens, what: str = ""):
    """out and lse within the FlashMLA-like tolerances of the float64 reference on the same inputs."""
    ok, max_err, why = check.compare(out, lse, *reference.mla_decode(q.double(), kv.double(), table, seqlens,
                                                                    check.SCALE))
    assert ok, f"{what}max abs err {max_err:.2e}: {why}"


def _ragged_lens(b: int) -> list[int]:
    """b request lengths: an empty one, one of one token, two at a page's edges, then varied up to 1500."""
    return [(0, 1, 64, 65)[i] if i < 4 else 1 + (389 * i) % 1500 for i in range(b)]


def _ragged_case(monkeypatch, b: int, s_q: int, h: int, min_tiles, seed: int):
    """bf16 inputs of b ragged requests (an empty one, one of one token, page edges; NaN-poisoned unused slots), and
    the launch's schedule: min_tiles sets STREAM_K_MIN_TILES, -1 turns STREAM_K off, None leaves the module's."""
    if min_tiles == -1:
        monkeypatch.setattr(cd, "STREAM_K", False)
    elif min_tiles is not None:
        monkeypatch.setattr(cd, "STREAM_K_MIN_TILES", min_tiles)
    return check.make_case(_ragged_lens(b), s_q, h, torch.bfloat16, seed=seed)


def _assert_same_bits(monkeypatch, name: str, before, after, q, kv, table, seqlens, num_splits):
    """A launch with mla_decode's `name` set to `after`: within the reference's tolerances, and the same bits as one
    with `before`."""
    monkeypatch.setattr(cd, name, before)
    out0, lse0 = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=num_splits)
    monkeypatch.setattr(cd, name, after)
    out, lse = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=num_splits)
    assert_reference(out, lse, q, kv, table, seqlens, f"{name} {after}: ")
    assert torch.equal(out, out0) and torch.equal(lse, lse0), f"{name} {after} changed the bits of {before}"


@pytest.mark.parametrize("case", list(check.cases(quick=False)),
                         ids=lambda c: f"b{len(c['lens'])}-sq{c['s_q']}-h{c['h']}-{str(c['dtype'])[6:]}"
                                       f"-causal{c['causal']}-splits{c.get('num_splits')}")
def test_matches_reference(case):
    q, kv, table, seqlens = check.make_case(case["lens"], case["s_q"], case["h"], case["dtype"], seed=len(case["lens"]))
    out, lse = cd.mla_decode(q, kv, table, seqlens, check.SCALE, causal=case["causal"],
                             num_splits=case.get("num_splits"))
    ref_out, ref_lse = reference.mla_decode(q.double(), kv.double(), table, seqlens, check.SCALE,
                                            causal=case["causal"])
    ok, max_err, why = check.compare(out, lse, ref_out, ref_lse)
    assert ok, f"max abs err {max_err:.2e}: {why}"


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("cluster", [1, 2, 4])
def test_every_cluster_size_matches_reference(monkeypatch, cluster, num_splits):
    """Row tiles sharing each page's load by TMA multicast (cluster_size forced): the same result as one CTA
    loading the whole page, over short, page-edge and ragged lengths (NaN beyond each request's end)."""
    lens = [1, 64, 65, 3000, 4096, 200]
    q, kv, table, seqlens = check.make_case(lens, 2, 128, torch.bfloat16, seed=cluster)
    monkeypatch.setattr(cd, "cluster_size", lambda rows, kv_fp8: cluster)
    out, lse = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=num_splits)
    assert_reference(out, lse, q, kv, table, seqlens, f"cluster {cluster}, {num_splits} splits: ")


@pytest.mark.parametrize("b, s_q, h, cluster, dtype", [
    (300, 1, 16, None, torch.bfloat16),   # one CTA per item, 300 items on 132 SMs
    (150, 1, 128, None, torch.bfloat16),  # pairs of row tiles: 2-CTA clusters hand each ticket on
    (101, 2, 64, None, torch.float16),
    (40, 2, 128, 4, torch.bfloat16),      # clusters of 4 (forced): the ticket goes to three CTAs
])
def test_persistent_launch_matches_reference(monkeypatch, b, s_q, h, cluster, dtype):
    """Unsplit steps with more work items than clusters fit the SMs run persistent (here with tickets from a
    global counter, requests longest first; STREAM_K off): ragged lengths, empty and one-token requests among
    them, NaN beyond each request's end; the counters are back at zero after each launch, and a second launch
    gives the same bits, as does one taking the requests in batch order."""
    monkeypatch.setattr(cd, "STREAM_K", False)
    if cluster is not None:
        monkeypatch.setattr(cd, "cluster_size", lambda rows, kv_fp8: cluster)
    lens = _ragged_lens(b)
    q, kv, table, seqlens = check.make_case(lens, s_q, h, dtype, seed=b)
    c = cd.cluster_size(s_q * h, False)
    assert cd.persistent_clusters(b, s_q * h, False, False, c, q.device) > 0, "the case must run persistent"
    out, lse = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=1)
    assert torch.equal(cd.scheduler_counters(q.device).cpu(), torch.zeros(2, dtype=torch.int32))
    assert_reference(out, lse, q, kv, table, seqlens)
    out2, lse2 = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=1)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    # requests taken in batch order instead of longest first: each item's result is its own, bit for bit
    monkeypatch.setattr(cd, "LONGEST_FIRST", False)
    out3, lse3 = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=1)
    assert torch.equal(out, out3) and torch.equal(lse, lse3)


@pytest.mark.parametrize("b, s_q, h, lens_kind", [
    (256, 1, 128, "ties"),     # the most requests ranked in the kernel; lengths in three values and zeros
    (150, 2, 64, "ragged"),
    (257, 1, 128, "ties"),     # one more: the order kernel's
])
def test_requests_ranked_in_the_kernel_give_the_order_kernels_bits(monkeypatch, b, s_q, h, lens_kind):
    """Ticket launches of at most RANK_ORDER_MAX_B requests rank them by length in each CTA (RANK_ORDER) instead
    of reading work_order.longest_first's order: with ties and empty requests among them, every request is
    computed once (against the reference) and the bits are the order kernel's."""
    monkeypatch.setattr(cd, "STREAM_K", False)
    assert cd.RANK_ORDER and cd.LONGEST_FIRST
    lens = ([0 if i % 7 == 3 else 64 * (1 + i % 3) + (i % 2) for i in range(b)] if lens_kind == "ties"
            else [1 + (389 * i) % 1500 for i in range(b)])
    q, kv, table, seqlens = check.make_case(lens, s_q, h, torch.bfloat16, seed=b + 1)
    c = cd.cluster_size(s_q * h, False)
    assert cd.persistent_clusters(b, s_q * h, False, False, c, q.device) > 0, "the case must run persistent"
    out, lse = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=1)
    assert_reference(out, lse, q, kv, table, seqlens)
    monkeypatch.setattr(cd, "RANK_ORDER", False)
    out2, lse2 = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=1)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


@pytest.mark.parametrize("lens_kind, b, s_q, h, cluster, dtype", [
    ("ragged", 300, 1, 16, None, torch.bfloat16),   # one CTA a slot, 132 slots; 16 rows: a partial row block
    ("ragged", 150, 1, 128, None, torch.bfloat16),  # 2-CTA clusters, 66 slots
    ("ragged", 101, 2, 64, None, torch.float16),
    ("ragged", 40, 2, 128, 4, torch.bfloat16),      # clusters of 4 (forced), 33 slots
    ("one long", 140, 1, 16, None, torch.bfloat16),  # a 32768-token request cut into tens of pieces
    ("one long", 70, 2, 64, None, torch.bfloat16),   # the same in clusters, causal over 2 new tokens
    ("fixed", 128, 2, 128, None, torch.bfloat16),    # the benchmark's shape: items of 16 pages cut in two
])
def test_stream_k_launch_matches_reference(monkeypatch, lens_kind, b, s_q, h, cluster, dtype):
    """Persistent launches on the balanced static schedule (STREAM_K): items cut where a slot's share ends and
    their pieces merged by the last to finish. Ragged lengths with empty and one-token requests, one request far
    longer than the rest (its item cut into pieces across many slots: every merge path), and fixed lengths; NaN
    beyond each request's end. Against the float64 reference; a second launch gives the same bits (the merge
    folds the pieces in slot order whichever finished last, and the schedule kernel clears the flags), and
    whole items from tickets agree with the reference too."""
    if cluster is not None:
        monkeypatch.setattr(cd, "cluster_size", lambda rows, kv_fp8: cluster)
    monkeypatch.setattr(cd, "STREAM_K_MIN_TILES", 0)     # every case on the balanced schedule
    if lens_kind == "ragged":
        lens = _ragged_lens(b)
    elif lens_kind == "one long":
        lens = [32768 if i == 3 else 1 + (37 * i) % 64 for i in range(b)]
    else:
        lens = [1024] * b
    q, kv, table, seqlens = check.make_case(lens, s_q, h, dtype, seed=b + h)
    c = cd.cluster_size(s_q * h, False)
    assert cd.persistent_clusters(b, s_q * h, False, False, c, q.device) > 0, "the case must run persistent"
    assert cd.STREAM_K
    ref = reference.mla_decode(q.double(), kv.double(), table, seqlens, check.SCALE)
    out, lse = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=1)
    ok, max_err, why = check.compare(out, lse, *ref)
    assert ok, f"max abs err {max_err:.2e}: {why}"
    out2, lse2 = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=1)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    monkeypatch.setattr(cd, "STREAM_K", False)
    out3, lse3 = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=1)
    ok, max_err, why = check.compare(out3, lse3, *ref)
    assert ok, f"tickets: max abs err {max_err:.2e}: {why}"


@pytest.mark.parametrize("b, s_q, h, dtype, num_splits", [
    (150, 1, 128, torch.bfloat16, 1),   # persistent, 2-CTA clusters
    (8, 2, 64, torch.float16, 1),       # grid
    (6, 1, 80, torch.bfloat16, 1),      # 80 rows: a full row block, then a partial one (row by row)
    (4, 1, 128, torch.bfloat16, 5),     # fp32 split partials
    (3, 2, 40, torch.float16, 3),       # 80 rows, split
])
def test_16_byte_stores_equal_the_accumulator_layout_stores(monkeypatch, b, s_q, h, dtype, num_splits):
    """O (or the fp32 split partials) stored 16 bytes at a time after a transpose within each quad (STORE_16B)
    gives the same bits as the accumulator's own 4- or 8-byte pairs, and passes the reference check."""
    lens = [1 + (389 * i) % 1500 for i in range(b)]
    q, kv, table, seqlens = check.make_case(lens, s_q, h, dtype, seed=b + h)
    out, lse = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=num_splits)
    monkeypatch.setattr(cd, "STORE_16B", False)
    out4, lse4 = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=num_splits)
    assert torch.equal(out, out4) and torch.equal(lse, lse4)
    assert_reference(out, lse, q, kv, table, seqlens)


@pytest.mark.parametrize("b, s_q, h, num_splits, min_tiles", [
    (8, 2, 64, 1, None),        # a grid (too few items to run persistent)
    (200, 1, 128, 1, None),     # persistent, tickets
    (150, 2, 128, 1, 0),        # persistent, stream-K (every case cut)
    (4, 1, 128, 4, None),       # split
])
def test_early_row_sums_give_the_same_bits(monkeypatch, b, s_q, h, num_splits, min_tiles):
    """EARLY_SUMS (each consumer's row sums published once final) against the exchange after both P Vs (the
    default): the same bits, on ragged lengths with empty and one-token requests."""
    if min_tiles is not None:
        monkeypatch.setattr(cd, "STREAM_K_MIN_TILES", min_tiles)
    lens = _ragged_lens(b)
    q, kv, table, seqlens = check.make_case(lens, s_q, h, torch.bfloat16, seed=b + s_q)
    out, lse = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=num_splits)
    monkeypatch.setattr(cd, "EARLY_SUMS", not cd.EARLY_SUMS)
    out2, lse2 = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=num_splits)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    assert_reference(out, lse, q, kv, table, seqlens)


SEESAW_SWITCHES = ("LAZY_RESCALE", "FOLD_SCALE", "TREE_MAX")


@pytest.mark.parametrize("switch", [*SEESAW_SWITCHES, "all"])
@pytest.mark.parametrize("b, s_q, h, num_splits, min_tiles, q_gain", [
    (8, 2, 64, 1, None, 1.0),      # a grid (too few items to run persistent), clusters of 2
    (8, 1, 64, 1, None, 4.0),      # a grid of single CTAs; logits 4x as wide, so that row maxima jump by > 2^8
    (200, 1, 128, 1, None, 4.0),   # persistent, tickets
    (150, 2, 128, 1, 0, 1.0),      # persistent, stream-K (every case cut)
    (4, 1, 128, 4, None, 4.0),     # split
])
def test_seesaw_switches_match_reference(monkeypatch, switch, b, s_q, h, num_splits, min_tiles, q_gain):
    """The seesaw consumers' switches (mla_decode.LAZY_RESCALE, FOLD_SCALE, TREE_MAX, and all three: the default),
    each on against all of them off, on ragged lengths with empty and one-token requests: each within the
    reference's tolerances; TREE_MAX alone only reorders the maxima (the same maxima), so it gives the bits of all
    off."""
    if min_tiles is not None:
        monkeypatch.setattr(cd, "STREAM_K_MIN_TILES", min_tiles)
    monkeypatch.setattr(cd, "SPEC_EXP", False)      # built on two of them; test_speculative_p_matches_reference
    for name in SEESAW_SWITCHES:
        monkeypatch.setattr(cd, name, False)
    lens = _ragged_lens(b)
    q, kv, table, seqlens = check.make_case(lens, s_q, h, torch.bfloat16, seed=b + s_q + int(q_gain))
    q = q * q_gain
    ref = reference.mla_decode(q.double(), kv.double(), table, seqlens, check.SCALE)
    out0, lse0 = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=num_splits)
    for name in SEESAW_SWITCHES if switch == "all" else (switch,):
        monkeypatch.setattr(cd, name, True)
    out, lse = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=num_splits)
    if switch == "TREE_MAX":
        assert torch.equal(out, out0) and torch.equal(lse, lse0)
    ok, max_err, why = check.compare(out, lse, *ref)
    assert ok, f"{switch}: max abs err {max_err:.2e}: {why}"


@pytest.mark.parametrize("b, s_q, h, num_splits, min_tiles, q_gain", [
    (8, 2, 64, 1, None, 1.0),      # a grid, clusters of 2
    (8, 1, 64, 1, None, 4.0),      # single CTAs; logits 4x as wide: maxima jump by > 2^8, the warps' slow path
    (200, 1, 128, 1, None, 4.0),   # persistent, tickets
    (150, 2, 128, 1, 0, 1.0),      # persistent, stream-K (every case cut)
    (4, 1, 128, 4, None, 4.0),     # split
])
def test_speculative_p_matches_reference(monkeypatch, b, s_q, h, num_splits, min_tiles, q_gain):
    """mla_decode.SPEC_EXP (P against the running max before the tile's max is known, redone in warps whose lazy
    max moves) on top of the default switches: within the reference's tolerances on ragged lengths with empty and
    one-token requests (NaN-poisoned unused slots), and close to the default kernel (the same P; only the row sums'
    order of addition differs)."""
    if min_tiles is not None:
        monkeypatch.setattr(cd, "STREAM_K_MIN_TILES", min_tiles)
    for name in SEESAW_SWITCHES:
        monkeypatch.setattr(cd, name, True)
    lens = _ragged_lens(b)
    q, kv, table, seqlens = check.make_case(lens, s_q, h, torch.bfloat16, seed=3 * b + s_q + int(q_gain))
    q = q * q_gain
    monkeypatch.setattr(cd, "SPEC_EXP", False)
    out0, lse0 = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=num_splits)
    monkeypatch.setattr(cd, "SPEC_EXP", True)
    out, lse = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=num_splits)
    assert_reference(out, lse, q, kv, table, seqlens)
    torch.testing.assert_close(out.float(), out0.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, lse0, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("b, s_q, h, num_splits, min_tiles, parts", [
    (8, 1, 64, 1, None, 3),           # a grid of single CTAs
    (8, 2, 64, 1, None, 3),           # a grid, clusters of 2 (each CTA multicasts its rows of every part)
    (5, 1, 16, 1, None, 3),           # 16 heads padded to a 64-row tile
    (200, 1, 128, 1, None, 3),        # persistent, tickets
    (150, 2, 128, 1, 0, 3),           # persistent, stream-K (every case cut)
    (4, 1, 128, 4, None, 3),          # split
    (8, 2, 64, 1, None, 9),           # one part a 64-column piece (FlashMLA's granularity), clusters of 2
    (200, 1, 128, 1, None, 9),        # ... persistent
])
def test_kv_parts_match_reference(monkeypatch, b, s_q, h, num_splits, min_tiles, parts):
    """mla_decode.KV_PARTS = 3 or 9 (each page as column parts on barriers of their own, S issued part by part
    as they land): within the reference's tolerances on ragged lengths with empty and one-token requests
    (NaN-poisoned unused slots), and the same bits as one barrier a page (the k-blocks accumulate in the same
    order)."""
    q, kv, table, seqlens = _ragged_case(monkeypatch, b, s_q, h, min_tiles, seed=5 * b + s_q)
    monkeypatch.setattr(cd, "KV_SPLIT", False)      # KV_PARTS's ring at every row count
    _assert_same_bits(monkeypatch, "KV_PARTS", 1, parts, q, kv, table, seqlens, num_splits)


@pytest.mark.parametrize("b, s_q, h, num_splits, min_tiles", [
    (8, 1, 64, 1, None),           # a grid of single CTAs
    (8, 2, 64, 1, None),           # a grid, clusters of 2 (each CTA multicasts its rows of every box)
    (5, 3, 16, 1, None),           # 16 heads padded to a 64-row tile, s_q 3
    (200, 1, 128, 1, None),        # persistent
    (150, 2, 128, 1, -1),          # persistent, tickets (STREAM_K off), 256 rows (the default there): pad tiles
    (150, 2, 128, 1, 0),           # persistent, stream-K (every case cut)
    (4, 1, 128, 4, None),          # split
])
def test_kv_split_match_reference(monkeypatch, b, s_q, h, num_splits, min_tiles):
    """mla_decode.KV_SPLIT (each page as its rope columns and V's two halves, each freed by the consumer that reads
    it last; S(t) issued before the wait for the other consumer's P(t-1)): within the reference's tolerances on
    ragged lengths with empty and one-token requests (NaN-poisoned unused slots), and close to the kernel without it
    (S's k-blocks accumulate in another order); at every row count, not only from KV_SPLIT_MIN_ROWS. Persistent
    ticket launches (min_tiles -1: STREAM_K off) give the same bits with the requests taken in batch order: which
    consumer owns a tile then changes, and S must not depend on it."""
    q, kv, table, seqlens = _ragged_case(monkeypatch, b, s_q, h, min_tiles, seed=7 * b + s_q)
    monkeypatch.setattr(cd, "KV_SPLIT", False)
    out0, lse0 = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=num_splits)
    monkeypatch.setattr(cd, "KV_SPLIT", True)
    monkeypatch.setattr(cd, "KV_SPLIT_MIN_ROWS", 0)
    out, lse = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=num_splits)
    assert_reference(out, lse, q, kv, table, seqlens)
    torch.testing.assert_close(out.float(), out0.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, lse0, rtol=1e-4, atol=1e-4)
    if min_tiles == -1:
        c = cd.cluster_size(s_q * h, False)
        assert cd.persistent_clusters(b, s_q * h, False, False, c, q.device) > 0, "the case must run persistent"
        monkeypatch.setattr(cd, "LONGEST_FIRST", False)
        out2, lse2 = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=num_splits)
        assert torch.equal(out, out2) and torch.equal(lse, lse2)


@pytest.mark.parametrize("b, s_q, h, num_splits, min_tiles, ahead, ring", [
    (8, 1, 64, 1, None, 1, "parts"),        # a grid of single CTAs, the page about to be loaded
    (8, 2, 64, 1, None, 2, "split"),        # a grid, clusters of 2, a page ahead of it
    (200, 1, 64, 1, -1, 2, "parts"),        # persistent (200 items), tickets, 64 rows
    (200, 1, 128, 1, -1, 1, "parts"),       # persistent, tickets, 128 rows
    (200, 1, 128, 1, -1, 2, "split"),       # ... on KV_SPLIT's ring (the default there)
    (150, 2, 128, 1, -1, 2, "split"),       # persistent, tickets, 256 rows (pad tiles)
    (150, 2, 128, 1, 0, 1, "split"),        # persistent, stream-K
    (4, 1, 128, 4, None, 3, "split"),       # split
    (4, 1, 128, 4, None, 2, "parts"),       # ... on KV_PARTS's ring
])
def test_kv_prefetch_gives_the_same_bits(monkeypatch, b, s_q, h, num_splits, min_tiles, ahead, ring):
    """mla_decode.KV_PREFETCH and KV_PARTS_PREFETCH (the producer's TMA prefetches of the pages ahead into L2 on
    KV_SPLIT's and KV_PARTS's rings, no barrier): within the reference's tolerances on ragged lengths with empty and
    one-token requests (NaN-poisoned unused slots), and the same bits as without, in every launch form (min_tiles
    -1: STREAM_K off)."""
    q, kv, table, seqlens = _ragged_case(monkeypatch, b, s_q, h, min_tiles, seed=11 * b + s_q)
    if ring == "split":
        monkeypatch.setattr(cd, "KV_SPLIT_MIN_ROWS", 0)
        name = "KV_PREFETCH"
    else:
        monkeypatch.setattr(cd, "KV_SPLIT", False)
        name = "KV_PARTS_PREFETCH"
    _assert_same_bits(monkeypatch, name, 0, ahead, q, kv, table, seqlens, num_splits)


@pytest.mark.parametrize("h, s_q, fp8", [(16, 1, False), (64, 1, False), (16, 1, True), (16, 2, True),
                                         (64, 1, True)])
def test_balanced_splits_match_reference(monkeypatch, h, s_q, fp8):
    """decode_plan.BALANCE_SPLITS_MAX_ROWS (64 here): a one-wave step of <= 64-row requests of varied lengths
    (4096 +- 50%), planned with its host lengths, runs as two splits a request (the 16-bit kernels, the f16-register
    FP8 kernel and the FP8 seesaw, split), NaN-poisoned unused slots: within the reference's tolerances.
    FP8: the reference on the values each kernel multiplies, the cache's exact entries where the f16-register kernel
    runs (it rounds each e4m3 * scale to f16), else the entries dequantized to bf16 (the seesaw's ring). At
    h16 s_q2 the two references differ by more than the tolerance at 2 of 2 M outputs (bench/NOTES.md 134)."""
    monkeypatch.setattr(decode_plan, "BALANCE_SPLITS_MAX_ROWS", 64)
    b = min(128, torch.cuda.get_device_properties(0).multi_processor_count)
    gen = torch.Generator().manual_seed(h + s_q + fp8)
    lens = (4096 + (torch.rand(b, generator=gen) * 2 - 1) * 2048).long().tolist()
    if fp8:
        q, kv, table, seqlens = check.make_fp8_case(lens, s_q, h, seed=h + s_q)
    else:
        q, kv, table, seqlens = check.make_case(lens, s_q, h, torch.bfloat16, seed=h + s_q)
    plan = cd.plan_mla_decode(b, s_q, h, 512, table.shape[1], 64, fp8, q.device, seqlens=lens)
    assert plan.num_splits == 2
    if not fp8:
        ref = reference.mla_decode(q.double(), kv.double(), table, seqlens, check.SCALE)
    elif cd.uses_fp8_f16(True, s_q * h, table.shape[1], plan.num_splits):
        ref = check.fp8_exact_reference(q, kv, table, seqlens)
    else:
        ref = check.fp8_reference(q, kv, table, seqlens)
    out, lse = cd.mla_decode(q, kv, table, seqlens, check.SCALE, plan=plan)
    ok, max_err, why = check.compare(out, lse, *ref)
    assert ok, f"max abs err {max_err:.2e}: {why}"


@pytest.mark.parametrize("b, h, s_q, fp8, fp8_mma, split", [
    (128, 16, 1, False, False, True), (128, 32, 1, False, False, True), (128, 64, 1, False, False, True),
    (128, 16, 1, True, True, True), (128, 16, 1, True, False, True), (128, 32, 1, True, False, True),
    (128, 64, 1, True, False, True), (200, 16, 1, True, True, False), (200, 16, 2, True, False, False),
])
def test_ordered_grids_equal_batch_order(monkeypatch, b, h, s_q, fp8, fp8_mma, split):
    """mla_decode.GRID_ORDER_ALL: grids of more than one wave (split in two by the host lengths, or more requests
    than SMs; 16-bit KV takes persistent launches there) take their requests longest first, the order in lse's place
    (split) or partial out's: the 16-bit grid, the FP8-MMA, keys-on-M (n 16, 32) and FP8 seesaw kernels. Varied
    lengths (empty and one-token requests among them), NaN-poisoned slots: the reference's tolerances, and the bits
    of the launch in batch order."""
    monkeypatch.setattr(decode_plan, "BALANCE_SPLITS_MAX_ROWS", 64 if split else 0)
    monkeypatch.setattr(cd, "uses_fp8_mma", lambda kv_fp8, rows, max_pages, num_splits:
                        fp8_mma and kv_fp8 and cd.fp8_narrow_cols(rows) == 16)
    gen = torch.Generator().manual_seed(b + h + s_q)
    lens = [(0, 1, 64, 65)[i] if i < 4 else int(x) for i, x in
            enumerate(4096 + (torch.rand(b, generator=gen) * 2 - 1) * 2048)]
    if fp8:
        q, kv, table, seqlens = check.make_fp8_case(lens, s_q, h, seed=b + h)
    else:
        q, kv, table, seqlens = check.make_case(lens, s_q, h, torch.bfloat16, seed=b + h)
    plan = cd.plan_mla_decode(b, s_q, h, 512, table.shape[1], 64, fp8, q.device, seqlens=lens)
    if not fp8:
        ref = reference.mla_decode(q.double(), kv.double(), table, seqlens, check.SCALE)
    elif fp8_mma or cd.uses_fp8_f16(True, s_q * h, table.shape[1], plan.num_splits):
        ref = check.fp8_exact_reference(q, kv, table, seqlens)   # the kernels that multiply the exact entries
    else:
        ref = check.fp8_reference(q, kv, table, seqlens)
    assert plan.num_splits == (2 if split else 1)
    tiles = 1 if fp8 and cd.fp8_narrow_cols(s_q * h) else -(-s_q * h // 64)
    assert cd.grid_order(seqlens, b * tiles, plan.num_splits) is not None, "the case must run ordered"
    monkeypatch.setattr(cd, "GRID_ORDER_ALL", True)
    out, lse = cd.mla_decode(q, kv, table, seqlens, check.SCALE, plan=plan)
    ok, max_err, why = check.compare(out, lse, *ref)
    assert ok, f"max abs err {max_err:.2e}: {why}"
    monkeypatch.setattr(cd, "GRID_ORDER_ALL", False)
    out2, lse2 = cd.mla_decode(q, kv, table, seqlens, check.SCALE, plan=plan)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


@pytest.mark.parametrize("b, s_q, h, num_splits", [(8, 1, 128, 1), (5, 1, 80, 1), (4, 1, 128, 4), (3, 1, 80, 3)])
def test_fp8_16_byte_stores_equal_value_stores(monkeypatch, b, s_q, h, num_splits):
    """The FP8 seesaw's 16-byte stores (of O or the fp32 split partials): the same bits as its pairs
    (80 rows: a full block, then a partial one)."""
    lens = [1 + (389 * i) % 1500 for i in range(b)]
    q, packed, table, seqlens = check.make_fp8_case(lens, s_q, h, seed=b + h)
    out, lse = cd.mla_decode(q, packed, table, seqlens, check.SCALE, num_splits=num_splits)
    monkeypatch.setattr(cd, "STORE_16B", False)
    out1, lse1 = cd.mla_decode(q, packed, table, seqlens, check.SCALE, num_splits=num_splits)
    assert torch.equal(out, out1) and torch.equal(lse, lse1)
    ok, max_err, why = check.compare(out, lse, *check.fp8_reference(q, packed, table, seqlens))
    assert ok, f"max abs err {max_err:.2e}: {why}"


@pytest.mark.parametrize("b, s_q, h, num_splits, causal, q_gain", [
    (8, 1, 128, 1, True, 1.0),      # two row blocks a request
    (8, 1, 128, 1, True, 4.0),      # logits 4x as wide: the lazy max's slow path
    (5, 1, 80, 1, True, 1.0),       # a full block, then a partial one
    (6, 2, 64, 1, True, 1.0),       # s_q 2: causal among the new tokens
    (3, 3, 64, 1, False, 4.0),      # s_q 3, not causal
    (4, 1, 128, 4, True, 1.0),      # split partials, splits past a request's end
    (150, 1, 64, 1, True, 1.0),     # more CTAs than SMs: the grid in longest-first order
])
def test_fp8_seesaw_matches_reference(b, s_q, h, num_splits, causal, q_gain):
    """The FP8 seesaw (FP8 pages through the register-path loader into the seesaw consumers' bf16 ring): within the
    reference's tolerances on ragged lengths (an empty request, one token, page edges, 0xFF-poisoned unused slots)."""
    q, packed, table, seqlens = check.make_fp8_case(_ragged_lens(b), s_q, h, seed=7 * b + h + s_q + int(q_gain))
    q = q * q_gain
    out, lse = cd.mla_decode(q, packed, table, seqlens, check.SCALE, causal=causal, num_splits=num_splits)
    ok, max_err, why = check.compare_fp8(out, lse, q, packed, table, seqlens, causal)
    assert ok, f"max abs err {max_err:.2e}: {why}"


@pytest.mark.parametrize("lens, s_q, h, num_splits", [
    ([8192] * 4, 1, 64, 1),                        # 128 pages a CTA: every stage and register group reused
    ([1, 2, 63, 64, 65, 4096] + [1 + (389 * i) % 4096 for i in range(58)], 1, 128, None),
    ([3000, 17, 64, 2000], 2, 64, 3),              # s_q 2, split partials
    ([4100, 4033], 1, 96, None),                   # 96 rows: a full row block and a half one
], ids=lambda v: str(v) if not isinstance(v, list) else f"b{len(v)}")
def test_fp8_seesaw_long_requests_match_reference(lens, s_q, h, num_splits):
    """The FP8 seesaw on requests of many pages (the loader's loads run across pages, a request's last pages
    partial): within the reference's tolerances."""
    q, packed, table, seqlens = check.make_fp8_case(lens, s_q, h, seed=len(lens) + h)
    out, lse = cd.mla_decode(q, packed, table, seqlens, check.SCALE, num_splits=num_splits)
    ok, max_err, why = check.compare_fp8(out, lse, q, packed, table, seqlens, True)
    assert ok, f"max abs err {max_err:.2e}: {why}"


@pytest.mark.parametrize("lens, s_q, h, num_splits", [
    ([8192] * 4, 1, 64, 1),                        # 128 pages a CTA: the smem ring of entries reused 8 times
    ([1, 2, 63, 64, 65, 400, 513, 1025] + [1 + (389 * i) % 4096 for i in range(56)], 1, 128, None),
    ([3000, 17, 64, 2000], 2, 64, 3),              # s_q 2, split partials (splits shorter than the copies' lead)
    ([0, 129, 4100], 1, 96, 2),                    # an empty request, 96 rows
], ids=lambda v: str(v) if not isinstance(v, list) else f"b{len(v)}")
def test_fp8_seesaw_block_table_in_smem_gives_the_same_bits(monkeypatch, lens, s_q, h, num_splits):
    """mla_decode.FP8_SEESAW_BT_SMEM (the loader's block-table entries copied by cp.async into a ring in smem, 8
    pages ahead, instead of read from global memory at each page's start): the same pages, so the same bits, on
    requests of 0 to 128 pages with 0xFF-poisoned unused slots; and within the reference's tolerances."""
    q, packed, table, seqlens = check.make_fp8_case(lens, s_q, h, seed=3 * len(lens) + h)
    monkeypatch.setattr(cd, "FP8_SEESAW_BT_SMEM", False)
    out0, lse0 = cd.mla_decode(q, packed, table, seqlens, check.SCALE, num_splits=num_splits)
    monkeypatch.setattr(cd, "FP8_SEESAW_BT_SMEM", True)
    out, lse = cd.mla_decode(q, packed, table, seqlens, check.SCALE, num_splits=num_splits)
    ok, max_err, why = check.compare_fp8(out, lse, q, packed, table, seqlens, True)
    assert ok, f"max abs err {max_err:.2e}: {why}"
    assert torch.equal(out, out0) and torch.equal(lse, lse0), "FP8_SEESAW_BT_SMEM changed the bits"


@pytest.mark.parametrize("b, h, num_splits", [(4, 128, None), (2, 16, 5), (64, 64, 1), (200, 128, 1)])
def test_cuda_graph_replay_equals_eager(b, h, num_splits):
    lens = [1 + (977 * i) % 3000 for i in range(b)]
    q, kv, table, seqlens = check.make_case(lens, 1, h, torch.bfloat16, seed=b)
    plan = cd.plan_mla_decode(b, 1, h, 512, table.shape[1], 64, False, q.device, num_splits=num_splits)
    _replay_equals_eager_and_reference(
        q, kv, table, seqlens, plan,
        lambda: reference.mla_decode(q.double(), kv.double(), table, seqlens, check.SCALE))


def _replay_equals_eager_and_reference(q, kv, table, seqlens, plan, reference_fn):
    """Capture one call, then give it new queries and shorter lengths in the same buffers: the replay must
    follow them (the slots the shorter lengths give up hold real values now, so only the mask keeps them
    out), equal an eager call bit for bit and pass the reference check."""
    cd.mla_decode(q, kv, table, seqlens, check.SCALE, plan=plan)        # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = cd.mla_decode(q, kv, table, seqlens, check.SCALE, plan=plan)
    q.copy_(torch.randn_like(q))
    seqlens.copy_((seqlens - 37).clamp_min(1))
    graph.replay()
    torch.cuda.synchronize()
    e_out, e_lse = cd.mla_decode(q, kv, table, seqlens, check.SCALE, plan=plan)
    assert torch.equal(g_out, e_out) and torch.equal(g_lse, e_lse)
    ok, max_err, why = check.compare(g_out, g_lse, *reference_fn())
    assert ok, f"max abs err {max_err:.2e}: {why}"


# -- FP8 KV (uint8 [pages, 64, 656]; unused slots 0xFF): the same shapes against the reference on the
# cache's values, and a graph replay --

@pytest.mark.parametrize("case", list(check.fp8_cases(quick=False)),
                         ids=lambda c: f"fp8-b{len(c['lens'])}-sq{c['s_q']}-h{c['h']}"
                                       f"-causal{c['causal']}-splits{c.get('num_splits')}")
def test_fp8_matches_reference(case):
    q, kv, table, seqlens = check.make_fp8_case(case["lens"], case["s_q"], case["h"], seed=len(case["lens"]))
    out, lse = cd.mla_decode(q, kv, table, seqlens, check.SCALE, causal=case["causal"],
                             num_splits=case.get("num_splits"))
    ok, max_err, why = check.compare_fp8(out, lse, q, kv, table, seqlens, case["causal"])
    assert ok, f"max abs err {max_err:.2e}: {why}"


def _fp8_mma_for_every_split(monkeypatch):
    """The FP8-MMA kernel for every FP8 step of <= 16 rows, however short its splits (mla_decode.uses_fp8_mma), and
    not the f16-register kernel that takes the long ones by default (FP8_F16)."""
    monkeypatch.setattr(cd, "FP8_F16", False)
    monkeypatch.setattr(cd, "uses_fp8_mma", lambda kv_fp8, rows, max_pages, num_splits:
                        kv_fp8 and cd.fp8_narrow_cols(rows) == 16)


@pytest.mark.parametrize("s_q, h, fp8_mma", [(2, 64, False), (1, 16, True), (1, 128, False)],
                         ids=["fp8_seesaw_sq2", "fp8_mma", "fp8_seesaw"])
def test_fp8_cuda_graph_replay_equals_eager(monkeypatch, s_q, h, fp8_mma):
    """A captured FP8 step (the seesaw on the register-path loader; the FP8-MMA kernel, taken for every split,
    against the exact entries)."""
    if fp8_mma:
        _fp8_mma_for_every_split(monkeypatch)
    b = 4
    lens = [1 + (977 * i) % 3000 for i in range(b)]
    q, kv, table, seqlens = check.make_fp8_case(lens, s_q, h, seed=b)
    plan = cd.plan_mla_decode(b, s_q, h, 512, table.shape[1], 64, True, q.device, num_splits=3)
    reference_fn = check.fp8_exact_reference if fp8_mma else check.fp8_reference
    _replay_equals_eager_and_reference(q, kv, table, seqlens, plan, lambda: reference_fn(q, kv, table, seqlens))


_LONG = [1, 2, 63, 64, 65, 4096] + [1 + (389 * i) % 4096 for i in range(122)]


@pytest.mark.parametrize("lens, s_q, h, causal, num_splits", [
    ([1, 63, 64, 4096], 1, 16, True, None),
    ([2, 65, 1000, 129], 2, 8, True, None),
    ([777], 3, 5, True, None),                     # 15 rows, odd heads
    ([5, 300, 64, 1], 1, 16, False, None),
    ([3000, 17, 64, 2000], 1, 16, True, 4),        # split-KV partials
    ([0, 1, 2], 2, 8, True, 3),                    # an empty request, splits past the end
    (_LONG, 1, 16, True, None),
    ([8192] * 8, 1, 16, True, 1),                  # 128 pages a CTA: every stage reused many times
], ids=lambda v: str(v) if not isinstance(v, list) else f"b{len(v)}")
def test_fp8_mma_kernel_matches_reference(monkeypatch, lens, s_q, h, causal, num_splits):
    """The <= 16-row kernel with FP8 wgmma on the e4m3 bytes, taken for every split here, on
    NaN-poisoned unused slots, against the reference on the cache's exact entries (the scales applied in fp32, as
    triton's FP8-MMA kernel)."""
    q, kv, table, seqlens = check.make_fp8_case(lens, s_q, h, seed=len(lens) + h)
    _fp8_mma_for_every_split(monkeypatch)
    out, lse = cd.mla_decode(q, kv, table, seqlens, check.SCALE, causal=causal, num_splits=num_splits)
    ok, max_err, why = check.compare(out, lse, *check.fp8_exact_reference(q, kv, table, seqlens, causal))
    assert ok, f"max abs err {max_err:.2e}: {why}"


@pytest.mark.parametrize("lens, s_q, h, num_splits", [
    ([1, 63, 64, 4096], 1, 16, None),
    ([777, 5], 3, 5, None),                        # 15 rows: the 16th reads a clamped row and zeroes it
    ([3000, 17, 64, 2000], 1, 16, 4),              # the fp32 split partials in pairs
    ([2, 65, 1000, 129], 2, 7, 3),
], ids=lambda v: str(v) if not isinstance(v, list) else f"b{len(v)}")
def test_fp8_mma_vector_io_equals_value_io(monkeypatch, lens, s_q, h, num_splits):
    """The FP8-MMA kernel's Q in 16-byte loads and O in pairs (mla_decode.FP8_MMA_VEC_IO): the same bits as its
    value-by-value loads and stores."""
    q, kv, table, seqlens = check.make_fp8_case(lens, s_q, h, seed=len(lens) + 3 * h)
    _fp8_mma_for_every_split(monkeypatch)
    monkeypatch.setattr(cd, "FP8_MMA_VEC_IO", True)
    out, lse = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=num_splits)
    monkeypatch.setattr(cd, "FP8_MMA_VEC_IO", False)
    out1, lse1 = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=num_splits)
    assert torch.equal(out, out1) and torch.equal(lse, lse1)
    ok, max_err, why = check.compare(out, lse, *check.fp8_exact_reference(q, kv, table, seqlens, True))
    assert ok, f"max abs err {max_err:.2e}: {why}"


@pytest.mark.parametrize("s_q, h", [(1, 128), (2, 64)])
def test_fp8_grid_of_several_waves_takes_requests_longest_first(monkeypatch, s_q, h):
    """More 64-row CTAs than SMs, unsplit, ragged lengths (empty and one-token requests among them): the FP8
    grid maps its request axis through the longest-first order; the result meets the reference and equals a
    launch in batch order bit for bit."""
    b = 150
    lens = _ragged_lens(b)
    q, kv, table, seqlens = check.make_fp8_case(lens, s_q, h, seed=b + h)
    assert cd.grid_order(seqlens, b * (s_q * h // 64), 1) is not None, "the case must run ordered"
    out, lse = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=1)
    ok, max_err, why = check.compare(out, lse, *check.fp8_reference(q, kv, table, seqlens))
    assert ok, f"max abs err {max_err:.2e}: {why}"
    monkeypatch.setattr(cd, "LONGEST_FIRST", False)
    out2, lse2 = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=1)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_traced_stream_k_launch_records_every_piece(monkeypatch):
    """A traced stream-K launch (mla_decode.TRACE): the same bits as untraced, and one trace row per piece and CTA
    with its SM and a start before its end (scripts/persistent_clusters_ab.py --trace reads them)."""
    from mlaserve.kernels.triton import stream_k
    monkeypatch.setattr(cd, "STREAM_K_MIN_TILES", 0)
    b, s_q, h = 150, 1, 128
    lens = [1 + (389 * i) % 1500 for i in range(b)]
    q, kv, table, seqlens = check.make_case(lens, s_q, h, torch.bfloat16, seed=7)
    out, lse = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=1)
    monkeypatch.setattr(cd, "TRACE", True)
    out_t, lse_t = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=1)
    assert torch.equal(out, out_t) and torch.equal(lse, lse_t)
    slots = cd.persistent_clusters(b, s_q * h, False, False, 2, q.device)
    sched = stream_k.reference_schedule(lens, 1, slots, cd.STREAM_K_OVERHEAD)
    n_pieces = sum(len(p) for p in stream_k.pieces(sched, slots, stream_k.item_tiles(lens, 1)))
    rows = cd.last_trace[2:].view(-1, cd.TRACE_FIELDS).cpu().to(torch.int64)
    written = rows[rows[:, 2] != 0]
    assert len(written) == 2 * n_pieces
    assert ((written[:, 2] - written[:, 1]) % (1 << 32) > 0).all()


@pytest.mark.parametrize("lens, s_q, h, causal, num_splits, q_gain", [
    ([1, 63, 64, 4096], 1, 16, True, None, 1.0),
    ([1, 63, 64, 4096], 1, 32, True, None, 1.0),
    ([2, 65, 1000, 129], 2, 16, True, None, 1.0),       # 32 rows, causal among the new tokens
    ([777], 3, 5, True, None, 1.0),                     # 15 rows, odd heads
    ([777, 3], 1, 20, True, None, 1.0),                 # 20 rows padded to 32
    ([5, 300, 64, 1], 1, 32, False, None, 1.0),
    ([3000, 17, 64, 2000], 1, 32, True, 4, 1.0),        # split-KV partials
    ([0, 1, 2], 2, 8, True, 3, 1.0),                    # an empty request, splits past the end
    (_LONG, 1, 32, True, None, 1.0),
    ([8192] * 8, 1, 16, True, 1, 1.0),                  # 128 pages a CTA: every stage reused many times
    ([5, 300, 64, 1, 2000], 1, 32, True, 1, 4.0),       # logits 4x as wide: maxima move by more past the first page
    ([3000, 17, 64, 2000], 1, 32, True, 4, 4.0),
    ([2, 65, 1000, 129], 2, 16, True, None, 4.0),
], ids=lambda v: str(v) if not isinstance(v, list) else f"b{len(v)}")
def test_fp8_f16_kernel_matches_reference(monkeypatch, lens, s_q, h, causal, num_splits, q_gain):
    """mla_decode.FP8_F16: the <= 32-row kernel that multiplies the pages' e4m3 bytes as f16 in registers, on
    NaN-poisoned unused slots (0xFF scales and bytes), against the reference on its reading of the entries (e4m3 *
    scale rounded to f16); at the check cases' logits also against the cache's exact entries and within rounding
    of the kernels it replaces (their bf16 reading), which wider logits take further apart."""
    q, kv, table, seqlens = check.make_fp8_case(lens, s_q, h, seed=len(lens) + 5 * h)
    q = q * q_gain
    monkeypatch.setattr(cd, "FP8_F16", True)
    monkeypatch.setattr(cd, "uses_fp8_f16", check.fp8_f16_any_split(cd))
    out, lse = cd.mla_decode(q, kv, table, seqlens, check.SCALE, causal=causal, num_splits=num_splits)
    ok, max_err, why = check.compare(out, lse, *check.fp8_f16_reference(q, kv, table, seqlens, causal))
    assert ok, f"against the f16 reading: max abs err {max_err:.2e}: {why}"
    if q_gain != 1.0:
        return      # the exact entries' reference misses the f16 reading by ~3e-3 in lse, the bf16 one's by ~4e-2
    ok, max_err, why = check.compare(out, lse, *check.fp8_exact_reference(q, kv, table, seqlens, causal))
    assert ok, f"against the exact entries: max abs err {max_err:.2e}: {why}"
    # the same within rounding as the kernels it would replace
    monkeypatch.setattr(cd, "FP8_F16", False)
    out0, lse0 = cd.mla_decode(q, kv, table, seqlens, check.SCALE, causal=causal, num_splits=num_splits)
    torch.testing.assert_close(out.float(), out0.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("lens, s_q, h, causal, num_splits, q_gain", [
    ([1, 63, 64, 4096], 1, 16, True, None, 1.0),
    ([777], 3, 5, True, None, 1.0),                     # 15 rows, odd heads
    ([3000, 17, 64, 2000], 1, 16, True, 4, 1.0),        # split-KV partials
    ([0, 1, 2], 2, 8, True, 3, 1.0),                    # an empty request, splits past the end
    ([8192] * 8, 1, 16, True, 1, 1.0),                  # 128 pages a CTA
    ([5, 300, 64, 1, 2000], 1, 16, True, 1, 4.0),       # logits 4x as wide
    ([5, 300, 64, 1, 2000], 1, 16, False, None, 4.0),
], ids=lambda v: str(v) if not isinstance(v, list) else f"b{len(v)}")
def test_fp8_f16_group_s_matches_the_exact_entries(monkeypatch, lens, s_q, h, causal, num_splits, q_gain):
    """mla_decode.FP8_F16_GROUP_S: the 16-row f16-register kernel's S^T from the exact e4m3 values, one accumulator
    per scale group scaled in fp32. K is then read exactly and only V through f16 (e4m3 * scale rounded once), whose
    error the logits do not widen: on NaN-poisoned unused slots, against the reference on the cache's exact entries
    at the wide logits too (where the f16 reading of K misses them by ~3e-3 in lse, bench/NOTES.md 144)."""
    q, kv, table, seqlens = check.make_fp8_case(lens, s_q, h, seed=len(lens) + 13 * h)
    q = q * q_gain
    monkeypatch.setattr(cd, "uses_fp8_f16", check.fp8_f16_any_split(cd))
    monkeypatch.setattr(cd, "FP8_F16_GROUP_S", True)
    out, lse = cd.mla_decode(q, kv, table, seqlens, check.SCALE, causal=causal, num_splits=num_splits)
    ref_out, ref_lse = check.fp8_exact_reference(q, kv, table, seqlens, causal)
    ok, max_err, why = check.compare(out, lse, ref_out, ref_lse)
    assert ok, f"against the exact entries: max abs err {max_err:.2e}: {why}"
    monkeypatch.setattr(cd, "FP8_F16_GROUP_S", False)
    out0, lse0 = cd.mla_decode(q, kv, table, seqlens, check.SCALE, causal=causal, num_splits=num_splits)
    seen = ref_lse.isfinite()
    err = (lse - ref_lse)[seen].abs().max().item() if seen.any() else 0.0
    err0 = (lse0 - ref_lse)[seen].abs().max().item() if seen.any() else 0.0
    assert err <= err0 + 1e-4, f"lse off the exact entries by {err:.2e} grouped, {err0:.2e} not"


@pytest.mark.parametrize("switch", ["FP8_EARLY_START", "FP8_SPLIT_EPILOGUE", "FP8_F16_STAGGER"])
@pytest.mark.parametrize("lens, s_q, h, num_splits", [
    ([1, 63, 64, 4096], 1, 16, 1),          # unsplit: the first pages' block-table entries read early
    ([1, 2], 1, 32, 1),                     # a two-column block table (the early reads of columns 2, 3 clamp)
    ([5, 300, 64, 1], 1, 32, None),
    ([2, 65, 1000, 129], 2, 16, None),      # 32 rows, causal among the new tokens
    ([3000, 17, 64, 2000], 1, 32, 4),       # split: Q's reads early, the entries after the length
    ([0, 1, 2], 2, 8, 3),                   # an empty request, splits past the end
    ([64 * (1 + i % 7) + i for i in range(100)], 1, 32, 2),  # a split grid of two waves: requests longest first
    ([64 * i + 1 + i % 64 for i in range(12)], 1, 16, None),  # 16 rows, 1-12 pages: each consumer's count odd, even
], ids=lambda v: str(v) if not isinstance(v, list) else f"b{len(v)}")
def test_fp8_f16_switches_give_the_same_bits(monkeypatch, switch, lens, s_q, h, num_splits):
    """The f16-register kernel's start and end switches, each on against off with the others at their defaults:
    mla_decode.FP8_EARLY_START (Q's reads ahead of the first page loads, and unsplit, those pages' block-table
    entries beside the request's length), FP8_SPLIT_EPILOGUE (both consumers merge and store half of O^T each;
    odd page counts leave consumer 1 one page fewer) and FP8_F16_STAGGER (each consumer's second page asked for
    once its first has landed). On NaN-poisoned unused slots, against the reference on the cache's exact entries,
    and the same bits as off."""
    q, kv, table, seqlens = check.make_fp8_case(lens, s_q, h, seed=len(lens) + 7 * h)
    monkeypatch.setattr(cd, "uses_fp8_f16", check.fp8_f16_any_split(cd))
    monkeypatch.setattr(cd, switch, False)
    out0, lse0 = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=num_splits)
    monkeypatch.setattr(cd, switch, True)
    out, lse = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=num_splits)
    ok, max_err, why = check.compare(out, lse, *check.fp8_exact_reference(q, kv, table, seqlens))
    assert ok, f"max abs err {max_err:.2e}: {why}"
    assert torch.equal(out, out0) and torch.equal(lse, lse0), f"{switch} changed the bits"


@pytest.mark.parametrize("h", [16, 32])
def test_fp8_f16_cuda_graph_replay_equals_eager(monkeypatch, h):
    """A captured step of the f16-register kernel, taken for every split, replays to eager's bits and meets the
    reference."""
    monkeypatch.setattr(cd, "uses_fp8_f16", check.fp8_f16_any_split(cd))
    b = 4
    lens = [1 + (977 * i) % 3000 for i in range(b)]
    q, kv, table, seqlens = check.make_fp8_case(lens, 1, h, seed=b + h)
    plan = cd.plan_mla_decode(b, 1, h, 512, table.shape[1], 64, True, q.device, num_splits=3)
    _replay_equals_eager_and_reference(q, kv, table, seqlens, plan,
                                       lambda: check.fp8_exact_reference(q, kv, table, seqlens))


@pytest.mark.parametrize("h", [16, 32])
def test_fp8_f16_trace_leaves_the_outputs_and_orders_the_phases(monkeypatch, h):
    """mla_decode.TRACE on the f16-register kernel (unsplit, batch order; scripts/fp8_f16_trace.py): the same bits as
    untraced, and each CTA's fields: its SM, its pages, and in each stamping thread's order start <= Q stored <=
    consumer 0's first page, each consumer's first page <= its loop's end <= its end, start ns <= end ns; each page's
    arrival (pages 0 and 1: the consumers' first pages') <= its end, after its consumer's previous page's end."""
    kmod = importlib.import_module("mlaserve.kernels.cutedsl.mla_decode_fp8_f16_kernel")
    monkeypatch.setattr(cd, "uses_fp8_f16", check.fp8_f16_any_split(cd))
    lens = [300, 4096, 129, 65, 1000]      # every request with pages for both consumers
    q, kv, table, seqlens = check.make_fp8_case(lens, 1, h, seed=h)
    out0, lse0 = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=1)
    monkeypatch.setattr(cd, "TRACE", True)
    out, lse = cd.mla_decode(q, kv, table, seqlens, check.SCALE, num_splits=1)
    assert torch.equal(out, out0) and torch.equal(lse, lse0)
    t = cd.last_trace.cpu().long()
    assert t.shape == (len(lens), kmod.TRACE_FIELDS)
    assert t[:, kmod.T_PAGES].tolist() == [-(-n // 64) for n in lens]
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    assert bool(((t[:, kmod.T_SM] >= 0) & (t[:, kmod.T_SM] < sms)).all())

    def after(a, b):       # clock b at or after clock a (32-bit, wrapping)
        return bool((((t[:, b] - t[:, a]) % 2 ** 32) < 2 ** 31).all())
    assert after(kmod.T_C0, kmod.T_Q) and after(kmod.T_Q, kmod.T_PAGE0) and after(kmod.T_NS0, kmod.T_NS1)
    for c in range(2):
        assert after(kmod.T_PAGE0 + c, kmod.T_LOOP + c) and after(kmod.T_LOOP + c, kmod.T_END + c)
    assert torch.equal(t[:, kmod.T_PAGES_AT:kmod.T_PAGES_AT + 3:2], t[:, kmod.T_PAGE0:kmod.T_PAGE0 + 2])
    for i, n in enumerate(lens):     # each page's arrival, then its end, after its consumer's previous page's end
        pages = [kmod.T_PAGES_AT + 2 * p for p in range(min(-(-n // 64), kmod.TRACE_PAGES))]
        for j, a in enumerate(pages):
            prev = a - 3 if j >= 2 else kmod.T_Q if j == 0 else None
            assert ((t[i, a + 1] - t[i, a]) % 2 ** 32) < 2 ** 31, (i, j)
            if prev is not None:
                assert ((t[i, a] - t[i, prev]) % 2 ** 32) < 2 ** 31, (i, j)
