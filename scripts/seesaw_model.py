"""A clock-by-clock model of the CuTe bf16 decode's seesaw (one CTA of a 2-CTA cluster, two consumer warpgroups, a
2-stage ring of 64-key pages), to compare consumer schedules before device time is spent on them.

Each consumer runs its program of the kernel's steps (mla_decode_kernel.py, _consume_item): wait for a page, issue a
wgmma group, wait for its groups, compute (the softmax, O's rescale), publish P, release a stage. The tensor cores
are one resource that the two consumers' running groups share evenly, each consumer's groups in issue order; a
stage's next page lands `load` clocks after both consumers released it.

Costs in clocks of one SM: S = Q K^T of a page 1152 (m64n64, K 576: 2.36 M MACs at 2048 a clock), a consumer's P V
half 512; `softmax` the owner's step d-e (mask, max, exp2, P to smem, fence, barrier); `rescale` O's 128 FMULs.
With softmax 650, rescale 150 the default schedule gives ~3.0 k clocks a tile, as the H200's traces measured
(bench/NOTES.md 54: 3.02 k against the 2.18 k floor of its wgmmas).

Its predictions against the H200 (bench/NOTES.md 93): the signs held for early S (a loss: 10-14% at 8 k-blocks,
where the model allowed a small gain if pages landed within ~1.2 k clocks) and for the lazy rescale (a gain:
0.8-2.3%, under the ~5% the model credits a rescale never run); the FMA-pipe exponentials it put at 1-2% ahead
measured 0.4-2.1% behind. Read its numbers as orderings to test, not as forecasts.

    python scripts/seesaw_model.py                       # the default against S's first k-blocks early
    python scripts/seesaw_model.py --softmax 500 --rescale 0 --load 800,1600
"""

import argparse
import itertools

S_CLOCKS = 1152
PV_CLOCKS = 512
K_BLOCKS = 36        # S's k-blocks (576 / 16)


def program(w: int, n_tiles: int, early: int, softmax: int, rescale: int):
    """Consumer w's steps over the tiles it owns (t % 2 == w) and the other's last tile, as in _consume_item's
    clustered form; `early` of S's K_BLOCKS k-blocks issued before the wait for the other's P (the kernel's
    S_EARLY_KBLOCKS switch, measured slower and removed: bench/NOTES.md 93, 96)."""
    s_early = S_CLOCKS * early / K_BLOCKS
    for t in range(w, n_tiles, 2):
        if early:
            yield "wait_page", t
            yield "issue", s_early
        if t > 0:
            yield "wait_p", t - 1
            if early:
                yield "wait_groups", 0        # ptxas waits for the early part before O's rescale (C7517)
            yield "compute", rescale
            yield "issue", PV_CLOCKS
        if not early:
            yield "wait_page", t
        if early < K_BLOCKS:
            yield "issue", S_CLOCKS - s_early
            yield "wait_groups", 1
        else:
            yield "wait_groups", 0
        if t > 0:
            yield "release", t - 1
        yield "wait_groups", 0
        yield "compute", softmax
        yield "publish", t
        yield "compute", rescale
        yield "issue", PV_CLOCKS
        yield "wait_groups", 0
        yield "release", t
    if (n_tiles - 1) % 2 != w:
        yield "wait_p", n_tiles - 1
        yield "compute", rescale
        yield "issue", PV_CLOCKS
        yield "wait_groups", 0
        yield "release", n_tiles - 1


