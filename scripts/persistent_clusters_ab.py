"""Diagnosis of the persistent CuTe decode's bimodal times (bench/NOTES.md 53): the default cluster count (every
cluster slot of the GPU) against fewer clusters and against the ordinary grid, interleaved in one process and timed
as `mlaserve bench kernels` times them. If some clusters of a full launch start late (fewer co-resident than
launched), their static first item runs late and a launch of fewer clusters is faster and steadier. Run it in
several processes: the bimodality showed from process to process.

    for i in 1 2 3; do python scripts/persistent_clusters_ab.py; done
"""

import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mlaserve.bench import inputs as bench_inputs  # noqa: E402
from mlaserve.bench import runners  # noqa: E402
from mlaserve.bench.limits import capture_graphs, time_us  # noqa: E402
from mlaserve.bench.shapes import DenseShape  # noqa: E402

cd = importlib.import_module("mlaserve.kernels.cutedsl.mla_decode")
DEFAULT = cd.persistent_clusters
SHAPES = ((128, 2, 32768, 64), (128, 1, 16384, 128), (128, 2, 4096, 128))
VARIANTS = ("all", "minus2", "minus6", "grid")


def use(variant: str) -> None:
    """Set the module's launch choice (read at launch, so captured with each graph)."""
    cd.PERSISTENT = variant != "grid"
    fewer = {"minus2": 2, "minus6": 6}.get(variant, 0)
    cd.persistent_clusters = (lambda *a: max(DEFAULT(*a) - fewer, 0) if DEFAULT(*a) else 0) if fewer else DEFAULT


def main() -> int:
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    for b, s_q, s_k, h in SHAPES:
        shape = DenseShape(b, s_q, s_k, h, "bf16")
        inputs = bench_inputs.make_dense(shape, dev, seed=b + h, rotate_bytes=256 << 20)
        prep = runners.prepare_ops("cutedsl", shape, inputs)
        graphs = {}
        for v in VARIANTS:
            use(v)
            for call in prep.calls:
                call()
            torch.cuda.synchronize()
            graphs[v] = capture_graphs(prep.calls)
        use("all")
        reference = prep.calls[0]()[0]
        times = {v: [] for v in VARIANTS}
        for _ in range(3):
            for v, g in graphs.items():
                times[v].append(time_us(g, dev))
        same = True
        for v in VARIANTS:
            use(v)
            same = same and torch.equal(reference, prep.calls[0]()[0])
        use("all")
        print(f"{shape.key:24s} " + "  ".join(f"{v} {min(t):8.1f} us" for v, t in times.items())
              + ("" if same else "  OUTPUTS DIFFER"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
