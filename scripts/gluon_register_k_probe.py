"""Compile-only probe (no GPU needed): can a Gluon kernel feed wgmma K as a register A operand straight from the
e4m3 bytes of a page, with no data movement between the 16-byte shared-memory loads and the MMA?

    python scripts/gluon_register_k_probe.py      # compiles for sm_90a, prints the SASS op counts

The trick (bench/NOTES.md item 41): permute the contraction dimension. wgmma's A fragment gives a thread keys r and
r + 8 and, per k-step of 16, logical columns {2c, 2c+1, 2c+8, 2c+9} (c = lane % 4). Let the thread instead own the
physical columns 128 g + 32 c .. + 31 of its keys (g = 0..3, one per FP8 scale group): 32 contiguous bytes per
group, so the loads are LDS.128, and the 4 lanes of a row hit different banks under the 128-byte swizzle. The
register tensor is then reshaped and permuted so that physical 128 g + 32 c + 4 j' + 2 e1 + e0 becomes logical
16 (8 g + j') + 8 e1 + 2 c + e0; Q must be permuted the same way (S^T = K Q^T sums over the columns in any order).
Triton's linear layouts find that the permuted layout is wgmma's A layout: the convert_layout is free. Seen with
Triton 3.6: 16 LDS.128, no LDSM or SHFL, 24 STS (the probe's own stores of K and Q), 32 HGMMA with register A,
166 registers for a whole page of A in flight. Without the permute the same convert goes through shared memory
(32 LDSM, 56 STS, 254 registers): the counts tell the two apart.
"""

import os
import re
import subprocess
import sys
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from mlaserve.kernels.triton.mla_decode_gluon import e4m3_times  # noqa: E402


@gluon.jit
def probe(k_ptr, q_ptr, out_ptr):
    """S^T [64 keys, 16 rows] = K Q^T for one page, K through the permuted register path (Q unpermuted here: the
    probe is about the code, not the values)."""
    # raw e4m3 page [64, 512] in smem, 128B-swizzled (as TMA writes it)
    RAWL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    raw = gl.allocate_shared_memory(gl.float8e4nv, [64, 512], RAWL)
    BL: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    r = gl.arange(0, 64, gl.SliceLayout(1, BL))
    c = gl.arange(0, 512, gl.SliceLayout(0, BL))
    raw.store(gl.load(k_ptr + r[:, None] * 512 + c[None, :]).to(gl.float8e4nv, bitcast=True))
    # each thread (warp w, lane l): rows 16 w + l // 4 and + 8; columns 128 g + 32 (l % 4) .. + 31, g = 0..3
    LD: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [0, 128], [0, 256], [8, 0]],
        lane_bases=[[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 512])
    x = raw.load(LD).to(gl.uint8, bitcast=True)
    cb = gl.full([64, 512], 1.0, gl.bfloat16, LD)
    k = e4m3_times(x, cb)                                    # bf16 [64, 512] in LD
    k6 = gl.reshape(k, [64, 4, 4, 8, 2, 2])                  # physical columns as (g, c, j', e1, e0)
    k6 = gl.permute(k6, [0, 1, 3, 4, 2, 5])                  # logical (g, j', e1, c, e0)
    kl = gl.reshape(k6, [64, 512])
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    AL: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    a = gl.convert_layout(kl, AL)
    QS: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    qs = gl.allocate_shared_memory(gl.bfloat16, [16, 512], QS)
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    qr = gl.arange(0, 16, gl.SliceLayout(1, QL))
    qc = gl.arange(0, 512, gl.SliceLayout(0, QL))
    qs.store(gl.load(q_ptr + qr[:, None] * 512 + qc[None, :]))
    fence_async_shared()
    acc = warpgroup_mma(a, qs.permute((1, 0)), gl.zeros([64, 16], gl.float32, ACC), is_async=True)
    acc = warpgroup_mma_wait(0, deps=[acc])
    orr = gl.arange(0, 64, gl.SliceLayout(1, ACC))
    occ = gl.arange(0, 16, gl.SliceLayout(0, ACC))
    gl.store(out_ptr + orr[:, None] * 16 + occ[None, :], acc)


def main():
    sig = {"k_ptr": "*u8", "q_ptr": "*bf16", "out_ptr": "*fp32"}
    k = triton.compile(GluonASTSource(probe, sig, {}), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
    out = os.environ.get("PROBE_OUT", "/tmp/gluon_register_k_probe")
    os.makedirs(out, exist_ok=True)
    open(f"{out}/k.cubin", "wb").write(k.asm["cubin"])
    sass = subprocess.run([f"{bindir}/cuobjdump", "-sass", f"{out}/k.cubin"], capture_output=True, text=True).stdout
    open(f"{out}/k.sass", "w").write(sass)
    ops = Counter(o.split(".")[0] for o in
                  re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M))
    print("SASS:", " ".join(f"{k}:{v}" for k, v in ops.most_common(30)))
    print("LDS.128:", sass.count("LDS.128"), " LDSM:", ops["LDSM"], " SHFL:", ops["SHFL"], " STS:", ops["STS"],
          " HGMMA:", ops["HGMMA"])
    print(subprocess.run([f"{bindir}/cuobjdump", "-res-usage", f"{out}/k.cubin"], capture_output=True,
                         text=True).stdout.splitlines()[-1].strip())


if __name__ == "__main__":
    main()