def _run(progs, waiting, record, limit: int):
    """The clock loop of both schedules: each consumer runs its program's steps until one blocks (`waiting(w, op,
    arg, clock)` for the schedule's own waits, or its issued groups); `record(w, op, arg, clock)` takes its publish
    and release steps. The tensor cores are shared evenly by the consumers whose groups are queued, each
    consumer's groups in issue order. -> (clocks, clocks the tensor cores were busy)."""
    step = [next(p, None) for p in progs]
    queue = [[], []]               # each consumer's issued groups: work left, in issue order
    busy = [0, 0]                  # a consumer computes until this clock
    clock = tensor = 0
    while step[0] is not None or step[1] is not None or queue[0] or queue[1]:
        for w in (0, 1):
            while step[w] is not None and busy[w] <= clock:
                op, arg = step[w]
                if op == "wait_groups":
                    if len(queue[w]) > arg:
                        break
                elif op.startswith("wait_"):
                    if waiting(w, op, arg, clock):
                        break
                elif op == "compute":
                    busy[w] = clock + arg
                elif op == "issue":
                    queue[w].append(arg)
                else:
                    record(w, op, arg, clock)
                step[w] = next(progs[w], None)
        running = [w for w in (0, 1) if queue[w]]
        if running:
            tensor += 1
            for w in running:
                queue[w][0] -= 1 / len(running)
                if queue[w][0] <= 1e-9:
                    queue[w].pop(0)
        clock += 1
        if clock > limit:
            raise RuntimeError("the schedule deadlocks")
    return clock, tensor


def simulate(n_tiles: int = 64, early: int = 0, softmax: int = 650, rescale: int = 150, load: int = 1400):
    """-> (clocks for n_tiles tiles, clocks the tensor cores were busy)."""
    released = {}                  # (tile, consumer) -> clock
    published = {}                 # tile -> clock its P was published

    def landed(t):
        if t < 2:
            return load
        both = [released.get((t - 2, w)) for w in (0, 1)]
        return None if None in both else max(both) + load

    def waiting(w, op, arg, clock):
        if op == "wait_page":
            return landed(arg) is None or landed(arg) > clock
        return published.get(arg, clock + 1) > clock          # wait_p

    def record(w, op, arg, clock):
        if op == "publish":
            published[arg] = clock
        else:
            released[(arg, w)] = clock

    return _run([program(w, n_tiles, early, softmax, rescale) for w in (0, 1)], waiting, record,
                1000 * n_tiles * (S_CLOCKS + 2 * PV_CLOCKS))


PARTS = {"h0": 16, "h1": 16, "rope": 4}     # KV_SPLIT's parts of a page, in S's k-blocks


def pair_program(w: int, n_tiles: int, softmax: int, rescale: int, store_p: int):
    """Consumer w's steps in FlashMLA's pair schedule (bench/NOTES.md 112) on KV_SPLIT's ring: consumer 0 owns the
    even tiles a, consumer 1 the odd tiles b = a + 1. The owner of a publishes its max before its own P V, and its P
    only once rescaled to b's max; consumer 1's softmax(b) waits for a's max alone, and its P V of a comes after it.
    Each consumer issues S of its next tile behind its P Vs, so one consumer's S runs during the other's softmax.
    Each P lies in its tile's rope columns (read by S, then free): the rope is freed by the other consumer after its
    P V of that P; V's half w by consumer w after its last P V of the tile."""
    def issue_s(t):
        for part in ("h0", "h1", "rope"):   # the halves first: the rope is freed last
            yield "wait_part", (t, part)
            yield "issue", S_CLOCKS * PARTS[part] / K_BLOCKS

    if w < n_tiles:
        yield from issue_s(w)
    for t in range(w, n_tiles, 2):
        if w == 0:
            yield "wait_groups", 0
            yield "compute", softmax + rescale      # O_0 to m(a) folded in, as the softmax's alpha
            yield "publish", ("m", t)
            yield "issue", PV_CLOCKS
            yield "wait_groups", 0
            yield "release", (t, "h0")
            if t + 1 < n_tiles:
                yield "wait_event", ("m", t + 1)
            yield "compute", store_p               # P(a) scaled to m(b), to smem
            yield "publish", ("p", t)
            if t + 1 < n_tiles:
                yield "wait_event", ("p", t + 1)
                yield "compute", rescale
                yield "issue", PV_CLOCKS
            if t + 2 < n_tiles:
                yield from issue_s(t + 2)
            if t + 1 < n_tiles:
                yield "wait_groups", 1 if t + 2 < n_tiles else 0
                yield "release", (t + 1, "h0")
                yield "release", (t + 1, "rope")
        else:
            yield "wait_event", ("m", t - 1)
            yield "wait_groups", 0
            yield "compute", softmax + rescale      # O_1 to m(b): both scales in one
            yield "publish", ("m", t)
            yield "compute", store_p
            yield "publish", ("p", t)
            yield "issue", PV_CLOCKS
            yield "wait_event", ("p", t - 1)
            yield "issue", PV_CLOCKS
            yield "wait_groups", 1
            yield "release", (t, "h1")
            yield "wait_groups", 0
            yield "release", (t - 1, "h1")
            yield "release", (t - 1, "rope")
            if t + 2 < n_tiles:
                yield from issue_s(t + 2)
    if w == 1 and n_tiles % 2 == 1:
        # the lone last tile is consumer 0's: its P (not rescaled further) into this half
        a = n_tiles - 1
        yield "wait_event", ("m", a)
        yield "compute", rescale
        yield "wait_event", ("p", a)
        yield "issue", PV_CLOCKS
        yield "wait_groups", 0
        yield "release", (a, "h1")
        yield "release", (a, "rope")


