"""The benchmark's picture: achieved rate against the roofline, one line per backend.

Left: the roofline (TFLOP/s against FLOP per byte, ceilings from the measured limits) with every
timed row. Right: each shape's fraction of its roofline time (time when the limits are unknown),
one line per backend across the shapes in run order.
"""

from pathlib import Path

from mlaserve.bench.report import OK_STATUSES, backend_order


def plot(data: dict, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["rows"] if r["status"] in OK_STATUSES and r.get("time_us")]
    shapes = list(dict.fromkeys((r["suite"], r["key"], r["kv"]) for r in rows))
    index = {s: i for i, s in enumerate(shapes)}
    limits = data.get("limits") or {}
    copy, peak = limits.get("copy_tbps"), limits.get("matmul_tflops")
    names = [n for n in backend_order(data) if any(r["backend"] == n for r in rows)]
    names += sorted({r["backend"] for r in rows} - set(names))

    fig, (roof, per_shape) = plt.subplots(1, 2, figsize=(18, 7), gridspec_kw={"width_ratios": [1, 2]})
    if copy and peak:
        lo = min([r["flops"] / r["bytes"] for r in rows] + [1.0]) / 2
        hi = max([r["flops"] / r["bytes"] for r in rows] + [2 * peak / copy]) * 2
        xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
        roof.plot(xs, [min(peak, copy * x) for x in xs], "k-", lw=1,
                  label=f"roofline: {copy:.2f} TB/s copy, {peak:.0f} TFLOP/s bf16")
    for name in names:
        mine = [r for r in rows if r["backend"] == name]
        roof.scatter([r["flops"] / r["bytes"] for r in mine], [r["tflops"] for r in mine], s=14, label=name)
        mine.sort(key=lambda r: index[(r["suite"], r["key"], r["kv"])])
        ys = [r["roofline_frac"] if copy and peak else r["time_us"] for r in mine]
        per_shape.plot([index[(r["suite"], r["key"], r["kv"])] for r in mine], ys, ".-", lw=1, ms=4, label=name)
    roof.set(xscale="log", yscale="log", xlabel="FLOP / byte", ylabel="achieved TFLOP/s", title="roofline")
    roof.legend(fontsize=8)
    roof.grid(True, which="both", alpha=0.3)
    if copy and peak:
        per_shape.set(ylabel="roofline time / measured time", ylim=(0, 1.1), title="fraction of the roofline per shape")
    else:
        per_shape.set(yscale="log", ylabel="time (µs)", title="time per shape (limits not measured)")
    step = max(1, len(shapes) // 40)
    ticks = list(range(0, len(shapes), step))
    per_shape.set_xticks(ticks)
    per_shape.set_xticklabels([f"{shapes[i][0]} {shapes[i][1]} {shapes[i][2]}" for i in ticks],
                              rotation=90, fontsize=6)
    per_shape.legend(fontsize=8)
    per_shape.grid(True, alpha=0.3)
    env = data.get("env", {})
    fig.suptitle(f"mlaserve bench kernels — {env.get('gpu', '?')}, torch {env.get('torch', '?')}, "
                 f"triton {env.get('triton', '?')}, {env.get('date', '')[:10]}, {env.get('git_commit', '')[:12]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
