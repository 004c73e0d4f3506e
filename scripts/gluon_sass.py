"""Compile a Gluon decode kernel for sm_90a on the CPU (no GPU needed) and print its SASS op counts, registers and
shared memory: a kernel change is checked for what ptxas made of it before device time is spent.

    python scripts/gluon_sass.py fp8mma [--causal 0|1] [--split 0|1] [--out DIR] [--module VARIANT]
    python scripts/gluon_sass.py narrow [--fp8 0|1] [--rows 16|32] ...      # mla_decode_gluon_narrow.py
    python scripts/gluon_sass.py rows64 [--fp8 0|1] [--store16 0|1] ...    # mla_decode_gluon.py
    python scripts/gluon_sass.py seesaw [--split 0|1] ...                  # mla_decode_gluon_seesaw.py
"""

import argparse
import os
import re
import subprocess
import sys
from collections import Counter

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import mangle_type

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _fp8_descs():
    flat = torch.zeros(64 * 4, 656, dtype=torch.uint8)
    ckv = TensorDescriptor.from_tensor(flat.view(torch.float8_e4m3fn), [64, 128],
                                       gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2))
    sc = TensorDescriptor.from_tensor(flat.view(torch.float32), [64, 4],
                                      gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
    kpe = TensorDescriptor.from_tensor(flat.view(torch.bfloat16), [64, 64],
                                       gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    return [mangle_type(d) for d in (ckv, sc, kpe)]


def fp8mma(causal, split, module="mlaserve.kernels.triton.mla_decode_gluon_fp8mma", ordered=0):
    import importlib
    m = importlib.import_module(module)
    d = _fp8_descs()
    sig = {"ckv_desc": d[0], "sc_desc": d[1], "kpe_desc": d[2], "q_ptr": "*bf16", "bt_ptr": "*i32",
           "seqlens_ptr": "*i32", "out_ptr": "*bf16", "lse_ptr": "*fp32", "po_ptr": "*fp32", "pl_ptr": "*fp32",
           "order_ptr": "*i32", "qk_scale": "fp32", "num_splits": "i32", "H": "i32", "S_Q": "i32", "ROWS": "i32",
           "stride_qb": "i32", "stride_btb": "i32", "stride_pob": "i32", "stride_pos": "i32", "CAUSAL": "constexpr",
           "IS_SPLIT": "constexpr", "ORDERED": "constexpr"}
    return m._mla_decode_fp8mma_kernel, sig, {"CAUSAL": causal, "IS_SPLIT": split, "ORDERED": ordered}


def narrow(causal, split, module="mlaserve.kernels.triton.mla_decode_gluon_narrow", fp8=1, rows=16, dq=1,
           ordered=0, bt_early=1, pipe_s=0):
    import importlib
    m = importlib.import_module(module)
    d = _fp8_descs()
    if not fp8:
        flat = torch.zeros(64 * 4, 576, dtype=torch.bfloat16)
        d = [mangle_type(TensorDescriptor.from_tensor(flat, [64, 64], gl.NVMMASharedLayout(
            swizzle_byte_width=128, element_bitwidth=16, rank=2)))] * 3
    sig = {"ckv_desc": d[0], "sc_desc": d[1], "kpe_desc": d[2], "q_ptr": "*bf16", "bt_ptr": "*i32",
           "seqlens_ptr": "*i32", "out_ptr": "*bf16", "lse_ptr": "*fp32", "po_ptr": "*fp32", "pl_ptr": "*fp32",
           "order_ptr": "*i32", "qk_scale": "fp32", "num_splits": "i32", "H": "i32", "S_Q": "i32", "ROWS": "i32",
           "stride_qb": "i32", "stride_btb": "i32", "stride_pob": "i32", "stride_pos": "i32", "CAUSAL": "constexpr",
           "IS_SPLIT": "constexpr", "STAGES": "constexpr", "KV_FP8": "constexpr", "BLOCK_R": "constexpr",
           "DQ_WG": "constexpr", "ORDERED": "constexpr", "BT_EARLY": "constexpr", "PIPE_S_": "constexpr"}
    dq = dq and fp8
    return m._mla_decode_narrow_kernel, sig, {"CAUSAL": causal, "IS_SPLIT": split,
                                              "STAGES": m.ring_stages(fp8, rows, dq), "KV_FP8": fp8, "BLOCK_R": rows,
                                              "DQ_WG": dq, "ORDERED": ordered, "BT_EARLY": bt_early,
                                              "PIPE_S_": pipe_s}


def rows64(causal, split, module="mlaserve.kernels.triton.mla_decode_gluon", fp8=0, ordered=0, store16=1,
           bt_early=1):
    import importlib
    m = importlib.import_module(module)
    flat = torch.zeros(64 * 4, 576, dtype=torch.bfloat16)
    d = [mangle_type(TensorDescriptor.from_tensor(flat, [64, 64], gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=16, rank=2)))] * 4
    if fp8:
        d = d[:1] + _fp8_descs()
    sig = {"q_desc": d[0], "kv_desc": d[1], "sc_desc": d[2], "kpe_desc": d[3], "bt_ptr": "*i32",
           "seqlens_ptr": "*i32", "out_ptr": "*bf16", "lse_ptr": "*fp32", "po_ptr": "*fp32", "pl_ptr": "*fp32",
           "order_ptr": "*i32", "qk_scale": "fp32", "num_splits": "i32", "H": "i32", "S_Q": "i32", "ROWS": "i32",
           "stride_btb": "i32", "stride_pob": "i32", "stride_pos": "i32", "CAUSAL": "constexpr",
           "IS_SPLIT": "constexpr", "STAGES": "constexpr", "DTYPE": "constexpr", "KV_FP8": "constexpr",
           "ORDERED": "constexpr", "STORE_16B": "constexpr", "BT_EARLY": "constexpr"}
    return m._mla_decode_gluon_kernel, sig, {"CAUSAL": causal, "IS_SPLIT": split, "STAGES": 2, "DTYPE": gl.bfloat16,
                                             "KV_FP8": fp8, "ORDERED": ordered, "STORE_16B": store16,
                                             "BT_EARLY": bt_early}


def seesaw(causal, split, module="mlaserve.kernels.triton.mla_decode_gluon_seesaw", ordered=0, bt_early=1,
           store16=1):
    import importlib
    m = importlib.import_module(module)
    flat = torch.zeros(64 * 4, 576, dtype=torch.bfloat16)
    d = mangle_type(TensorDescriptor.from_tensor(flat, [64, 64], gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=16, rank=2)))
    sig = {"q_desc": d, "kv_desc": d, "bt_ptr": "*i32", "seqlens_ptr": "*i32", "out_ptr": "*bf16", "lse_ptr": "*fp32",
           "po_ptr": "*fp32", "pl_ptr": "*fp32", "order_ptr": "*i32", "qk_scale": "fp32", "num_splits": "i32",
           "H": "i32", "S_Q": "i32", "ROWS": "i32", "stride_btb": "i32", "stride_pob": "i32", "stride_pos": "i32",
           "CAUSAL": "constexpr", "IS_SPLIT": "constexpr", "DTYPE": "constexpr", "ORDERED": "constexpr",
           "BT_EARLY": "constexpr", "STORE_16B": "constexpr"}
    return m._mla_decode_seesaw_kernel, sig, {"CAUSAL": causal, "IS_SPLIT": split, "DTYPE": gl.bfloat16,
                                              "ORDERED": ordered, "BT_EARLY": bt_early, "STORE_16B": store16}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kernel", choices=["fp8mma", "narrow", "rows64", "seesaw"])
    ap.add_argument("--causal", type=int, default=1)
    ap.add_argument("--split", type=int, default=0)
    ap.add_argument("--out", default="/tmp/gluon_sass")
    ap.add_argument("--module", default=None, help="the kernel's module (a variant of it)")
    ap.add_argument("--fp8", type=int, default=1, help="narrow: FP8 KV (else bf16)")
    ap.add_argument("--rows", type=int, default=16, help="narrow: BLOCK_R, 16 or 32")
    ap.add_argument("--dq", type=int, default=1,
                    help="narrow, FP8: the dequantizing warpgroup (DQ_WG), else in place")
    ap.add_argument("--ordered", type=int, default=0, help="the request axis through an order (ORDERED)")
    ap.add_argument("--pipe-s", type=int, default=0, help="narrow, DQ_WG: PIPE_S (the next S^T behind O^T)")
    ap.add_argument("--store16", type=int, default=1, help="rows64, seesaw: STORE_16B")
    ap.add_argument("--bt-early", type=int, default=1,
                    help="rows64, narrow: BT_EARLY (block-table reads before the stage waits)")
    a = ap.parse_args()
    num_warps = 4
    if a.kernel == "fp8mma":
        fn, sig, consts = fp8mma(a.causal, a.split, *([a.module] if a.module else []), ordered=a.ordered)
    elif a.kernel == "rows64":
        fn, sig, consts = rows64(a.causal, a.split, *([a.module] if a.module else []), fp8=a.fp8 if a.fp8 != 1 or
                                 "--fp8" in sys.argv else 0, ordered=a.ordered, store16=a.store16,
                                 bt_early=a.bt_early)
        num_warps = 8
    elif a.kernel == "seesaw":
        fn, sig, consts = seesaw(a.causal, a.split, *([a.module] if a.module else []), ordered=a.ordered,
                                 bt_early=a.bt_early, store16=a.store16)
    else:
        fn, sig, consts = narrow(a.causal, a.split, *([a.module] if a.module else []), fp8=a.fp8, rows=a.rows,
                                 dq=a.dq, ordered=a.ordered, bt_early=a.bt_early, pipe_s=a.pipe_s)
    # pointers 16-byte aligned and strides multiples of 16, as Triton specializes them at launch
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(sig.items())
             if ty.startswith("*") or name.startswith("stride_")}
    k = triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps))
    os.makedirs(a.out, exist_ok=True)
    open(f"{a.out}/k.cubin", "wb").write(k.asm["cubin"])
    open(f"{a.out}/k.ptx", "w").write(k.asm["ptx"])
    open(f"{a.out}/k.ttgir", "w").write(k.asm["ttgir"])
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
    sass = subprocess.run([f"{bindir}/cuobjdump", "-sass", f"{a.out}/k.cubin"], capture_output=True, text=True).stdout
    open(f"{a.out}/k.sass", "w").write(sass)
    ops = Counter(o.split(".")[0] for o in
                  re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M))
    print("SASS:", " ".join(f"{o}:{n}" for o, n in ops.most_common(40)))
    print("shared:", k.metadata.shared, "bytes")
    print(subprocess.run([f"{bindir}/cuobjdump", "-res-usage", f"{a.out}/k.cubin"], capture_output=True,
                         text=True).stdout.strip().splitlines()[-1].strip())


if __name__ == "__main__":
    main()
