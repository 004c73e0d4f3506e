"""`mlaserve bench kernels`: time every attention kernel backend on the standard shapes.

    mlaserve bench kernels [--backends torch,triton,cutedsl,flashinfer,flashmla,sglang|all]
                           [--suite dense,sparse,indexer|all] [--quick] [--out DIR] [--disable-tqdm]
                           [--time-budget S] [--report] [--brief]

Per shape: random inputs (rotated among several sets when one set is small), the torch reference on
a subset that is a smaller problem of its own, then for each backend: one call checked against the
reference, and the median time of `triton.testing.do_bench` (CUDA) or the wall clock (CPU). The GPU's
copy bandwidth and bf16 matmul rate are measured in the same run. Results merge into DIR/kernels.json
(one row per shape and backend, so separate runs per suite add up), DIR/kernels.png, and a table.
On a CPU only `--quick` shapes make sense; limits are skipped there (the JSON says so).
"""

import argparse
import datetime
import faulthandler
import os
import platform
import signal
import subprocess
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from mlaserve.bench import inputs as bench_inputs
from mlaserve.bench import limits as bench_limits
from mlaserve.bench import peers, report, runners
from mlaserve.bench.shapes import (SUITES, DenseShape, IndexerShape, Shape, SparseShape, quick_shapes, shape_dict,
                                   standard_shapes)
from mlaserve.ops.registry import BACKENDS

OPS = {"dense": "mla_decode", "sparse": "sparse_mla", "indexer": "indexer_topk"}


def unavailable_reason(name: str, suite: str, device: torch.device) -> str | None:
    """Why backend `name` (mlaserve's own or a peer) cannot run `suite` on `device`; None when it can."""
    if name in BACKENDS:
        return runners.ops_unavailable_reason(name, OPS[suite], device)
    return peers.unavailable_reason(name, device)


def prepare(name: str, shape: Shape, inputs) -> runners.Prepared:
    """Backend `name`'s calls (mlaserve's own or a peer's) on `shape`'s inputs."""
    if name in BACKENDS:
        return runners.prepare_ops(name, shape, inputs)
    return peers.prepare(name, shape, inputs)
ROTATE_BYTES = 512 << 20   # input sets together span this much, so the 60 MB L2 never holds a set
_REPO = Path(__file__).resolve().parents[2]
_STICKY = ("illegal memory access", "unspecified launch failure", "device-side assert", "misaligned address",
           "illegal instruction", "CUDA error: an illegal", "uncorrectable ECC")


class StickyCudaError(RuntimeError):
    """The CUDA context is unusable after a kernel fault: nothing more can run in this process."""


def parse_args(argv):
    p = argparse.ArgumentParser(prog="mlaserve bench kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="all",
                   help=f"comma list of {sorted(BACKENDS) + list(peers.PEERS)} or 'all' (default)")
    p.add_argument("--suite", default="all", help="comma list of dense,sparse,indexer or 'all' (default)")
    p.add_argument("--quick", action="store_true", help="tiny shapes (what a CPU can run)")
    p.add_argument("--out", default="bench_out", help="results folder (kernels.json, kernels.png)")
    p.add_argument("--fresh", action="store_true", help="start a new kernels.json instead of merging into it")
    p.add_argument("--report", action="store_true", help="only re-derive, plot and print what --out holds")
    p.add_argument("--brief", action="store_true", help="print only the headline shapes in the table")
    p.add_argument("--shapes", default="", help="comma list of substrings; run only shapes whose key holds one")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds; shapes not started by then are recorded as skipped")
    p.add_argument("--warmup-ms", type=float, default=10)
    p.add_argument("--rep-ms", type=float, default=50,
                   help="timing per backend and shape, in ms, shared among the rounds")
    p.add_argument("--rounds", type=int, default=3,
                   help="time a shape's backends in this many interleaved turns; each reports the median (default 3)")
    p.add_argument("--torch-max-ms", type=float, default=50,
                   help="time the torch reference only where one call is estimated under this (default 50)")
    p.add_argument("--no-limits", action="store_true", help="skip measuring copy bandwidth and matmul rate")
    p.add_argument("--eager", action="store_true",
                   help="time eager calls (host launch cost included) instead of CUDA-graph replays")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--disable-tqdm", action="store_true")
    return p.parse_args(argv)


