"""Check and time the CuTe DSL MLA decode (mlaserve/kernels/cutedsl) on a Hopper GPU.

    python scripts/cutedsl_check.py            # correctness shapes, then timings
    python scripts/cutedsl_check.py --quick    # a few shapes, no timings
    python scripts/cutedsl_check.py --compile  # compile every specialization only (works without a GPU
                                               # with CUTE_DSL_ARCH=sm_90a), print compile seconds
    python scripts/cutedsl_check.py --fp8      # the FP8-KV kernel instead: its shapes, then FP8 vs bf16
                                               # timings (--fp8 --quick, --fp8 --compile as above; --fp8
                                               # --bench-only [--narrow]: the timings alone, [those of the
                                               # keys-on-M kernel's shapes])
    python scripts/cutedsl_check.py --clusters # shapes of several 64-row tiles: time each cluster size
                                               # (CTAs sharing every page's load by TMA multicast)

Prints one PASS/FAIL line per shape with the max abs error against mlaserve.kernels.reference.mla_decode
(FlashMLA's tolerances: each element within 1e-3 abs or 2/128 rel, cosine distance <= 1e-5, lse within
2e-3; rows with no visible key exactly out 0, lse -inf). Unused cache slots hold NaN and block-table
entries past a request's pages an out-of-range page id, so a stray read shows up. Exit status 1 if any fails.
"""

import argparse
import importlib
import math
import random
import sys
import time

import torch

cd = importlib.import_module("mlaserve.kernels.cutedsl.mla_decode")
from mlaserve.bench.switches import set_module_value  # noqa: E402
from mlaserve.kernels import reference  # noqa: E402
from mlaserve.kernels.tolerance import attention_close  # noqa: E402

SCALE = 192 ** -0.5


def make_case(lens, s_q, h, dtype, seed):
    """-> q [b, s_q, h, 576], kv [pages, 64, 576] (NaN where no request owns a slot), block_table, seqlens."""
    gen = torch.Generator().manual_seed(seed)
    b, page = len(lens), cd.PAGE_SIZE
    need = [math.ceil(n / page) for n in lens]
    max_pages = max(need) + 1
    num_pages = sum(need) + 3
    kv = torch.randn(num_pages, page, 576, generator=gen).to(dtype)
    owned = torch.zeros(num_pages, page, dtype=torch.bool)
    table = torch.full((b, max_pages), num_pages + 1000, dtype=torch.int32)   # past the cache: never read
    order = torch.randperm(num_pages, generator=gen)
    at = 0
    for i, n in enumerate(lens):
        pages = order[at:at + need[i]]
        table[i, :need[i]] = pages.int()
        if n:
            owned[pages[:-1]] = True                          # whole pages
            owned[pages[-1], :n - (need[i] - 1) * page] = True  # the last one up to the request's end
        at += need[i]
    kv[~owned] = float("nan")
    q = torch.randn(b, s_q, h, 576, generator=gen).to(dtype)
    return q.cuda(), kv.cuda(), table.cuda(), torch.tensor(lens, dtype=torch.int32).cuda()


def compare(out, lse, ref_out, ref_lse) -> tuple[bool, float, str]:
    """(ok, max abs err, what failed): FlashMLA-like tolerances with bf16-P slack (mlaserve/kernels/tolerance.py)."""
    return attention_close(out, lse, ref_out, ref_lse)


def cases(quick: bool):
    rnd = random.Random(0)
    long = [1, 2, 63, 64, 65, 4096] + [rnd.randint(1, 4096) for _ in range(122)]
    lens_by_b = {1: [[1], [4096], [777]], 4: [[1, 63, 64, 4096], [2, 65, 1000, 129], [3, 3, 3, 4000]],
                 128: [long, long[::-1], long[3:] + long[:3]]}
    for bi, b in enumerate((1, 4, 128)):
        for si, s_q in enumerate((1, 2, 3)):
            for hi, h in enumerate((16, 64, 128)):
                if quick and (b == 128 or s_q == 3):
                    continue
                yield dict(lens=lens_by_b[b][(si + hi) % 3], s_q=s_q, h=h, dtype=torch.bfloat16, causal=True)
    yield dict(lens=[5, 300, 64, 1], s_q=2, h=64, dtype=torch.float16, causal=True)
    yield dict(lens=[5, 300, 64, 1], s_q=2, h=16, dtype=torch.bfloat16, causal=False)
    yield dict(lens=[4096, 1, 700, 2], s_q=1, h=128, dtype=torch.bfloat16, causal=True, num_splits=7)
    yield dict(lens=[3000, 17, 64, 2000], s_q=1, h=32, dtype=torch.bfloat16, causal=True, num_splits=4)
    yield dict(lens=[0, 1, 2], s_q=2, h=16, dtype=torch.bfloat16, causal=True, num_splits=3)
    # more work items than clusters fit the SMs: persistent launches (an empty request among them)
    yield dict(lens=[(389 * i) % 1500 for i in range(140)], s_q=1, h=16, dtype=torch.bfloat16, causal=True,
               num_splits=1)
    yield dict(lens=[1 + (389 * i) % 1500 for i in range(70)], s_q=1, h=128, dtype=torch.bfloat16, causal=True,
               num_splits=1)


