"""Where the f16-register FP8 kernel's CTAs spend a call: each CTA's phase clocks (mla_decode.TRACE), summarized
per shape over a few eager calls, each after an L2 flush.

    PYTHONPATH=. python3 scripts/fp8_f16_trace.py [--shapes "b128 h16 sk4096,b128 h32 sk4096"] [--reps 5]
        [--set FP8_SPLIT_EPILOGUE=0 ...]       (mla_decode module flags, set before anything compiles)
        [--by-sm]                              (each SM's CTA time, and whether it repeats from call to call)

Per shape (FP8 KV, s_q 1, every request the same length, unsplit): the SM clock (a CTA's clocks over its
nanoseconds), how late the CTAs start after the first (median / max), and the medians and maxima over CTAs of
(us): start -> Q stored, start -> each consumer's first page, each consumer's page loop, each consumer's end
(merge, stores), and the whole CTA; then the call's span (first start to last end). Then, from the first
kmod.TRACE_PAGES pages' stamps, each page's compute (its arrival to its products' end, in its consumer) and wait
(the consumer's previous page's end to this page's arrival): pages 0-5, the median page between, the last two, and
each consumer's sums over its pages.
"""

import argparse
import importlib
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
cd = importlib.import_module("mlaserve.kernels.cutedsl.mla_decode")
kmod = importlib.import_module("mlaserve.kernels.cutedsl.mla_decode_fp8_f16_kernel")
_spec = importlib.util.spec_from_file_location("cutedsl_check", Path(__file__).with_name("cutedsl_check.py"))
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)


def parse_shape(text: str) -> tuple[int, int, int]:
    """"b128 h32 sk4096" -> (b, h, s_k)."""
    vals = {part[:1] if part[0] in "bh" else "sk": int(part.lstrip("bhsk")) for part in text.split()}
    return vals["b"], vals["h"], vals["sk"]


def summarize(traces: list[torch.Tensor]) -> dict:
    """Medians over calls of each call's per-CTA median and maximum (us) of each phase."""
    phases = {}
    for tr in traces:
        t = tr.long()
        ns = (t[:, kmod.T_NS1] - t[:, kmod.T_NS0]) % 2 ** 32
        clk = (t[:, kmod.T_END] - t[:, kmod.T_C0]) % 2 ** 32
        ghz = float((clk.double() / ns.double()).median())

        def us(a, b):
            return ((t[:, b] - t[:, a]) % 2 ** 32).double() / (ghz * 1e3)

        start_ns = t[:, kmod.T_NS0] - t[:, kmod.T_NS0].min()
        end_ns = t[:, kmod.T_NS1] - t[:, kmod.T_NS0].min()
        rows = {
            "SM clock GHz": torch.tensor([ghz]),
            "start after the first CTA": start_ns.double() / 1e3,
            "start -> Q stored": us(kmod.T_C0, kmod.T_Q),
            "start -> first page, c0": us(kmod.T_C0, kmod.T_PAGE0),
            "start -> first page, c1": us(kmod.T_C0, kmod.T_PAGE0 + 1),
            "page loop, c0": us(kmod.T_PAGE0, kmod.T_LOOP),
            "page loop, c1": us(kmod.T_PAGE0 + 1, kmod.T_LOOP + 1),
            "loop end -> end, c0": us(kmod.T_LOOP, kmod.T_END),
            "loop end -> end, c1": us(kmod.T_LOOP + 1, kmod.T_END + 1),
            "CTA start -> end, c0": us(kmod.T_C0, kmod.T_END),
            "call span (first start -> CTA end)": end_ns.double() / 1e3,
        }
        for name, v in rows.items():
            phases.setdefault(name, []).append((float(v.median()), float(v.max())))
    return {name: (statistics.median(m for m, _ in vals), statistics.median(x for _, x in vals))
            for name, vals in phases.items()}


def summarize_pages(traces: list[torch.Tensor], ghz: float) -> dict:
    """Per-page compute and wait (us; medians over CTAs, then over calls) from the page stamps."""
    rows = {}
    for tr in traces:
        t = tr.long()
        n = min(int(t[:, kmod.T_PAGES].min()), kmod.TRACE_PAGES)
        arr = t[:, kmod.T_PAGES_AT:kmod.T_PAGES_AT + 2 * n:2]
        done = t[:, kmod.T_PAGES_AT + 1:kmod.T_PAGES_AT + 2 * n:2]
        compute = ((done - arr) % 2 ** 32).double() / (ghz * 1e3)
        prev = torch.cat([t[:, [kmod.T_Q, kmod.T_Q]], done[:, :-2]], dim=1)    # the consumer's previous end
        wait = ((arr - prev) % 2 ** 32).double() / (ghz * 1e3)
        picks = [(f"page {i}", [i]) for i in range(min(6, n))]
        if n > 16:
            picks.append(("median page 8 .. n-8", list(range(8, n - 8))))
        picks += [(f"page n-{n - i}", [i]) for i in range(max(6, n - 2), n)]
        for label, cols in picks:
            c = compute[:, cols].median(dim=1).values if len(cols) > 1 else compute[:, cols[0]]
            w = wait[:, cols].median(dim=1).values if len(cols) > 1 else wait[:, cols[0]]
            rows.setdefault(f"{label}: compute", []).append(float(c.median()))
            rows.setdefault(f"{label}: wait", []).append(float(w.median()))
        for cc in range(2):
            rows.setdefault(f"sum of compute, c{cc}", []).append(float(compute[:, cc::2].sum(1).median()))
            rows.setdefault(f"sum of waits (from Q stored), c{cc}", []).append(float(wait[:, cc::2].sum(1).median()))
    return {name: statistics.median(v) for name, v in rows.items()}