def _split(value: str, allowed, what: str) -> list[str]:
    names = list(allowed) if value == "all" else [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise SystemExit(f"mlaserve bench kernels: unknown {what} {unknown or value!r}; choose from {list(allowed)} "
                         f"or 'all'")
    return names


def git_commit() -> str:
    # scripts/device_run.sh sets this from the commit scripts/pack_for_device.sh recorded: the device's copy
    # of the tree may carry a stale .git of its own
    if os.environ.get("MLASERVE_GIT_COMMIT"):
        return os.environ["MLASERVE_GIT_COMMIT"] + " (recorded by scripts/pack_for_device.sh)"
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_REPO, capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_REPO,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        pass   # no git here (the device gets a copy of the tree): the pack script left the commit in a file
    stamp = _REPO / ".peers" / "GIT_COMMIT"
    return stamp.read_text().strip() + " (from .peers/GIT_COMMIT)" if stamp.exists() else "unknown"


def collect_env(device: torch.device) -> dict:
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "git_commit": git_commit(), "device": str(device)}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, sm_count=props.multi_processor_count,
                   l2_bytes=getattr(props, "L2_cache_size", None), memory_gib=round(props.total_memory / 2**30, 1),
                   capability=".".join(map(str, torch.cuda.get_device_capability(device))))
    else:
        env.update(gpu=None, cpu=platform.processor() or platform.machine())
    return env