def simulate_pairs(n_tiles: int = 64, softmax: int = 650, rescale: int = 150, load: int = 1400,
                   store_p: int = 100):
    """pair_program's clocks, as simulate's: -> (clocks for n_tiles tiles, clocks the tensor cores were busy). A
    part of tile t lands `load` clocks after the part of tile t - 2 in its stage was freed."""
    released = {}                  # (tile, part) -> clock
    events = {}                    # ("m" | "p", tile) -> clock

    def landed(t, part):
        if t < 2:
            return load
        r = released.get((t - 2, part))
        return None if r is None else r + load

    def waiting(w, op, arg, clock):
        if op == "wait_part":
            return landed(*arg) is None or landed(*arg) > clock
        return events.get(arg, clock + 1) > clock             # wait_event

    def record(w, op, arg, clock):
        (events if op == "publish" else released)[arg] = clock

    return _run([pair_program(w, n_tiles, softmax, rescale, store_p) for w in (0, 1)], waiting, record,
                1000 * n_tiles * (S_CLOCKS + 2 * PV_CLOCKS))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiles", type=int, default=64)
    ap.add_argument("--softmax", default="500,650,800", help="comma list of softmax clocks")
    ap.add_argument("--rescale", default="150", help="comma list of O-rescale clocks")
    ap.add_argument("--load", default="800,1200,1600,2000", help="comma list: release to landed page, clocks")
    ap.add_argument("--early", default="8,12,16,24,36", help="comma list of early k-block counts to compare with 0")
    ap.add_argument("--pairs", action="store_true", help="also FlashMLA's pair schedule (pair_program)")
    a = ap.parse_args()
    ints = lambda s: [int(x) for x in s.split(",")]   # noqa: E731
    print(f"clocks a tile (tensor-core busy share); the wgmma floor is {S_CLOCKS + 2 * PV_CLOCKS}")
    for softmax, rescale, load in itertools.product(ints(a.softmax), ints(a.rescale), ints(a.load)):
        base, busy = simulate(a.tiles, 0, softmax, rescale, load)
        row = f"softmax {softmax:4d} rescale {rescale:3d} load {load:4d}: default {base / a.tiles:5.0f} ({busy / base:.0%})"
        for early in ints(a.early):
            t, _ = simulate(a.tiles, early, softmax, rescale, load)
            row += f"  early {early} {t / a.tiles:5.0f} ({base / t:.3f}x)"
        if a.pairs:
            t, busy = simulate_pairs(a.tiles, softmax, rescale, load)
            row += f"  pairs {t / a.tiles:5.0f} ({base / t:.3f}x, {busy / t:.0%})"
        print(row)


if __name__ == "__main__":
    main()