def check(quick: bool) -> int:
    failed = 0
    for seed, c in enumerate(cases(quick)):
        lens = c["lens"]
        q, kv, table, seqlens = make_case(lens, c["s_q"], c["h"], c["dtype"], seed)
        name = (f"b{len(lens)} s_q{c['s_q']} h{c['h']} {str(c['dtype'])[6:]} causal={c['causal']} "
                f"s_k {min(lens)}..{max(lens)} splits={c.get('num_splits', 'auto')}")
        try:
            out, lse = cd.mla_decode(q, kv, table, seqlens, SCALE, causal=c["causal"],
                                     num_splits=c.get("num_splits"))
            torch.cuda.synchronize()
            ref_out, ref_lse = reference.mla_decode(q.double(), kv.double(), table, seqlens, SCALE,
                                                    causal=c["causal"])
            ok, max_err, why = compare(out, lse, ref_out, ref_lse)
        except Exception as e:      # a launch or compile error is this shape's FAIL line, then the next shape
            ok, max_err, why = False, float("nan"), f"{type(e).__name__}: {e}"
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {name}  max abs err {max_err:.2e}  {why}", flush=True)
    return failed


def bench() -> None:
    import triton.testing
    from mlaserve import ops
    for s_q, h in ((1, 64), (1, 128), (2, 128), (1, 16)):
        b, s_k = 128, 8192
        q, kv, table, seqlens = make_case([s_k] * b, s_q, h, torch.bfloat16, 0)
        flops = 2 * b * s_q * h * s_k * (576 + 512)
        plan = cd.plan_mla_decode(b, s_q, h, 512, table.shape[1], 64, False, q.device)
        line = f"b{b} s_q{s_q} h{h} s_k{s_k} splits={plan.num_splits}:"
        for backend in ("cutedsl", "triton"):
            fn = (lambda: cd.mla_decode(q, kv, table, seqlens, SCALE, plan=plan)) if backend == "cutedsl" else \
                (lambda: ops.mla_decode(q, kv, table, seqlens, SCALE, backend="triton"))
            ms = triton.testing.do_bench(fn, warmup=50, rep=300)
            line += f"  {backend} {ms * 1e3:7.1f} us {flops / ms / 1e9:6.1f} TFLOP/s"
        print(line, flush=True)


def sweep_clusters() -> None:
    """The multi-row-tile shapes with every cluster size that divides their row tiles (forced in place of
    mla_decode.cluster_size), each first checked against the reference, then timed by CUDA-graph replay."""
    import triton.testing
    chosen_size = cd.cluster_size
    try:
        for s_q, h, b, s_k in [(s_q, h, 128, s_k) for s_q, h in ((1, 128), (2, 128), (2, 64))
                               for s_k in (4096, 8192, 16384, 32768)] + [(1, 128, 4, 32768), (1, 128, 16, 32768)]:
            q, kv, table, seqlens = make_case([s_k] * b, s_q, h, torch.bfloat16, 0)
            tiles = math.ceil(s_q * h / 64)
            flops = 2 * b * s_q * h * s_k * (576 + 512)
            line = f"clusters b{b} s_q{s_q} h{h} s_k{s_k} (planner {chosen_size(s_q * h, False)}):"
            for c in (1, 2, 4):
                if tiles % c:
                    continue
                cd.cluster_size = lambda rows, kv_fp8, c=c: c
                plan = cd.plan_mla_decode(b, s_q, h, 512, table.shape[1], 64, False, q.device)
                ok = True
                if s_k == 4096 and b == 128:
                    out, lse = cd.mla_decode(q, kv, table, seqlens, SCALE, plan=plan)
                    ref = reference.mla_decode(q[:8].double(), kv.double(), table[:8], seqlens[:8], SCALE)
                    ok, _, _ = compare(out[:8], lse[:8], *ref)
                ms = triton.testing.do_bench_cudagraph(
                    lambda: cd.mla_decode(q, kv, table, seqlens, SCALE, plan=plan), rep=100)
                line += f"  c{c}{'' if ok else ' FAIL'} {ms * 1e3:7.1f} us {flops / ms / 1e9:5.0f} TF"
            print(line, flush=True)
    finally:
        cd.cluster_size = chosen_size


