"""Compile one CuTe DSL kernel for sm_90a on the CPU (no GPU needed) and print what ptxas made of it: registers and
spills, SASS op counts of the kernel and of its longest loop, the wgmma arrive / wait pattern, and ptxas's own
remarks on the kernel's PTX (`-v`: a C7515 line means its wgmmas were serialized, C7517 / C7519 that ptxas injected
a wait or a fence). A kernel change is checked here before device time is spent (bench/NOTES.md 74, 77).

    python scripts/cutedsl_sass.py fp8mma [--split] [--flag FP8_MMA_VEC_IO=0 ...] [--out DIR] [--ops FILE]
    kinds: bf16 (the 16-bit grid kernel, 64 rows a request unless --rows says more: then clusters as mla_decode
    launches them), bf16-pairs (the persistent ticket launch of 2-CTA clusters that 128 rows a request take, or
    --rows), fp8mma, n16, n32, fp8-seesaw, f16-16, f16-32 (the FP8 decode kernels), sparse, sparse-fp8

--flag sets an mla_decode module flag (sparse_mla's for the sparse kinds) before compiling; --ops writes the
kernel's instructions without addresses and encodings, so that two builds compare with `cmp` (a refactor that
should not change the code: the listing's offsets run to 5 hex digits past 64 KB, which this keeps, NOTES 74).
Needs nvidia-cutlass-dsl (Python 3.12) and Triton's bundled cuobjdump and ptxas. The DSL reads its dump directory
once per process: one kernel a run.
"""

import argparse
import glob
import importlib
import os
import re
import subprocess
import sys
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mlaserve.bench.switches import set_module_value  # noqa: E402

KINDS = ("bf16", "bf16-pairs", "fp8mma", "n16", "n32", "fp8-seesaw", "sparse", "sparse-fp8", "f16-16", "f16-32")
INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,5})\*/\s+(.*?);", re.M)


def compile_kernel(kind: str, split: bool, flags: list[str], ordered: bool = False, rows: int = 0) -> None:
    import torch
    sparse = kind.startswith("sparse")
    mod = importlib.import_module("mlaserve.kernels.cutedsl." + ("sparse_mla" if sparse else "mla_decode"))
    for f in flags:
        set_module_value(mod.__name__, f)
    if sparse:
        # what sparse_mla() compiles: its module flags (16-byte stores unsplit, the seesaw's softmax switches)
        fp8 = kind == "sparse-fp8"
        mod._kernel(torch.bfloat16, split, fp8=fp8, store16=mod.STORE_16B, softmax=(mod.LAZY_RESCALE, mod.TREE_MAX))
    elif kind == "bf16":
        rows = rows or mod.TILE_M
        mod._kernel(torch.bfloat16, True, split, cluster=mod.cluster_size(rows, False), ordered=ordered, rows=rows)
    elif kind == "bf16-pairs":
        if split:
            raise SystemExit("bf16-pairs is a persistent launch: unsplit only")
        mod._kernel(torch.bfloat16, True, False, cluster=2, persistent=True, store16=mod.STORE_16B,
                    early_sums=mod.EARLY_SUMS, rank_order=mod.RANK_ORDER, rows=rows or 2 * mod.TILE_M)
    elif kind == "fp8-seesaw":
        mod._kernel(torch.bfloat16, True, split, kv_fp8=True, ordered=ordered, store16=mod.STORE_16B)
    else:
        narrow = {"fp8mma": 16, "n16": 16, "n32": 32, "f16-16": 16, "f16-32": 32}[kind]
        mod._kernel(torch.bfloat16, True, split, kv_fp8=True, narrow=narrow, fp8_mma=kind == "fp8mma", ordered=ordered,
                    fp8_f16=kind.startswith("f16"))


def _op(text: str) -> str:
    words = text.split()
    return words[1] if words[0].startswith("@") else words[0]


