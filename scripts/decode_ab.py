"""A/B of a switch of the decode kernels, on against off, in one process: CUDA-graph replays of inputs rotating over
256 MB, L2 cleared before each call, the configs taking turns over --rounds rounds (limits.interleaved_us: the
SM clock moves by up to 10% from launch to launch, so configs timed one after the other compare badly), each
printed as its median and the median per-round ratio; FlashInfer in the turns where it is installed. The
switches, read at launch (so captured with each graph):
  PERSISTENT     cutedsl: persistent launches against the ordinary grid (mla_decode.PERSISTENT)
  LONGEST_FIRST  cutedsl: persistent launches taking requests longest first against batch order (ticket launches:
                 with STREAM_K off)
  STREAM_K       cutedsl: persistent launches on a static balanced schedule, items cut and merged in the kernel,
                 against whole items drawn from a ticket counter
  CLUSTER4       cutedsl: clusters of 4 CTAs (one KV load multicast to a request's four 64-row tiles, h 128 s_q 2)
                 against pairs
  GRID_ORDER     triton: grids of more than one wave taking requests longest first (work_order.grid_order)
                 against batch order
  EARLY_SUMS     cutedsl: each consumer's row sums published once final against exchanged after both P Vs
  RANK_ORDER     cutedsl: ticket launches ranking the requests by length in the kernel against the order kernel
                 launched before it (work_order.longest_first)
  FP8_N32_TWO_TILES  cutedsl: the keys-on-M FP8 kernel at 32 rows with two bf16 tiles and one raw stage against
                 one tile and two stages (FP8 shapes of 17-32 rows)
  FP8_MMA        cutedsl: the keys-on-M FP8 kernel with FP8 wgmma on the e4m3 bytes against the one dequantizing
                 them into bf16 tiles (FP8 shapes of <= 16 rows)
  FP8_MMA_FORCE  cutedsl: the FP8-MMA kernel for every FP8 step of <= 16 rows against mla_decode.uses_fp8_mma's
                 split rule (short splits: the bf16-tile kernel)
  BT_AHEAD       cutedsl: the keys-on-M FP8 kernels reading each refill's block-table entry a page ahead against at
                 the refill (FP8 shapes of <= 32 rows)
  FP8_MMA_VEC_IO cutedsl: the FP8-MMA kernel's Q in 16-byte loads and O in bf16 pairs against value by value
  FP8_MMA_EARLY_REFILL cutedsl: the FP8-MMA kernel refilling a stage after its last V^T read against after the page
  FP8_EARLY_START  cutedsl: the f16-register FP8 kernel's Q reads issued before its first pages' loads (and, unsplit,
                 those pages' block-table entries read beside the request's length) against after them
  FP8_SPLIT_EPILOGUE  cutedsl: the f16-register FP8 kernel's two consumers merging and storing half of O^T each
                 against consumer 0 all of it
  FP8_F16_STAGGER  cutedsl: the f16-register FP8 kernel's consumers asking for their second page once their first
                 has landed against both pages at the start
  FP8_F16_GROUP_S  cutedsl: the 16-row f16-register FP8 kernel's S^T by scale group from the exact e4m3 values,
                 the scales applied to the groups' accumulators in fp32, against each K value scaled in f16
  FP8_SEESAW_PREFETCH  cutedsl: FP8 at more than 32 rows (the seesaw's register-path loader) asking L2 for the page
                 after next against not
  FP8_SEESAW_BT_SMEM  cutedsl: that loader taking the pages' block-table entries from a cp.async ring in smem against
                 a global read at each page's start
  STORE_16B      cutedsl: O in 16-byte stores after a transpose within each quad against the accumulator's
                 4-byte pairs (bf16 KV, and FP8 at more than 32 rows)
  SPARSE_STORE_16B  cutedsl sparse MLA: the same for its blocks of 64 heads (sparse shapes)
  SPARSE_LAZY_RESCALE, SPARSE_TREE_MAX  cutedsl sparse MLA, 16-bit KV (sparse shapes): the seesaw kernel's
                    LAZY_RESCALE / TREE_MAX below, each against off
  SPARSE_SOFTMAX    both together against neither
  GLUON_BT_EARLY    triton: the 64-row and narrow Gluon kernels' producers reading a page's block-table entry
                    before waiting for its stage against after
  GLUON_STORE_16B   triton: the 64-row Gluon kernel's O converted to 16 bytes a thread before the stores
  GLUON_SEESAW      triton: bf16 64-row blocks through the seesaw kernel (mla_decode_gluon_seesaw.py) against
                    mla_decode_gluon.py's serial page chain
  SEESAW_STORE_16B  triton: the seesaw kernel's O halves stored 16 bytes a thread through a ring stage
  SEESAW_32_ROWS    triton: bf16 steps of 17-32 rows through the 64-row seesaw (padded) against the narrow
                    keys-on-M kernel, both forced (the default picks by split length: bench/NOTES.md 83)
  DEQUANT_WG        triton: FP8 pages at <= 32 rows dequantized by their own warpgroup beside one compute
                    warpgroup against two compute warpgroups dequantizing them in place
  TRITON_FP8_MMA_OFF  triton: FP8 steps of <= 16 rows all through the dequantizing warpgroup against the default
                    (the FP8-MMA kernel for s_q 1, unsplit from 32 pages or in runs of >= 64)
  MIN_SPLITS        triton: at least $DA_MIN_SPLITS (default 2) KV splits a request, against the plan's count
  LAZY_RESCALE   cutedsl: 16-bit KV, a row's running max moved only when it rises by more than 2^8 and O's rescale
                 skipped in warps where no row moved, against every rise and every rescale
  FOLD_SCALE     cutedsl: 16-bit KV, S left unscaled and the softmax scale applied in exp2's FFMA against S scaled
  TREE_MAX       cutedsl: 16-bit KV, each row's max over S folded pairwise against one chain of dependent FMNMX
  SEESAW_SET     cutedsl: 16-bit KV, the seesaw switches named in $DA_SEESAW together (comma-separated; default
                 all three, LAZY_RESCALE,FOLD_SCALE,TREE_MAX) against none
  SPEC_EXP       cutedsl: 16-bit KV, the seesaw owner's P exponentiated against the running max while the tile's max
                 is found (kept where the lazy max does not move) against after it (on top of the defaults)
  CUTEDSL_BALANCED_SPLITS  cutedsl: steps of <= $DA_BALANCE_ROWS (default 64) rows a request planned with their host
                    lengths (two splits where they balance a one-wave grid; decode_plan.BALANCE_SPLITS_MAX_ROWS)
                    against from shapes only
  GRID_ORDER_ALL    cutedsl: every grid of more than one wave (the 16-bit grid, the keys-on-M and FP8-MMA kernels,
                    split grids) takes its requests longest first against only the FP8 seesaw's unsplit ones
  BALANCED_ORDERED  cutedsl: CUTEDSL_BALANCED_SPLITS and GRID_ORDER_ALL together against neither
  KV_PARTS          cutedsl: the 16-bit kernel's pages as $DA_KV_PARTS (default 3) column parts with a full barrier
                    each, S issued part by part as they land, against one barrier a page
  KV_SPLIT          cutedsl: the 16-bit kernel's pages as rope + two V halves, each freed by the consumer that reads
                    it last, and S(t) issued before the wait for the other consumer's P(t-1) (the default from
                    mla_decode.KV_SPLIT_MIN_ROWS rows; $DA_KV_SPLIT_MIN_ROWS sets it for the run), against
                    KV_PARTS's ring
  KV_PREFETCH       cutedsl: the 16-bit kernel's producer prefetches the page $DA_KV_PREFETCH - 1 tiles (default 2:
                    the next page) ahead of the one whose stage it waits for into L2, on either ring (mla_decode.
                    KV_PREFETCH and KV_PARTS_PREFETCH), against no prefetch on either
  SPARSE_FP8_HALF_RING  cutedsl sparse MLA, the FP8 cache (sparse shapes): the bf16 tile as three column-half
                    slots with one raw stage, against one whole tile with two raw stages
  SPARSE_FP8_ONE_BARRIER  cutedsl sparse MLA, the FP8 cache (sparse shapes): the consumers meeting once a tile where
                    no row's max rises (split_consumers.one_barrier_p) against twice every tile
  FP8_F16           cutedsl: FP8 KV at <= 32 rows, the pages' bytes multiplied as f16 in registers
                    (mla_decode_fp8_f16_kernel.py) against the FP8-MMA and bf16-tile kernels
  TRITON_FP8_MMA_MIN_PAGES  triton: the FP8-MMA kernel from $DA_FP8_MMA_MIN_PAGES (default 8) pages unsplit (runs of
                    twice that split) against the table's bound
  NARROW_PIPE_S     triton: FP8 at <= 32 rows, the compute warpgroup beside the dequantizing one issuing the next
                    page's S^T right behind this page's O^T (mla_decode_gluon_narrow.PIPE_S) against after waiting
  BALANCED_SPLITS   triton: the plan's split count from the requests' host lengths (two splits where variable
                    lengths leave SMs idle: mla_decode_plan.balanced_splits) against from shapes only

    python scripts/decode_ab.py
    python scripts/decode_ab.py --switch LONGEST_FIRST --shapes "b128 h128 sk4096 var,b128 h128 sq2 sk4096 var"

Shapes: "bB hH [sqN] [skS] [var] [fp8]" (s_q 1, s_k 4096, fixed lengths, bf16 KV unless given); sparse:
"sparse bB hH [sqN] [skvS] [fp8]" (decode, top-k 2048 of s_kv 32768 a request unless given).
"""