# (the small-batch split-count sweep is scripts/split_sweep.py, for this kernel and the Triton one)


# -- FP8 KV (uint8 [pages, 64, 656]): the mla_decode_fp8_*_kernel.py kernels --

def make_fp8_case(lens, s_q, h, seed):
    """make_case's inputs with the cache quantized (ops.quantize_kv_fp8) and every unused slot's 656 bytes
    0xFF (NaN scales, NaN k_pe). -> q bf16, kv uint8 [pages, 64, 656], block_table, seqlens."""
    from mlaserve import ops
    q, kv, table, seqlens = make_case(lens, s_q, h, torch.bfloat16, seed)
    unused = kv.isnan().any(-1)
    packed = ops.quantize_kv_fp8(kv.nan_to_num(0.0))
    packed[unused] = 0xFF
    return q, packed, table, seqlens


def fp8_reference(q, packed, table, seqlens, causal=True):
    """The reference on the cache's values (the bf16 nearest e4m3 * scale), in float64."""
    from mlaserve import ops
    return reference.mla_decode(q.double(), ops.dequantize_kv_fp8(packed).double(), table, seqlens, SCALE,
                                causal=causal)


def fp8_exact_reference(q, packed, table, seqlens, causal=True):
    """The reference on the cache's exact entries, e4m3 * scale (fp8_format's docstring), in float64."""
    from mlaserve.kernels import fp8_format
    return reference.mla_decode(q.double(), fp8_format.dequantize(packed, torch.float32, exact=True).double(), table,
                                seqlens, SCALE, causal=causal)


def fp8_f16_any_split(cd):
    """A stand-in for mla_decode.uses_fp8_f16 (cd: that module) without its bound on a split's pages: the
    f16-register kernel for every FP8 step of <= 32 rows, however short its splits, so that a test reaches it on
    small cases."""
    return lambda kv_fp8, rows, max_pages, num_splits: cd.FP8_F16 and kv_fp8 and cd.fp8_narrow_cols(rows) > 0


def fp8_f16_reference(q, packed, table, seqlens, causal=True):
    """The reference on the f16-register kernel's reading of the entries (mla_decode_fp8_f16_kernel.py): e4m3 *
    scale rounded once to f16 (the scale itself is exact in f16 from 2^-14 up), k_pe as stored, in float64. With
    logits 4x as wide as the check cases' the exact entries' reference misses it by an lse of ~3e-3
    (bench/NOTES.md 142)."""
    from mlaserve.kernels import fp8_format
    values = fp8_format.dequantize(packed, torch.float32, exact=True)
    values[..., :512] = values[..., :512].to(torch.float16).float()
    return reference.mla_decode(q.double(), values.double(), table, seqlens, SCALE, causal=causal)


def compare_fp8(out, lse, q, packed, table, seqlens, causal=True) -> tuple[bool, float, str]:
    """compare() against the reference on either reading of the FP8 entries: the dequantizing kernels round each
    to bf16 first, the FP8-MMA kernel (mla_decode.uses_fp8_mma) applies the scales in fp32 (fp8_format)."""
    ok, max_err, why = compare(out, lse, *fp8_reference(q, packed, table, seqlens, causal))
    if ok:
        return ok, max_err, why
    ok2, max_err2, why2 = compare(out, lse, *fp8_exact_reference(q, packed, table, seqlens, causal))
    return (ok2, max_err2, why2) if ok2 else (False, max_err, f"bf16-rounded entries: {why}; exact: {why2}")


def fp8_cases(quick: bool):
    """cases()'s bf16 shapes (b 1/4/128, s_q 1/2/3, h 16/64/128, split and empty rows), FP8 KV."""
    for c in cases(quick):
        if c["dtype"] == torch.bfloat16:
            yield c


def check_fp8(quick: bool) -> int:
    failed = 0
    for seed, c in enumerate(fp8_cases(quick)):
        lens = c["lens"]
        q, kv, table, seqlens = make_fp8_case(lens, c["s_q"], c["h"], seed)
        name = (f"fp8 b{len(lens)} s_q{c['s_q']} h{c['h']} causal={c['causal']} s_k {min(lens)}..{max(lens)} "
                f"splits={c.get('num_splits', 'auto')}")
        try:
            out, lse = cd.mla_decode(q, kv, table, seqlens, SCALE, causal=c["causal"],
                                     num_splits=c.get("num_splits"))
            torch.cuda.synchronize()
            ok, max_err, why = compare_fp8(out, lse, q, kv, table, seqlens, c["causal"])
        except Exception as e:      # a launch or compile error is this shape's FAIL line, then the next shape
            ok, max_err, why = False, float("nan"), f"{type(e).__name__}: {e}"
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {name}  max abs err {max_err:.2e}  {why}", flush=True)
    return failed