def longest_loop(instrs: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The instructions between the target of the longest backward branch and the branch, leaving out spans with an
    EXIT or RET in them (the slow paths ptxas puts after the kernel's end jump back into it; they are no loops)."""
    at = {a: i for i, (a, _) in enumerate(instrs)}
    best = []
    for i, (a, text) in enumerate(instrs):
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in at:
            body = instrs[at[int(m.group(1), 16)]:i + 1]
            if len(body) > len(best) and not any(_op(t) in ("EXIT", "RET") or _op(t).startswith("RET.")
                                                 for _, t in body):
                best = body
    return best


def ptxas_remarks(ptxas: str, ptx_path: str, out: str) -> list[str]:
    """ptxas -v's C75xx remarks on the PTX; where this ptxas is older than the PTX's ISA version, the version line is
    lowered to the newest it takes (the kernels use nothing newer)."""
    text = open(ptx_path).read()
    for _ in range(2):
        path = os.path.join(out, "ptxas_input.ptx")
        open(path, "w").write(text)
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(out, "ptxas.cubin")],
                           capture_output=True, text=True)
        newest = re.search(r"Unsupported \.version [0-9.]+; current version is '([0-9.]+)'", r.stderr)
        if not newest:
            break
        text = re.sub(r"^\.version [0-9.]+", f".version {newest.group(1)}", text, count=1, flags=re.M)
    remarks = Counter()
    for code, what in re.findall(r"\((C75\d+)\) (.*?) in function", r.stderr):
        remarks[f"{code} {re.sub(r'line [0-9]+', 'line N', what)}"] += 1
    return [f"{n} x {m}" for m, n in remarks.items()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=KINDS)
    ap.add_argument("--split", action="store_true", help="the split-KV specialization (fp32 partials)")
    ap.add_argument("--flag", action="append", default=[],
                    help="NAME=VALUE, a bool or int of the module set before compiling")
    ap.add_argument("--ordered", action="store_true", help="a grid kind's ordered launch (requests through an order)")
    ap.add_argument("--rows", type=int, default=0,
                    help="the 16-bit kinds' query rows a request, which pick the KV ring (mla_decode.kv_ring) and, for "
                         "bf16, the cluster (default: 64 for bf16, 128 for bf16-pairs)")
    ap.add_argument("--out", default="/tmp/cutedsl_sass")
    ap.add_argument("--ops", default=None, help="write the instruction list (no addresses, no encodings) here")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    for f in glob.glob(os.path.join(a.out, "*")):
        os.remove(f)
    os.environ.update(CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx,cubin", CUTE_DSL_DUMP_DIR=a.out)
    compile_kernel(a.kind, a.split, a.flag, a.ordered, a.rows)
    import triton
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
    cubin, ptx = (sorted(glob.glob(os.path.join(a.out, f"*.{ext}")))[-1] for ext in ("cubin", "ptx"))
    sass = subprocess.run([f"{bindir}/cuobjdump", "-sass", cubin], capture_output=True, text=True).stdout
    open(os.path.join(a.out, "k.sass"), "w").write(sass)
    instrs = [(int(m.group(1), 16), m.group(2).strip()) for m in INSTR.finditer(sass)]
    if a.ops:
        open(a.ops, "w").write("\n".join(t for _, t in instrs) + "\n")
    usage = subprocess.run([f"{bindir}/cuobjdump", "-res-usage", cubin], capture_output=True, text=True).stdout
    print(a.kind, "split" if a.split else "", f"rows {a.rows}" if a.rows else "", " ".join(a.flag))
    print("resources:", " ".join(re.findall(r"(?:REG|STACK|SHARED|LOCAL):\d+", usage)), f"instructions:{len(instrs)}")
    print("SASS:", " ".join(f"{o}:{n}" for o, n in Counter(_op(t).split(".")[0] for _, t in instrs).most_common(30)))
    loop = longest_loop(instrs)
    print(f"longest loop ({len(loop)} instructions):",
          " ".join(f"{o}:{n}" for o, n in Counter(_op(t).split(".")[0] for _, t in loop).most_common(30)))
    wg = Counter(re.sub(r"\s+", " ", t) for _, t in instrs if _op(t).startswith("WARPGROUP"))
    print("wgmma arrive / wait:", "; ".join(f"{n} x {t}" for t, n in sorted(wg.items())) or "none")
    remarks = ptxas_remarks(f"{bindir}/ptxas", ptx, a.out)
    print("ptxas remarks:", "none" if not remarks else "")
    for r in remarks:
        print("  " + r[:240])


if __name__ == "__main__":
    main()