import argparse
import dataclasses
import importlib
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mlaserve.bench import inputs as bench_inputs  # noqa: E402
from mlaserve.bench import peers, runners  # noqa: E402
from mlaserve.bench.switches import set_module_value  # noqa: E402
from mlaserve.bench.limits import capture_graphs, interleaved_us, ratio_median, ratio_quartiles  # noqa: E402
from mlaserve.bench.shapes import DenseShape, SparseShape  # noqa: E402

DEFAULT_SHAPES = ("b128 h128 sk4096,b128 h128 sk8192,b128 h128 sk16384,b128 h128 sq2 sk4096,b128 h128 sq2 sk8192,"
                  "b128 h128 sq2 sk32768,b128 h64 sq2 sk4096,b128 h64 sq2 sk16384,b128 h128 sk4096 var,"
                  "b128 h128 sk16384 var,b128 h128 sq2 sk4096 var,b128 h128 sq2 sk8192 var,b128 h128 sq2 sk16384 var")


def _module_flag(module: str, name: str):
    """A setter of one boolean flag of a module."""
    return _module_flags(module, (name,))


def _module_flags(module: str, names: tuple[str, ...]):
    """A setter of several boolean flags of one module together."""
    def switch(on: bool):
        m = importlib.import_module(module)
        for name in names:
            setattr(m, name, on)
    return switch