def bench_fp8(narrow: bool = False, shapes=None) -> None:
    """FP8 against bf16 KV, both through this kernel family, at b128 s_k 8192 (memory-bound h16 first);
    `narrow`: only shapes of <= 32 query rows (the keys-on-M FP8 kernel's); `shapes`: these (s_q, h) instead."""
    import triton.testing
    if shapes is None:
        shapes = ((1, 16), (2, 8), (1, 32), (2, 16)) if narrow else ((1, 16), (1, 32), (1, 64), (1, 128), (2, 128))
    for s_q, h in shapes:
        b, s_k = 128, 8192
        q, kv, table, seqlens = make_case([s_k] * b, s_q, h, torch.bfloat16, 0)
        _, kv8, _, _ = make_fp8_case([s_k] * b, s_q, h, 0)
        plan = cd.plan_mla_decode(b, s_q, h, 512, table.shape[1], 64, False, q.device)
        flops = 2 * b * s_q * h * s_k * (576 + 512)
        line = f"b{b} s_q{s_q} h{h} s_k{s_k} splits={plan.num_splits}:"
        times = {}
        for name, cache in (("bf16", kv), ("fp8", kv8)):
            ms = triton.testing.do_bench(lambda: cd.mla_decode(q, cache, table, seqlens, SCALE, plan=plan),
                                         warmup=50, rep=300)
            nbytes = q.numel() * 2 + b * s_k * cache.shape[-1] * cache.element_size() + q.numel() // 576 * 512 * 2
            times[name] = ms
            line += f"  {name} {ms * 1e3:7.1f} us {flops / ms / 1e9:6.1f} TFLOP/s {nbytes / ms / 1e9:5.2f} TB/s"
        print(f"{line}  fp8 speedup {times['bf16'] / times['fp8']:.2f}x", flush=True)


def compile_fp8() -> None:
    for causal in (True, False):
        for split in (False, True):
            for narrow in (0, 16, 32):
                cd._kernel(torch.bfloat16, causal, split, kv_fp8=True, narrow=narrow)
    print("compiled fp8", {f"{k[3]} causal={k[1]} split={k[2]}": f"{v:.1f}s"
                           for k, v in cd.compile_seconds.items() if k[3].startswith("fp8")})


def main_fp8(args) -> int:
    if args.compile:
        compile_fp8()
        return 0
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "(FP8 KV)", flush=True)
    if args.bench_only:
        shapes = None if args.shapes is None else [tuple(int(v) for v in x.split("x")) for x in args.shapes.split(",")]
        bench_fp8(args.narrow, shapes)
        return 0
    t0 = time.perf_counter()
    failed = check_fp8(args.quick)
    print(f"{failed} failed; compile seconds {cd.compile_seconds}; {time.perf_counter() - t0:.0f}s", flush=True)
    if not args.quick:
        bench_fp8()
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--clusters", action="store_true")
    ap.add_argument("--bench-only", action="store_true", help="with --fp8: the timings alone")
    ap.add_argument("--narrow", action="store_true", help="with --fp8 --bench-only: <= 32 query rows only")
    ap.add_argument("--shapes", default=None,
                    help="with --fp8 --bench-only: these s_q x h instead, e.g. 1x64,1x128,2x64")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a bool or int value of the CuTe DSL's mla_decode module, e.g. FP8_SEESAW_AHEAD=2; repeatable")
    args = ap.parse_args()
    for item in args.set:
        set_module_value(cd.__name__, item)
    if args.clusters:
        sweep_clusters()
        return 0
    if args.fp8:
        return main_fp8(args)
    if args.compile:
        for dtype in (torch.bfloat16, torch.float16):
            for causal in (True, False):
                for split in (False, True):
                    for cluster in (1, 2, 4):
                        cd._kernel(dtype, causal, split, cluster=cluster)
        print("compiled", {f"{str(k[0])[6:]} causal={k[1]} split={k[2]} cluster={k[4]}": f"{v:.1f}s"
                           for k, v in cd.compile_seconds.items()})
        return 0
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    t0 = time.perf_counter()
    failed = check(args.quick)
    print(f"{failed} failed; compile seconds {cd.compile_seconds}; {time.perf_counter() - t0:.0f}s", flush=True)
    if not args.quick:
        bench()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