def _is_sticky(exc: BaseException, device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    if any(s in str(exc) for s in _STICKY):
        return True
    try:
        torch.cuda.synchronize(device)
    except RuntimeError:
        return True
    return False


def _make_inputs(shape: Shape, device, seed: int, rotate_bytes: float):
    if isinstance(shape, DenseShape):
        return bench_inputs.make_dense(shape, device, seed, rotate_bytes)
    if isinstance(shape, SparseShape):
        return bench_inputs.make_sparse(shape, device, seed, rotate_bytes)
    return bench_inputs.make_indexer(shape, device, seed, rotate_bytes)


def _counts(shape: Shape, inputs, row_bytes: int | None) -> tuple[float, float]:
    """(bytes, flops) of one call (shapes.py's counting rules)."""
    if isinstance(shape, DenseShape):
        total_k = inputs.paging.total_tokens
        return shape.bytes(total_k, row_bytes), shape.flops(total_k)
    return shape.bytes(row_bytes), shape.flops()


def _subset_fraction(shape: Shape, subset: runners.Subset) -> float:
    """How much of the full problem the reference subset is (to estimate the torch backend's full time)."""
    if isinstance(shape, SparseShape):
        return min(shape.tokens, runners.REF_ROWS) / shape.tokens
    return len(subset.requests) / shape.b * subset.rows / shape.s_q


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Bench:
    def __init__(self, args, device: torch.device, backends: list[str], data: dict, out_dir: Path):
        self.args, self.device, self.backends, self.data, self.out_dir = args, device, backends, data, out_dir
        self.deadline = None if args.time_budget is None else time.monotonic() + args.time_budget
        self.rotate_bytes = ROTATE_BYTES if device.type == "cuda" else 0
        self._reasons: dict[tuple[str, str], str | None] = {}

    def unavailable(self, name: str, suite: str) -> str | None:
        key = (name, suite)
        if key not in self._reasons:
            try:
                self._reasons[key] = unavailable_reason(name, suite, self.device)
            except Exception as e:   # e.g. a kernel module that fails to import: its rows say why
                traceback.print_exc()
                self._reasons[key] = f"availability check failed: {type(e).__name__}: {str(e)[:300]}"
            self.data["backends"].setdefault(name, {"kind": "mlaserve" if name in BACKENDS else "peer"})
            self.data["backends"][name].setdefault("unavailable", {})[suite] = self._reasons[key]
        return self._reasons[key]

    def log(self, msg: str, bar=None):
        (bar.write if bar is not None and not self.args.disable_tqdm else print)(msg)
        sys.stdout.flush()

    def run_shape(self, shape: Shape, bar) -> list[dict]:
        base = {"suite": shape.suite, "key": shape.key, "kv": shape.kv, "shape": shape_dict(shape)}
        rows = [dict(base, backend=n, status="skipped", reason="") for n in self.backends]
        if self.deadline is not None and time.monotonic() > self.deadline:
            for r in rows:
                r["reason"] = "time budget spent before this shape"
            bar.update(len(rows))
            return rows
        pending = []
        for r in rows:
            reason = self.unavailable(r["backend"], shape.suite)
            if reason is not None:
                r["reason"] = reason
                bar.update(1)
            else:
                pending.append(r)
        if not pending:
            return rows
        try:
            inputs = _make_inputs(shape, self.device, self.args.seed, self.rotate_bytes)
            subset = runners.pick_subset(shape.b, shape.s_q, self.device)
            t0 = time.perf_counter()
            ref = runners.reference(shape, inputs, subset)
            _sync(self.device)
            ref_s = time.perf_counter() - t0
        except Exception as e:
            sticky = _is_sticky(e, self.device)
            for r in pending:
                r.update(status="error", reason=f"inputs or reference failed: {type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc()
            bar.update(len(pending))
            if sticky:
                raise StickyCudaError(str(e)) from e
            return rows
        timed = {}
        for r in pending:
            bar.set_postfix_str(f"{shape.key} {shape.kv} {r['backend']}")
            calls = self._run_backend(r, shape, inputs, subset, ref, ref_s)
            if calls is not None:
                timed[r["backend"]] = (r, *calls)
        # the backends timed in turns, so that the GPU's clock (it moves with power and temperature from one
        # launch to the next: 1350-1720 MHz on the H200 in bench/NOTES.md 54) weighs on all of them alike; the
        # order rotates from round to round (first in every round, one backend ran 10% faster in its first round
        # than the others in theirs: bench/NOTES.md 60)
        rounds = max(1, self.args.rounds)
        names = list(timed)
        for k in range(rounds if names else 0):     # none to time: each one skipped or failed its check call
            for name in names[k % len(names):] + names[:k % len(names)]:
                r, calls, _ = timed[name]
                if r["status"] == "error":
                    continue
                try:
                    r["time_rounds_us"].append(bench_limits.time_us(calls, self.device, self.args.warmup_ms,
                                                                    self.args.rep_ms / rounds))
                except Exception as e:
                    r.update(status="error", reason=f"timing: {type(e).__name__}: {str(e)[:300]}")
                    if _is_sticky(e, self.device):
                        raise StickyCudaError(f"{name} on {shape.key} {shape.kv}: {e}") from e
        for r, _, extra_calls in timed.values():
            if r["status"] != "error":
                r["time_us"] = statistics.median(r["time_rounds_us"])
                self._time_extras(r, shape, extra_calls)
        for r in pending:
            bar.update(1)
            self.log(_row_line(r, self.data.get("limits") or {}), bar)
        del inputs, ref, timed
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return rows

    def _run_backend(self, row: dict, shape: Shape, inputs, subset, ref, ref_s: float):
        """Check one backend against the reference and fill its row; -> the calls to time (CUDA-graph replays
        where they capture) and the parts it times apart, or None where it cannot run or failed."""
        name = row["backend"]
        try:
            if name == "torch" and self.device.type == "cuda":
                est_ms = 1e3 * ref_s / _subset_fraction(shape, subset)
                if est_ms > self.args.torch_max_ms:
                    row["reason"] = (f"torch reference not timed: one call estimated at {est_ms:.0f} ms "
                                     f"(> --torch-max-ms {self.args.torch_max_ms:g}); it validated the others")
                    return None
            prepared = prepare(name, shape, inputs)
            result = prepared.calls[0]()
            _sync(self.device)
            want = ref if prepared.reference is None else prepared.reference(subset)
            chk = runners.check(shape, runners.take_subset(shape, result, subset), want)
            del result
            timed, timing = prepared.calls, "eager"
            if self.device.type == "cuda" and name != "torch" and not self.args.eager:
                replays = bench_limits.capture_graphs(prepared.calls)
                if replays is not None:
                    timed, timing = replays, "cuda-graph"
            nbytes, flops = _counts(shape, inputs, prepared.kv_row_bytes)
            row.update(status="ok" if chk["ok"] else "invalid", reason=chk.get("reason", ""), time_us=None,
                       time_rounds_us=[], bytes=nbytes, flops=flops, check=chk, rotation_sets=len(prepared.calls),
                       note=prepared.note, timing=timing, extra={})
            return timed, prepared.extra_calls
        except runners.Unsupported as e:
            row.update(status="skipped", reason=str(e))
        except Exception as e:
            row.update(status="error", reason=f"{type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc()
            if _is_sticky(e, self.device):
                raise StickyCudaError(f"{name} on {shape.key} {shape.kv}: {e}") from e
        return None

    def _time_extras(self, row: dict, shape: Shape, extra_calls: dict) -> None:
        """Parts of a backend's call that it times apart (the indexer's scores), timed the way the whole was."""
        for what, calls in extra_calls.items():
            try:
                if row["timing"] == "cuda-graph":
                    calls = bench_limits.capture_graphs(calls) or calls
                row["extra"][f"{what}_us"] = bench_limits.time_us(calls, self.device, self.args.warmup_ms,
                                                                  self.args.rep_ms)
            except Exception as e:
                if _is_sticky(e, self.device):
                    raise StickyCudaError(f"{row['backend']} on {shape.key} {shape.kv}: {e}") from e
                row["extra"][f"{what}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        if "scores_us" in row["extra"]:
            row["extra"]["topk_us"] = row["time_us"] - row["extra"]["scores_us"]

    def run_suite(self, suite: str) -> None:
        shapes = quick_shapes(suite) if self.args.quick else standard_shapes(suite)
        wanted = [s for s in self.args.shapes.split(",") if s]
        if wanted:
            shapes = [s for s in shapes if any(w in f"{s.key} {s.kv}" for w in wanted)]
        from tqdm import tqdm
        with tqdm(total=len(shapes) * len(self.backends), desc=f"bench {suite}", disable=self.args.disable_tqdm,
                  file=sys.stderr) as bar:
            for shape in shapes:
                new_rows = self.run_shape(shape, bar)
                self.data = report.merge(self.data, {**self.data, "rows": new_rows})
                report.write(self.data, self.out_dir)


def _row_line(r: dict, limits: dict) -> str:
    head = f"[{r['suite']}] {r['key']} {r['kv']} {r['backend']}:"
    if r.get("time_us") is None:
        return f"{head} {r['status']} ({r['reason']})"
    tbps, tflops = r["bytes"] / r["time_us"] / 1e6, r["flops"] / r["time_us"] / 1e6
    rates = f"{tbps:.2f} TB/s {tflops:.1f} TFLOP/s"
    if limits.get("copy_tbps") and limits.get("matmul_tflops"):
        rates += f" ({100 * tbps / limits['copy_tbps']:.0f}% copy, {100 * tflops / limits['matmul_tflops']:.0f}% mm)"
    err = r["check"].get("rel_err", r["check"].get("recall"))
    err = "n/a" if err is None else f"{err:.3g}"
    extra = "".join(f" {k}={v:.1f}" if isinstance(v, float) else f" {k}: {v}" for k, v in r.get("extra", {}).items())
    return (f"{head} {r['time_us']:.1f} us [{r.get('timing', 'eager')}] {rates} {r['status']} (check {err}){extra} "
            f"{r.get('reason', '')}")


NOTES = [
    "time: median of triton.testing.do_bench over CUDA-graph replays of each backend's call (row 'timing'; "
    "eager calls with --eager or where a call cannot be captured, and always for torch) "
    "(L2 cleared before each call), rotating among input sets "
    "(several when one set is under 512 MiB); CPU: wall-clock median",
    "validation: one call per backend and shape against the torch reference (fp32 accumulation) on a subset that "
    "is a problem of its own: 8 requests (dense, indexer: their last <= 64 query rows) or 64 query tokens (sparse); "
    "rel = ||out - ref|| / ||ref||, tolerance 1e-2 bf16 / 2e-2 FP8, lse within 1e-2 / 5e-2, indexer recall >= 0.99",
    "the torch backend is timed only where one full call is estimated under --torch-max-ms (default 50 ms)",
    "sparse prefill is one request of 4096 new tokens: q [1, 4096, h, 576], indices [1, 4096, 2048]; "
    "each query token draws 2048 distinct random slots of its request's pool",
    "inputs are random normal everywhere (unused cache slots too: the GPU tests poison them with NaN, "
    "the benchmark does not); pages handed out in random order; softmax scale 192^-0.5",
    "bytes = Q + KV rows read + O + lse (sparse: every gathered row); dense FLOPs 2*s_q*h*sum(s_k)*(576+512), "
    "sparse 2*tokens*h*topk*(576+512), indexer scoring 2*b*s_q*H_I*D_I*s_k",
]


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.report:
        data = report.load(out_dir / report.JSON_NAME)
        if data is None:
            print(f"no {report.JSON_NAME} in {out_dir}", file=sys.stderr)
            return 2
        return _finish(data, out_dir, args)
    suites = _split(args.suite, SUITES, "suite")
    backends = _split(args.backends, list(BACKENDS) + list(peers.PEERS), "backend")
    # a run stopped from outside (the device script's `timeout`) says where it was: every thread's stack on stderr
    faulthandler.register(signal.SIGTERM, chain=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.quick:
        print("mlaserve bench kernels: no CUDA device here; the standard shapes need a GPU (use --quick on a CPU)",
              file=sys.stderr)
        return 2
    old = None if args.fresh else report.load(out_dir / report.JSON_NAME)
    env = collect_env(device)
    print(f"env: {env}")
    if args.no_limits:
        lim = bench_limits.Limits(None, None, "not measured (--no-limits)")
    else:
        lim = bench_limits.measure(device)
    print(f"limits: {lim.as_dict()}")
    data = {"schema": report.SCHEMA, "env": env, "limits": lim.as_dict(),
            "settings": {"quick": args.quick, "suites": suites, "backends": backends, "warmup_ms": args.warmup_ms,
                         "rep_ms": args.rep_ms, "torch_max_ms": args.torch_max_ms, "seed": args.seed},
            "backends": {n: {"kind": "mlaserve" if n in BACKENDS else "peer",
                             "version": peers.version(n) if n in peers.PEERS else None} for n in backends},
            "rows": [], "notes": NOTES}
    data = report.merge(old, data)
    bench = Bench(args, device, backends, data, out_dir)
    code = 0
    try:
        for suite in suites:
            bench.run_suite(suite)
    except StickyCudaError as e:
        print(f"ABORTED: the CUDA context is unusable after a kernel fault ({e}); rows so far are kept",
              file=sys.stderr)
        bench.data["notes"] = bench.data["notes"] + [f"a run was aborted by a kernel fault: {str(e)[:300]}"]
        code = 3
    return _finish(bench.data, out_dir, args) or code


def _finish(data: dict, out_dir: Path, args) -> int:
    path = report.write(data, out_dir)
    code = 0
    try:
        from mlaserve.bench.plot import plot
        png = plot(data, out_dir / report.PNG_NAME)
        print(f"wrote {path} and {png}")
    except Exception:
        traceback.print_exc()
        print(f"wrote {path}; the plot FAILED (traceback above)", file=sys.stderr)
        code = 1
    print(report.table(data, brief=args.brief))
    return code


if __name__ == "__main__":
    sys.exit(main())
