"""The decode kernels of chosen shapes and backends, one call each, between cudaProfilerStart and Stop, for Nsight
Compute (`ncu --profile-from-start off`): what the counters say where the timings alone leave a gap unexplained.

    ncu --clock-control none --profile-from-start off --set full -o prof python scripts/ncu_profile.py \\
        --runs "cutedsl b128 h128 sq2 sk4096,flashinfer b128 h128 sq2 sk4096"

A run is "BACKEND SHAPE [NAME=VALUE ...]" with BACKEND an mlaserve kernel backend (triton, cutedsl, ...) or a peer
(flashinfer), SHAPE as scripts/decode_ab.py reads it, and NAME=VALUE module switches of the backend's decode
module set for that run (a Python literal, e.g. "cutedsl b128 h128 sq2 sk4096 STREAM_K_MIN_TILES=0"); SEED=N
makes that run's inputs with seed N instead of --seed's. Each is called once outside the profiled range first
(compiling and planning there), then once inside it, so that every kernel of that one call is profiled, in the order
printed.
scripts/device_run.sh's phase "ncu" runs this under ncu and exports the report's pages as CSV.
"""

import argparse
import ast
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mlaserve.bench import inputs as bench_inputs  # noqa: E402
from mlaserve.bench import peers, runners  # noqa: E402
from mlaserve.bench.shapes import SparseShape  # noqa: E402
from scripts.decode_ab import parse_shape  # noqa: E402

DEFAULT_RUNS = "cutedsl b128 h128 sq2 sk4096,flashinfer b128 h128 sq2 sk4096"
DECODE_MODULES = {"cutedsl": "mlaserve.kernels.cutedsl.mla_decode", "triton": "mlaserve.kernels.triton.mla_decode"}


def prepare(backend: str, spec: str, dev: torch.device, seed: int):
    shape = parse_shape(spec)
    make = bench_inputs.make_sparse if isinstance(shape, SparseShape) else bench_inputs.make_dense
    inputs = make(shape, dev, seed=seed, rotate_bytes=0)
    if backend in peers.PEERS:
        return peers.prepare(backend, shape, inputs)
    return runners.prepare_ops(backend, shape, inputs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default=DEFAULT_RUNS, help="comma list of 'BACKEND SHAPE'")
    ap.add_argument("--seed", type=int, default=0, help="inputs' seed (`bench kernels` uses 0)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    for k, run in enumerate(args.runs.split(",")):
        backend, *words = run.split()
        spec = " ".join(w for w in words if "=" not in w)
        switches = dict(w.split("=", 1) for w in words if "=" in w)
        seed = int(switches.pop("SEED", args.seed))
        module = importlib.import_module(DECODE_MODULES[backend]) if switches else None
        saved = {name: getattr(module, name) for name in switches}
        try:
            for name, value in switches.items():
                setattr(module, name, ast.literal_eval(value))
            prep = prepare(backend, spec, dev, seed)
            prep.calls[0]()          # compile, plan, JIT: outside the profiled range
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            prep.calls[0]()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            print(f"run {k}: {run}: profiled", flush=True)
        except Exception as e:       # a run that cannot start leaves the others to be profiled
            print(f"run {k}: {run}: not profiled: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        finally:
            for name, value in saved.items():
                setattr(module, name, value)
        del prep
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
