"""A/B of a switch of the decode kernels, on against off, interleaved in one process and timed as `mlaserve bench
kernels` times them (inputs rotating over 256 MB, CUDA-graph replay, L2 cleared before each call, median), with
FlashInfer beside them where it is installed. The switches, read at launch (so captured with each graph):
  PERSISTENT     cutedsl: persistent launches against the ordinary grid (mla_decode.PERSISTENT)
  LONGEST_FIRST  cutedsl: persistent launches taking requests longest first against batch order
  GRID_ORDER     triton: grids of more than one wave taking requests longest first (work_order.grid_order)
                 against batch order

    python scripts/decode_ab.py
    python scripts/decode_ab.py --switch LONGEST_FIRST --shapes "b128 h128 sk4096 var,b128 h128 sq2 sk4096 var"

Shapes: "bB hH [sqN] [skS] [var] [fp8]" (s_q 1, s_k 4096, fixed lengths, bf16 KV unless given).
"""

import argparse
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mlaserve.bench import inputs as bench_inputs  # noqa: E402
from mlaserve.bench import peers, runners  # noqa: E402
from mlaserve.bench.limits import capture_graphs, time_us  # noqa: E402
from mlaserve.bench.shapes import DenseShape  # noqa: E402

DEFAULT_SHAPES = ("b128 h128 sk4096,b128 h128 sk8192,b128 h128 sk16384,b128 h128 sq2 sk4096,b128 h128 sq2 sk8192,"
                  "b128 h128 sq2 sk32768,b128 h64 sq2 sk4096,b128 h64 sq2 sk16384,b128 h128 sk4096 var,"
                  "b128 h128 sk16384 var,b128 h128 sq2 sk4096 var,b128 h128 sq2 sk8192 var,b128 h128 sq2 sk16384 var")


def _module_flag(module: str, name: str):
    m = importlib.import_module(module)
    return lambda on: setattr(m, name, on)


def _grid_order(on: bool):
    td = importlib.import_module("mlaserve.kernels.triton.mla_decode")
    wo = importlib.import_module("mlaserve.kernels.triton.work_order")
    td.grid_order = wo.grid_order if on else (lambda *args: None)


# switch -> (backend, setter(on))
SWITCHES = {
    "PERSISTENT": ("cutedsl", _module_flag("mlaserve.kernels.cutedsl.mla_decode", "PERSISTENT")),
    "LONGEST_FIRST": ("cutedsl", _module_flag("mlaserve.kernels.cutedsl.mla_decode", "LONGEST_FIRST")),
    "GRID_ORDER": ("triton", _grid_order),
}


def graphs(prep, switch, on: bool):
    switch(on)
    for call in prep.calls:
        call()
    torch.cuda.synchronize()
    replays = capture_graphs(prep.calls)
    switch(True)
    return replays


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--switch", default="PERSISTENT", choices=tuple(SWITCHES))
    args = ap.parse_args()
    backend, switch = SWITCHES[args.switch]
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, f"backend {backend}", flush=True)
    for spec in args.shapes.split(","):
        w = spec.split()
        s_q = next((int(x[2:]) for x in w if x.startswith("sq")), 1)
        s_k = next((int(x[2:]) for x in w if x.startswith("sk")), 4096)
        shape = DenseShape(int(w[0][1:]), s_q, s_k, int(w[1][1:]), "fp8" if "fp8" in w else "bf16",
                           varlen="var" in w)
        inputs = bench_inputs.make_dense(shape, dev, seed=shape.b + shape.h, rotate_bytes=256 << 20)
        prep = runners.prepare_ops(backend, shape, inputs)
        on, off = graphs(prep, switch, True), graphs(prep, switch, False)
        out_on = prep.calls[0]()[0]
        switch(False)
        same = torch.equal(out_on, prep.calls[0]()[0])
        switch(True)
        t = {"on": [], "off": []}
        for _ in range(2):
            t["on"].append(time_us(on, dev))
            t["off"].append(time_us(off, dev))
        fi = None
        try:
            fprep = peers.prepare("flashinfer", shape, inputs)
            for call in fprep.calls:
                call()
            fi = time_us(capture_graphs(fprep.calls), dev)
        except Exception as e:   # FlashInfer missing or failing: the A/B stands without it
            print(f"  flashinfer: {type(e).__name__}: {str(e)[:120]}", flush=True)
        on_us, off_us = min(t["on"]), min(t["off"])
        print(f"{spec:28s} {args.switch} on {on_us:8.1f} us  off {off_us:8.1f} us  off/on {off_us / on_us:.3f}x"
              + (f"  flashinfer {fi:8.1f} us  fi/on {fi / on_us:.3f}x" if fi else "")
              + ("" if same else "  OUTPUTS DIFFER"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