def by_sm(traces: list[torch.Tensor]) -> tuple[dict[int, float], float]:
    """Each SM's CTA time (start -> consumer 0's end, us; median over the calls that put a CTA on it), and the
    median over pairs of consecutive calls of the rank correlation of their per-SM times: near 1 where an SM's
    place makes its CTA slow or fast, near 0 where the spread is the call's own."""
    per_call = []
    for tr in traces:
        t = tr.long()
        ns = (t[:, kmod.T_NS1] - t[:, kmod.T_NS0]) % 2 ** 32
        per_call.append({int(sm): float(d) / 1e3 for sm, d in zip(t[:, kmod.T_SM], ns)})
    sms = sorted(set.intersection(*(set(c) for c in per_call)))
    times = {sm: statistics.median(c[sm] for c in per_call) for sm in sms}

    def ranks(v: list[float]) -> torch.Tensor:
        return torch.tensor(v).argsort().argsort().double()
    corr = []
    for a, b in zip(per_call, per_call[1:]):
        ra, rb = ranks([a[sm] for sm in sms]), ranks([b[sm] for sm in sms])
        corr.append(float(torch.corrcoef(torch.stack([ra, rb]))[0, 1]))
    return times, statistics.median(corr) if corr else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="b128 h16 sk4096,b128 h32 sk4096,b128 h16 sk8192,b128 h32 sk8192")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--set", action="append", default=[], metavar="FLAG=0|1", help="an mla_decode module flag")
    p.add_argument("--by-sm", action="store_true",
                   help="also each SM's CTA time and how well it repeats from call to call (rank correlation)")
    args = p.parse_args()
    for item in args.set:
        name, _, value = item.partition("=")
        if not hasattr(cd, name) or value not in ("0", "1"):
            p.error(f"--set takes an mla_decode flag and 0 or 1, got {item!r}")
        setattr(cd, name, value == "1")
        print(f"mla_decode.{name} = {value == '1'}", flush=True)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    results, page_results = {}, {}
    for text in args.shapes.split(","):
        b, h, s_k = parse_shape(text)
        q, kv, table, seqlens = check.make_fp8_case([s_k] * b, 1, h, seed=b + h)
        plan = cd.plan_mla_decode(b, 1, h, 512, table.shape[1], 64, True, q.device, num_splits=1)
        if not cd.uses_fp8_f16(True, h, table.shape[1], plan.num_splits):
            print(f"{text}: not the f16-register kernel's shape; skipped", flush=True)
            continue
        out0, lse0 = cd.mla_decode(q, kv, table, seqlens, check.SCALE, plan=plan)     # compiles the untraced
        traces = []
        cd.TRACE = True
        try:
            for _ in range(args.reps + 1):
                flush.zero_()
                torch.cuda.synchronize()
                out, lse = cd.mla_decode(q, kv, table, seqlens, check.SCALE, plan=plan)
                torch.cuda.synchronize()
                traces.append(cd.last_trace.cpu())
        finally:
            cd.TRACE = False
        if not (torch.equal(out, out0) and torch.equal(lse, lse0)):
            print(f"{text}: the traced launch's outputs differ from the untraced one's", flush=True)
            return 1
        pages = int(traces[-1][:, kmod.T_PAGES].max())
        if pages != math.ceil(s_k / 64):
            print(f"{text}: the trace counts {pages} pages a CTA, expected {math.ceil(s_k / 64)}", flush=True)
            return 1
        results[text] = summarize(traces[1:])      # the first traced call compiled the traced kernel
        if args.by_sm:
            times, corr = by_sm(traces[1:])
            print(f"{text}: CTA time by SM (us, median over calls), rank correlation between calls {corr:.2f}",
                  flush=True)
            for i in range(0, len(times), 12):
                print("  " + " ".join(f"{sm:3d}:{times[sm]:6.1f}" for sm in list(times)[i:i + 12]), flush=True)
        page_results[text] = summarize_pages(traces[1:], results[text]["SM clock GHz"][0])
    names = list(next(iter(results.values()))) if results else []
    print(f"\n{'median / max over CTAs (us)':40s}" + "".join(f"{k:>22s}" for k in results))
    for name in names:
        print(f"{name:40s}" + "".join(f"{results[k][name][0]:>11.2f} /{results[k][name][1]:>8.2f}" for k in results))
    print(f"\n{'pages, median over CTAs (us)':40s}" + "".join(f"{k:>22s}" for k in page_results))
    for name in dict.fromkeys(n for r in page_results.values() for n in r):
        cells = (f"{r[name]:>22.2f}" if name in r else " " * 22 for r in page_results.values())
        print(f"{name:40s}" + "".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
