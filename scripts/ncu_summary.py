"""The few Nsight Compute readings that placed the decode kernels' time (device_run.sh phase "ncu"), one column per
profiled kernel, from the raw page it exported (ncu_raw.csv.gz), and optionally the SASS instructions where the
warps of one kernel stalled most (ncu_source.csv.gz).

    python scripts/ncu_summary.py OUT/ncu_raw.csv.gz
    python scripts/ncu_summary.py OUT/ncu_raw.csv.gz --source OUT/ncu_source.csv.gz --kernel 1 --top 30
    python scripts/ncu_summary.py OUT/ncu_raw.csv.gz --source OUT/ncu_source.csv.gz --partitions

Elapsed cycles minus the busiest SM's active cycles is time no warp of the kernel ran on that SM (launch,
teardown); the spread between the least and the most active SM is the load imbalance.
"""

import argparse
import csv
import gzip
import sys

ROWS = (
    ("kernel", "Kernel Name", None),
    ("time us", "gpu__time_duration.sum", 1),
    ("SM clock GHz", "gpc__cycles_elapsed.avg.per_second", 1),
    ("elapsed k cycles", "gpc__cycles_elapsed.max", 1e-3),
    ("SM active avg k", "sm__cycles_active.avg", 1e-3),
    ("SM active max k", "sm__cycles_active.max", 1e-3),
    ("SM active min k", "sm__cycles_active.min", 1e-3),
    ("tensor pipe % elapsed", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed", 1),
    ("DRAM read GB", "dram__bytes_read.sum", 1),
    ("L2 hit %", "lts__t_sector_hit_rate.pct", 1),
    ("instructions M", "smsp__inst_executed.sum", 1e-6),
    ("smem bank conflicts k", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum", 1e-3),
    ("spill instructions k", "sass__inst_executed_register_spilling", 1e-3),
)


def _short(name: str) -> str:
    """A column title for a kernel name: its library, or its own first characters."""
    if "flashinfer" in name:
        return "flashinfer"
    if "cutlass_kernel_mlaserve" in name:
        return "cutedsl"
    return name[:14]


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def summary(raw_path: str) -> str:
    """The ROWS table of every kernel in a raw-page export."""
    rows = list(csv.reader(gzip.open(raw_path, "rt")))
    header, kernels = rows[0], rows[2:]     # row 1 holds the units
    lines = []
    for label, metric, scale in ROWS:
        if metric not in header:
            continue
        i = header.index(metric)
        cells = []
        for k in kernels:
            v = _number(k[i]) if scale is not None else None
            cells.append(_short(k[i]) if v is None else f"{v * scale:.4g}")
        lines.append(f"{label:24s}" + "".join(f"{c:>15s}" for c in cells))
    return "\n".join(lines)


def source_kernels(path: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """(kernel name, column names, one row per SASS instruction) of each kernel in a source-page export."""
    out = []
    for row in csv.reader(gzip.open(path, "rt")):
        if not row:
            continue
        if row[0] == "Kernel Name":
            out.append((row[1], [], []))
        elif row[0] == "Address":
            out[-1][1].extend(row)
        elif out:
            out[-1][2].append(row)
    return out


def stalls(path: str, kernel: int, top: int) -> str:
    """The `top` instructions of source-page kernel `kernel` with the most warp-stall samples, in program order."""
    name, header, rows = source_kernels(path)[kernel]
    samples, text = header.index("Warp Stall Sampling (All Samples)"), header.index("Source")
    executed = header.index("Instructions Executed")
    total = sum(int(r[samples]) for r in rows) or 1
    hot = sorted(sorted(range(len(rows)), key=lambda i: -int(rows[i][samples]))[:top])
    lines = [f"{name[:100]}: {len(rows)} instructions, {total} samples"]
    for i in hot:
        r = rows[i]
        lines.append(f"{i:6d} {int(r[samples]) / total:6.1%} {r[executed]:>10s}  {r[text].strip()[:100]}")
    return "\n".join(lines)


def partitions(path: str, kernel: int, min_share: float = 0.05) -> str:
    """Source-page kernel `kernel`'s warp-stall samples by reason, for the whole kernel and for each range of
    instructions between two USETMAXREG / EXIT instructions (in warp-specialized kernels: one per partition's code)
    that holds at least min_share of the samples. A reason's share of a range's samples shows what its warps waited
    for: no_inst (instruction fetch), long_sb (mbarrier and global waits), barrier (named barriers), wait (fixed
    latencies), selected (issuing)."""
    name, header, rows = source_kernels(path)[kernel]
    reasons = [c for c in header if c.startswith("stall_") and "Not Issued" not in c]
    samples, text = header.index("Warp Stall Sampling (All Samples)"), header.index("Source")
    executed = header.index("Instructions Executed")
    cuts = [0] + [i for i, r in enumerate(rows) if "USETMAXREG" in r[text] or "EXIT" in r[text]] + [len(rows)]
    total = sum(_number(r[samples]) or 0 for r in rows) or 1

    def line(label: str, part: list[list[str]]) -> str:
        n = sum(_number(r[samples]) or 0 for r in part) or 1
        by = sorted(((sum(_number(r[header.index(c)]) or 0 for r in part), c[6:]) for c in reasons), reverse=True)
        warp_insts = sum(_number(r[executed]) or 0 for r in part)
        return (f"{label}: {n / total:4.0%} of the samples, {warp_insts / 1e6:.1f} M warp instructions: "
                + ", ".join(f"{c} {v / n:.0%}" for v, c in by[:7]))

    lines = [f"{name[:100]}: {len(rows)} instructions, {int(total)} samples", line("  all", rows)]
    for a, b in zip(cuts, cuts[1:]):
        part = rows[a:b]
        if sum(_number(r[samples]) or 0 for r in part) >= min_share * total:
            lines.append(line(f"  [{a}, {b})", part))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("raw", help="ncu_raw.csv.gz")
    ap.add_argument("--source", help="ncu_source.csv.gz: also list one kernel's hottest instructions")
    ap.add_argument("--kernel", type=int, default=0, help="that kernel's index in the source page")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--partitions", action="store_true",
                    help="with --source: every kernel's stall reasons, per range of code between USETMAXREG's")
    args = ap.parse_args()
    print(summary(args.raw))
    if args.source and args.partitions:
        for k in range(len(source_kernels(args.source))):
            print()
            print(partitions(args.source, k))
    elif args.source:
        print()
        print(stalls(args.source, args.kernel, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