def _grid_order(on: bool):
    td = importlib.import_module("mlaserve.kernels.triton.mla_decode")
    wo = importlib.import_module("mlaserve.kernels.triton.work_order")
    td.grid_order = wo.grid_order if on else (lambda *args: None)


def _cluster4(on: bool):
    """Clusters of 4 CTAs wherever a request's 64-row tiles come in fours (h 128 s_q 2: 256 rows), else the
    module's choice."""
    cd = importlib.import_module("mlaserve.kernels.cutedsl.mla_decode")
    default = _cluster4.__dict__.setdefault("default", cd.cluster_size)
    cd.cluster_size = ((lambda rows, kv_fp8: 4 if not kv_fp8 and -(-rows // cd.TILE_M) % 4 == 0
                        else default(rows, kv_fp8)) if on else default)


def _fp8_mma_force(on: bool):
    """The FP8-MMA kernel for every FP8 step of <= 16 rows, however short its splits, against the split rule."""
    cd = importlib.import_module("mlaserve.kernels.cutedsl.mla_decode")
    rule = _fp8_mma_force.__dict__.setdefault("rule", cd.uses_fp8_mma)
    cd.uses_fp8_mma = ((lambda kv_fp8, rows, max_pages, num_splits: cd.FP8_MMA and kv_fp8
                        and cd.fp8_narrow_cols(rows) == 16) if on else rule)


def _cutedsl_balance_rows(on: bool):
    """The CuTe DSL plan's host-length splits up to DA_BALANCE_ROWS (default 64) rows a request, against never."""
    cd = importlib.import_module("mlaserve.kernels.cutedsl.decode_plan")
    cd.BALANCE_SPLITS_MAX_ROWS = int(os.environ.get("DA_BALANCE_ROWS", "64")) if on else 0


def _kv_parts(on: bool):
    """The 16-bit CuTe DSL kernel's pages as DA_KV_PARTS (default 3) column parts, S issued part by part as they land
    (mla_decode.KV_PARTS), against one barrier a page."""
    importlib.import_module("mlaserve.kernels.cutedsl.mla_decode").KV_PARTS = (
        int(os.environ.get("DA_KV_PARTS", "3")) if on else 1)


def _kv_split(on: bool):
    """KV_SPLIT's ring from DA_KV_SPLIT_MIN_ROWS rows a request (default: the module's KV_SPLIT_MIN_ROWS), against
    KV_PARTS's ring everywhere."""
    cd = importlib.import_module("mlaserve.kernels.cutedsl.mla_decode")
    default = _kv_split.__dict__.setdefault("default", cd.KV_SPLIT_MIN_ROWS)
    cd.KV_SPLIT = on
    cd.KV_SPLIT_MIN_ROWS = int(os.environ.get("DA_KV_SPLIT_MIN_ROWS", default))


def _kv_prefetch(on: bool):
    """The 16-bit CuTe DSL kernel's L2 prefetch DA_KV_PREFETCH (default 2) tiles ahead on both of its KV rings
    (mla_decode.KV_PREFETCH and KV_PARTS_PREFETCH), against none on either."""
    cd = importlib.import_module("mlaserve.kernels.cutedsl.mla_decode")
    cd.KV_PREFETCH = cd.KV_PARTS_PREFETCH = int(os.environ.get("DA_KV_PREFETCH", "2")) if on else 0


def _balanced_ordered(on: bool):
    """The CuTe DSL plan's host-length splits up to DA_BALANCE_ROWS (default 64) rows with every grid of more than
    one wave taken longest first (GRID_ORDER_ALL), against neither."""
    _cutedsl_balance_rows(on)
    importlib.import_module("mlaserve.kernels.cutedsl.mla_decode").GRID_ORDER_ALL = on


def _seesaw_32_rows(on: bool):
    """bf16 steps of 17-32 rows per request through the 64-row seesaw (padded rows) against the narrow kernel,
    whatever mla_decode_plan.SEESAW_32_MIN_PAGES would pick."""
    plan = importlib.import_module("mlaserve.kernels.triton.mla_decode_plan")
    plan.SEESAW_32_MIN_PAGES = 0 if on else 1 << 30


def _triton_fp8_mma_pages(pages):
    """A setter of triton's FP8-MMA page bound (mla_decode_plan.uses_fp8_mma): pages() when on, the table's when off.
    TRITON_FP8_MMA_OFF: 0 (every FP8 step of <= 16 rows through the dequantizing warpgroup, the FP8-MMA kernel
    never); TRITON_FP8_MMA_MIN_PAGES: DA_FP8_MMA_MIN_PAGES (default 8) pages unsplit, runs of twice that split."""
    saved = {}

    def switch(on: bool):
        plan = importlib.import_module("mlaserve.kernels.triton.mla_decode_plan")
        cfg = saved.setdefault("cfg", plan.DEFAULT_CONFIGS[(16, "fp8")])
        plan.DEFAULT_CONFIGS[(16, "fp8")] = dataclasses.replace(cfg, fp8_mma_min_pages=pages()) if on else cfg
    return switch


def _min_splits(on: bool):
    """At least DA_MIN_SPLITS KV splits a request (split grids of more than one wave are ordered longest first)
    against the plan's split count."""
    plan = importlib.import_module("mlaserve.kernels.triton.mla_decode_plan")
    saved = _min_splits.__dict__.setdefault("saved", plan.choose_num_splits)
    n = int(os.environ.get("DA_MIN_SPLITS", "2"))
    plan.choose_num_splits = (lambda *args: max(n, saved(*args))) if on else saved


SEESAW_SWITCHES = ("LAZY_RESCALE", "FOLD_SCALE", "TREE_MAX")


def _seesaw_set(on: bool):
    """The seesaw switches named in DA_SEESAW (comma-separated; default all of them) on, against all off; SPEC_EXP,
    built on LAZY_RESCALE and FOLD_SCALE, off in both."""
    m = importlib.import_module("mlaserve.kernels.cutedsl.mla_decode")
    m.SPEC_EXP = False
    for name in SEESAW_SWITCHES:
        setattr(m, name, False)
    if on:
        for name in (n.strip() for n in os.environ.get("DA_SEESAW", ",".join(SEESAW_SWITCHES)).split(",")):
            if name not in SEESAW_SWITCHES:
                raise SystemExit(f"DA_SEESAW: {name!r} is not one of {', '.join(SEESAW_SWITCHES)}")
            setattr(m, name, True)


SPARSE_SOFTMAX = ("LAZY_RESCALE", "TREE_MAX")


# switch -> (backend, setter(on))
SWITCHES = {
    "PERSISTENT": ("cutedsl", _module_flag("mlaserve.kernels.cutedsl.mla_decode", "PERSISTENT")),
    "LONGEST_FIRST": ("cutedsl", _module_flag("mlaserve.kernels.cutedsl.mla_decode", "LONGEST_FIRST")),
    "STREAM_K": ("cutedsl", _module_flag("mlaserve.kernels.cutedsl.mla_decode", "STREAM_K")),
    "EARLY_SUMS": ("cutedsl", _module_flag("mlaserve.kernels.cutedsl.mla_decode", "EARLY_SUMS")),
    "RANK_ORDER": ("cutedsl", _module_flag("mlaserve.kernels.cutedsl.mla_decode", "RANK_ORDER")),
    "FP8_N32_TWO_TILES": ("cutedsl", _module_flag("mlaserve.kernels.cutedsl.mla_decode", "FP8_N32_TWO_TILES")),
    "FP8_MMA": ("cutedsl", _module_flag("mlaserve.kernels.cutedsl.mla_decode", "FP8_MMA")),
    "BT_AHEAD": ("cutedsl", _module_flag("mlaserve.kernels.cutedsl.mla_decode", "BT_AHEAD")),
    "FP8_MMA_FORCE": ("cutedsl", _fp8_mma_force),
    "CLUSTER4": ("cutedsl", _cluster4),
    "GRID_ORDER": ("triton", _grid_order),
    "FP8_MMA_VEC_IO": ("cutedsl", _module_flag("mlaserve.kernels.cutedsl.mla_decode", "FP8_MMA_VEC_IO")),
    "FP8_MMA_EARLY_REFILL": ("cutedsl", _module_flag("mlaserve.kernels.cutedsl.mla_decode", "FP8_MMA_EARLY_REFILL")),
    "FP8_EARLY_START": ("cutedsl", _module_flag("mlaserve.kernels.cutedsl.mla_decode", "FP8_EARLY_START")),
    "FP8_SPLIT_EPILOGUE": ("cutedsl", _module_flag("mlaserve.kernels.cutedsl.mla_decode", "FP8_SPLIT_EPILOGUE")),
    "FP8_F16_GROUP_S": ("cutedsl", _module_flag("mlaserve.kernels.cutedsl.mla_decode", "FP8_F16_GROUP_S")),
    "FP8_F16_STAGGER": ("cutedsl", _module_flag("mlaserve.kernels.cutedsl.mla_decode", "FP8_F16_STAGGER")),
    "FP8_SEESAW_PREFETCH": ("cutedsl", _module_flag("mlaserve.kernels.cutedsl.mla_decode", "FP8_SEESAW_PREFETCH")),
    "FP8_SEESAW_BT_SMEM": ("cutedsl", _module_flag("mlaserve.kernels.cutedsl.mla_decode", "FP8_SEESAW_BT_SMEM")),
    "STORE_16B": ("cutedsl", _module_flag("mlaserve.kernels.cutedsl.mla_decode", "STORE_16B")),
    "SPARSE_STORE_16B": ("cutedsl", _module_flag("mlaserve.kernels.cutedsl.sparse_mla", "STORE_16B")),
    "SPARSE_LAZY_RESCALE": ("cutedsl", _module_flag("mlaserve.kernels.cutedsl.sparse_mla", "LAZY_RESCALE")),
    "SPARSE_TREE_MAX": ("cutedsl", _module_flag("mlaserve.kernels.cutedsl.sparse_mla", "TREE_MAX")),
    "SPARSE_SOFTMAX": ("cutedsl", _module_flags("mlaserve.kernels.cutedsl.sparse_mla", SPARSE_SOFTMAX)),
    "GLUON_BT_EARLY": ("triton", _module_flag("mlaserve.kernels.triton.mla_decode_gluon", "BT_EARLY")),
    "GLUON_STORE_16B": ("triton", _module_flag("mlaserve.kernels.triton.mla_decode_gluon", "STORE_16B")),
    "GLUON_SEESAW": ("triton", _module_flag("mlaserve.kernels.triton.mla_decode_gluon_seesaw", "SEESAW")),
    "SEESAW_STORE_16B": ("triton", _module_flag("mlaserve.kernels.triton.mla_decode_gluon_seesaw", "STORE_16B")),
    "SEESAW_32_ROWS": ("triton", _seesaw_32_rows),
    "DEQUANT_WG": ("triton", _module_flag("mlaserve.kernels.triton.mla_decode_gluon_narrow", "DEQUANT_WG")),
    "TRITON_FP8_MMA_OFF": ("triton", _triton_fp8_mma_pages(lambda: 0)),
    "MIN_SPLITS": ("triton", _min_splits),
    "TRITON_FP8_MMA_MIN_PAGES": ("triton", _triton_fp8_mma_pages(lambda: int(os.environ.get("DA_FP8_MMA_MIN_PAGES",
                                                                                             "8")))),
    "BALANCED_SPLITS": ("triton", _module_flag("mlaserve.kernels.triton.mla_decode_plan", "BALANCE_SPLITS")),
    "LAZY_RESCALE": ("cutedsl", _module_flag("mlaserve.kernels.cutedsl.mla_decode", "LAZY_RESCALE")),
    "FOLD_SCALE": ("cutedsl", _module_flag("mlaserve.kernels.cutedsl.mla_decode", "FOLD_SCALE")),
    "TREE_MAX": ("cutedsl", _module_flag("mlaserve.kernels.cutedsl.mla_decode", "TREE_MAX")),
    "SEESAW_SET": ("cutedsl", _seesaw_set),
    "SPEC_EXP": ("cutedsl", _module_flag("mlaserve.kernels.cutedsl.mla_decode", "SPEC_EXP")),
    "CUTEDSL_BALANCED_SPLITS": ("cutedsl", _cutedsl_balance_rows),
    "GRID_ORDER_ALL": ("cutedsl", _module_flag("mlaserve.kernels.cutedsl.mla_decode", "GRID_ORDER_ALL")),
    "BALANCED_ORDERED": ("cutedsl", _balanced_ordered),
    "KV_PARTS": ("cutedsl", _kv_parts),
    "KV_SPLIT": ("cutedsl", _kv_split),
    "KV_PREFETCH": ("cutedsl", _kv_prefetch),
    "SPARSE_FP8_HALF_RING": ("cutedsl", _module_flag("mlaserve.kernels.cutedsl.sparse_mla", "FP8_HALF_RING")),
    "SPARSE_FP8_ONE_BARRIER": ("cutedsl", _module_flag("mlaserve.kernels.cutedsl.sparse_mla", "FP8_ONE_BARRIER")),
    "FP8_F16": ("cutedsl", _module_flag("mlaserve.kernels.cutedsl.mla_decode", "FP8_F16")),
    "NARROW_PIPE_S": ("triton", _module_flag("mlaserve.kernels.triton.mla_decode_gluon_narrow", "PIPE_S")),
}


def parse_shape(spec: str):
    """A DenseShape or SparseShape from the --shapes syntax (module docstring)."""
    w = spec.split()
    sparse = w[0] == "sparse"
    w = w[1:] if sparse else w
    b, h = int(w[0][1:]), int(w[1][1:])
    s_q = next((int(x[2:]) for x in w if x.startswith("sq")), 1)
    kv = "fp8" if "fp8" in w else "bf16"
    if sparse:
        s_kv = next((int(x[3:]) for x in w if x.startswith("skv")), 32768)
        return SparseShape("decode", b, s_q, s_kv, h, kv=kv)
    s_k = next((int(x[2:]) for x in w if x.startswith("sk")), 4096)
    return DenseShape(b, s_q, s_k, h, kv, varlen="var" in w)


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
    ap.add_argument("--rounds", type=int, default=30, help="interleaved rounds (limits.interleaved_us)")
    ap.add_argument("--seed", type=int, default=None,
                    help="inputs' seed (their page placement among them; default b + h; `bench kernels` uses 0)")
    ap.add_argument("--sustain-ms", type=float, default=0,
                    help="time each turn over back-to-back calls for this long (after as long a warm-up), at the "
                         "clock the GPU holds under load, instead of one call (limits.interleaved_us)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a value of the CuTe DSL's mla_decode module for both arms (e.g. KV_PREFETCH=1 under "
                         "--switch KV_SPLIT); repeatable")
    args = ap.parse_args()
    for item in args.set:
        set_module_value("mlaserve.kernels.cutedsl.mla_decode", item)
    backend, switch = SWITCHES[args.switch]
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, f"backend {backend}", flush=True)
    for spec in args.shapes.split(","):
        shape = parse_shape(spec)
        make = bench_inputs.make_sparse if isinstance(shape, SparseShape) else bench_inputs.make_dense
        inputs = make(shape, dev, seed=shape.b + shape.h if args.seed is None else args.seed, rotate_bytes=256 << 20)
        prep = runners.prepare_ops(backend, shape, inputs)
        on, off = graphs(prep, switch, True), graphs(prep, switch, False)
        out_on = prep.calls[0]()[0]
        switch(False)
        out_off = prep.calls[0]()[0]
        same = torch.equal(out_on, out_off)
        diff = (out_on.float() - out_off.float()).abs().max().item()
        switch(True)
        runs = {"on": on, "off": off}
        try:
            if isinstance(shape, SparseShape):
                raise runners.Unsupported("no sparse FlashInfer peer")
            fprep = peers.prepare("flashinfer", shape, inputs)
            for call in fprep.calls:
                call()
            runs["flashinfer"] = capture_graphs(fprep.calls)
        except runners.Unsupported:
            pass
        except Exception as e:   # FlashInfer missing or failing: the A/B stands without it
            print(f"  flashinfer: {type(e).__name__}: {str(e)[:120]}", flush=True)
        times = interleaved_us(runs, dev, args.rounds, sustain_ms=args.sustain_ms)
        med = {k: statistics.median(v) for k, v in times.items()}
        q1, q3 = ratio_quartiles(times, "off", "on")
        print(f"{spec:28s} {args.switch} on {med['on']:8.1f} us  off {med['off']:8.1f} us  "
              f"off/on {ratio_median(times, 'off', 'on'):.3f}x [{q1:.3f}, {q3:.3f}]"
              + (f"  flashinfer {med['flashinfer']:8.1f} us  fi/on {ratio_median(times, 'flashinfer', 'on'):.3f}x"
                 if "flashinfer" in runs else "")
              + ("" if same else f"  OUTPUTS DIFFER (max abs {diff:.2e})"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
