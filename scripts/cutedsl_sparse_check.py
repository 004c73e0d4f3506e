"""Check and time the CuTe DSL sparse MLA (mlaserve/kernels/cutedsl/sparse_mla.py) on a Hopper GPU.

    python scripts/cutedsl_sparse_check.py            # correctness shapes, then timings
    python scripts/cutedsl_sparse_check.py --quick    # a few shapes, no timings
    python scripts/cutedsl_sparse_check.py --bench    # timings only
    python scripts/cutedsl_sparse_check.py --compile  # compile every specialization only, the bf16/fp16 ones
                                                      # as both the seesaw and the first-slice kernel (works
                                                      # without a GPU with CUTE_DSL_ARCH=sm_90a), print
                                                      # compile seconds
    python scripts/cutedsl_sparse_check.py --fp8      # only the FP8-cache shapes, then the FP8 timings

Prints one PASS/FAIL line per shape with the max abs error against mlaserve.kernels.reference.sparse_mla in
float64 inputs (FlashMLA's tolerances: each element within 1e-3 abs or 2/128 rel, cosine distance <= 1e-5,
lse within 2e-3; tokens whose indices are all -1 exactly out 0, lse -inf). Every cache slot no index points
to holds NaN; index rows carry -1s anywhere (scattered, a whole leading tile, whole rows), repeated slots,
and top-k sizes that are not multiples of 64. FP8-cache cases (kv uint8 [pages, 64, 656] from
ops.quantize_kv_fp8, 0xFF in every unused slot: NaN scales and k_pe) compare against the reference on the
dequantized cache. Exit status 1 if any fails. Timings print TFLOP/s =
2 * tokens * h * topk * (576 + 512) / time beside `mlaserve.ops.sparse_mla(..., backend="triton")`.
"""

import argparse
import importlib
import sys

import torch

sp = importlib.import_module("mlaserve.kernels.cutedsl.sparse_mla")
from mlaserve import ops  # noqa: E402
from mlaserve.kernels import reference
from mlaserve.kernels.tolerance import attention_close  # noqa: E402

SCALE = 192 ** -0.5
PAGE = 64


def make_case(b, s_q, h, topk, s_kv, dtype, seed, device="cuda", poison=True):
    """-> q [b, s_q, h, 576], kv [pages, 64, 576] (NaN in every slot no index names), indices int32 [b, s_q, topk].

    Request i owns s_kv random slots of the cache; each token picks topk of them (with repeats where
    topk > s_kv), then: ~10% of entries -1, entries 1..4 repeat entries 5..8, every 5th token (from the
    2nd) has its first 64 entries -1, every 5th (from the 4th) is all -1 (only when there are >= 4 tokens).
    """
    gen = torch.Generator(device=device).manual_seed(seed)      # on the device: the timing shapes are large
    tokens = b * s_q
    num_slots = (b * s_kv + 3 * PAGE + PAGE - 1) // PAGE * PAGE
    kv = torch.randn(num_slots // PAGE, PAGE, 576, generator=gen, device=device).to(dtype)
    owner = torch.randperm(num_slots, generator=gen, device=device)[:b * s_kv].view(b, s_kv)
    if topk <= s_kv:
        pos = torch.rand(b, s_q, s_kv, generator=gen, device=device).topk(topk, dim=-1).indices
    else:
        pos = torch.randint(0, s_kv, (b, s_q, topk), generator=gen, device=device)
    idx = torch.gather(owner[:, None, :].expand(b, s_q, s_kv), 2, pos).view(tokens, topk)
    if poison:
        idx[torch.rand(tokens, topk, generator=gen, device=device) < 0.1] = -1
        if topk >= 9:
            idx[:, 1:5] = idx[:, 5:9]
        idx[1::5, :64] = -1
        if tokens >= 4:
            idx[3::5] = -1
        used = torch.zeros(num_slots, dtype=torch.bool, device=device)
        used[idx[idx >= 0].long()] = True
        kv.view(num_slots, 576)[~used] = float("nan")
    q = torch.randn(b, s_q, h, 576, generator=gen, device=device).to(dtype)
    return q, kv, idx.view(b, s_q, topk).int()


def make_fp8_case(b, s_q, h, topk, s_kv, seed, poison=True):
    """make_case's inputs (bf16 q) with the cache quantized and every slot no index names 0xFF (NaN scales
    and k_pe; e4m3 0xFF is NaN too). -> q bf16, kv uint8 [pages, 64, 656], indices."""
    q, kv, idx = make_case(b, s_q, h, topk, s_kv, torch.bfloat16, seed, poison=poison)
    unused = kv[..., 0].isnan()
    packed = ops.quantize_kv_fp8(kv.nan_to_num(0.0))
    packed[unused] = 0xFF
    return q, packed, idx


def compare(out, lse, ref_out, ref_lse) -> tuple[bool, float, str]:
    """(ok, max abs err, what failed): FlashMLA-like tolerances with bf16-P slack (mlaserve/kernels/tolerance.py)."""
    return attention_close(out, lse, ref_out, ref_lse)


def cases(quick: bool):
    """Decode b 1/4/64 x s_q 1/2 x h 16/64/128 x topk 64/2048, a prefill, fp16, ragged top-k, forced splits."""
    for b in (1, 4, 64):
        for s_q in (1, 2):
            for h in (16, 64, 128):
                for topk in (64, 2048):
                    if quick and (b == 64 or h == 64):
                        continue
                    yield dict(b=b, s_q=s_q, h=h, topk=topk, s_kv=4096, dtype=torch.bfloat16)
    yield dict(b=1, s_q=256, h=128, topk=2048, s_kv=8192, dtype=torch.bfloat16)
    yield dict(b=4, s_q=2, h=64, topk=2048, s_kv=4096, dtype=torch.float16)
    yield dict(b=3, s_q=2, h=32, topk=100, s_kv=300, dtype=torch.bfloat16)
    yield dict(b=2, s_q=3, h=128, topk=1000, s_kv=700, dtype=torch.bfloat16)      # topk > s_kv: repeats
    yield dict(b=2, s_q=2, h=16, topk=2048, s_kv=4096, dtype=torch.bfloat16, num_splits=3)
    yield dict(b=2, s_q=2, h=128, topk=576, s_kv=4096, dtype=torch.bfloat16, num_splits=16)
    yield from fp8_cases(quick)


def fp8_cases(quick: bool):
    """The FP8 cache: decode b 1/4/64 x s_q 1/2 x h 16/128 x topk 64/2048, a prefill, ragged top-k, splits."""
    for b in (1, 4, 64):
        for s_q in (1, 2):
            for h in (16, 128):
                for topk in (64, 2048):
                    if quick and (b == 64 or s_q == 2):
                        continue
                    yield dict(b=b, s_q=s_q, h=h, topk=topk, s_kv=4096, dtype="fp8")
    yield dict(b=1, s_q=256, h=128, topk=2048, s_kv=8192, dtype="fp8")
    yield dict(b=3, s_q=2, h=32, topk=100, s_kv=300, dtype="fp8")
    yield dict(b=2, s_q=3, h=64, topk=1000, s_kv=700, dtype="fp8")
    yield dict(b=2, s_q=2, h=128, topk=576, s_kv=4096, dtype="fp8", num_splits=16)


def case_name(c) -> str:
    return (f"b{c['b']} s_q{c['s_q']} h{c['h']} topk{c['topk']} s_kv{c['s_kv']} "
            f"{str(c['dtype']).replace('torch.', '')} "
            f"splits={c.get('num_splits', 'auto')}")


def run_case(c, seed):
    """-> (out, lse, ref_out, ref_lse) of one case."""
    if c["dtype"] == "fp8":
        q, kv, idx = make_fp8_case(c["b"], c["s_q"], c["h"], c["topk"], c["s_kv"], seed)
        kv_ref = ops.dequantize_kv_fp8(kv)
    else:
        q, kv, idx = make_case(c["b"], c["s_q"], c["h"], c["topk"], c["s_kv"], c["dtype"], seed)
        kv_ref = kv
    out, lse = sp.sparse_mla(q, kv, idx, SCALE, num_splits=c.get("num_splits"))
    torch.cuda.synchronize()
    ref_out, ref_lse = reference.sparse_mla(q.double(), kv_ref.double(), idx, SCALE)
    return out, lse, ref_out, ref_lse


def check(quick: bool, fp8_only: bool = False) -> int:
    failed = 0
    for seed, c in enumerate(fp8_cases(quick) if fp8_only else cases(quick)):
        print(f"run   {case_name(c)}", flush=True)      # a hang (a pipeline deadlock) names its shape in the log
        try:
            ok, max_err, why = compare(*run_case(c, seed))
        except Exception as e:      # a launch or compile error is this shape's FAIL line, then the next shape
            ok, max_err, why = False, float("nan"), f"{type(e).__name__}: {e}"
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {case_name(c)}  max abs err {max_err:.2e}  {why}", flush=True)
    return failed


def bench(fp8_only: bool = False) -> None:
    import triton.testing
    shapes = (("prefill", 1, 4096, 128, 2048, 32768, "bf16"), ("decode", 128, 2, 128, 2048, 8192, "bf16"),
              ("decode", 128, 1, 128, 2048, 8192, "bf16"), ("decode", 64, 2, 64, 2048, 8192, "bf16"),
              ("decode", 128, 2, 128, 2048, 8192, "fp8"), ("decode", 128, 1, 128, 2048, 8192, "fp8"),
              ("decode", 128, 2, 64, 2048, 8192, "fp8"))
    for kind, b, s_q, h, topk, s_kv, cache in shapes:
        if fp8_only and cache != "fp8":
            continue
        if cache == "fp8":
            q, kv, idx = make_fp8_case(b, s_q, h, topk, s_kv, 0, poison=False)
        else:
            q, kv, idx = make_case(b, s_q, h, topk, s_kv, torch.bfloat16, 0, poison=False)
        flops = 2 * b * s_q * h * topk * (576 + 512)
        plan = sp.plan_splits(b * s_q, h, topk, torch.cuda.get_device_properties(0).multi_processor_count)
        line = f"{kind} {cache} b{b} s_q{s_q} h{h} topk{topk} s_kv{s_kv} splits={plan.num_splits}:"
        for backend in ("cutedsl", "first-slice", "triton"):
            if backend == "first-slice" and cache == "fp8":
                continue
            fn = (lambda: sp.sparse_mla(q, kv, idx, SCALE)) if backend != "triton" else \
                (lambda: ops.sparse_mla(q, kv, idx, SCALE, backend="triton"))
            seesaw_kernel = sp._kernel
            if backend == "first-slice":     # the kernel before the seesaw consumers, for comparison
                sp._kernel = lambda dtype, split, fp8=False: seesaw_kernel(dtype, split, fp8, seesaw=False)
            try:
                fn()
                ms = triton.testing.do_bench(fn, warmup=25, rep=200)
            finally:
                sp._kernel = seesaw_kernel
            line += f"  {backend} {ms * 1e3:8.1f} us {flops / ms / 1e9:6.1f} TFLOP/s"
        print(line, flush=True)


def compile_all() -> None:
    for dtype in (torch.bfloat16, torch.float16):
        for split in (False, True):
            for seesaw in (True, False):
                sp._kernel(dtype, split, seesaw=seesaw)
    for split in (False, True):
        sp._kernel(torch.bfloat16, split, fp8=True)
    for key, sec in sp.compile_seconds.items():
        print(f"compiled {key}: {sec:.1f} s", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--fp8", action="store_true", help="only the FP8-cache shapes and timings")
    args = ap.parse_args()
    if args.compile:
        compile_all()
        return 0
    failed = 0 if args.bench else check(args.quick, args.fp8)
    if not args.quick:
        bench(args.fp8)
    print(f"{failed} shape(s) failed" if failed else "all shapes passed", flush=True)
    print(f"compile seconds: {sp.compile_seconds}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
