"""`mlaserve bench one-batch`: the latency of one batch through a server's `/generate`.

Like SGLang's `python -m sglang.bench_one_batch_server --base-url ...`: for every combination of
--batch-size x --input-len x --output-len, `batch_size` random token-id prompts of exactly
`input_len` tokens are sent at once (one streaming request each, so any SGLang-compatible
`/generate` works) with `ignore_eos` and `max_new_tokens = output_len`. Measured:

    latency            first byte sent -> last request done (s)
    last TTFT          first byte sent -> the batch's last first token (s): the prefill of the batch
    input throughput   batch_size * input_len / last TTFT
    output throughput  batch_size * output_len / (latency - last TTFT): the decode phase
    Tokens, Speed      generated tokens as the server counted them, and Tokens / latency

Each case prints SGLang's lines and its `Latency (s) | Tokens | Acc Length | Speed (token/s)`
table; `--show-report` ends with SGLang's markdown summary. Acc Length is 1.00 (no speculative
decoding) unless the server reports `spec_verify_ct`. `--profile` runs every case once more
between POST `/start_profile` and `/stop_profile`, so the timed pass is not slowed by the
profiler. `--result-filename` appends one JSON line per case.
"""

import argparse
import asyncio
import itertools
import json
import random
import sys
import time
from dataclasses import asdict, dataclass

from mlaserve.bench.server_info import auth_headers, base_url_of, load_tokenizer_for
from mlaserve.bench.serving_data import ordinary_token_ids
from mlaserve.bench.serving_requests import RequestInput, client_session, post_profile, request_generate


@dataclass
class CaseResult:
    run_name: str
    batch_size: int
    input_len: int
    output_len: int
    latency: float              # s
    last_ttft: float            # s
    input_throughput: float     # tok/s
    output_throughput: float    # tok/s (0 when output_len == 1: no decode phase)
    overall_throughput: float   # tok/s
    tokens: int                 # generated, as the server counted them
    speed: float                # tokens / latency
    acc_length: float
    itl_ms: float               # decode time per token per request


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlaserve bench one-batch", description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None, help="bearer token; default $OPENAI_API_KEY")
    p.add_argument("--tokenizer", default=None, help="default: the served model's tokenizer")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1])
    p.add_argument("--input-len", type=int, nargs="+", default=[1024])
    p.add_argument("--output-len", type=int, nargs="+", default=[16])
    p.add_argument("--run-name", default="default")
    p.add_argument("--result-filename", default=None, help="append one JSON line per case")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--skip-warmup", action="store_true")
    p.add_argument("--profile", action="store_true", help="profile each case in an extra pass")
    p.add_argument("--show-report", action="store_true", help="print SGLang's markdown summary at the end")
    return p


def pretty_table(headers: list[str], rows: list[list[str]]) -> str:
    """A centred ASCII table like tabulate's "pretty" format (which SGLang prints)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    fmt = lambda cells: "|" + "|".join(f" {c:^{w}} " for c, w in zip(cells, widths)) + "|"
    return "\n".join([rule, fmt(headers), rule, *(fmt(r) for r in rows), rule])


def markdown_summary(results: list[CaseResult], input_lens: list[int], output_lens: list[int]) -> str:
    lines = [f"Input lens: {input_lens}. Output lens: {output_lens}.",
             "| batch size | input len | latency (s) | input throughput (tok/s) | output throughput (tok/s) "
             "| TTFT (s) | acc length | ITL (ms) |",
             "| ---------- | --------- | ----------- | ------------------------ | ------------------------- "
             "| -------- | ---------- | -------- |"]
    for r in sorted(results, key=lambda r: (r.input_len, r.batch_size)):
        lines.append(f"| {r.batch_size} | {r.input_len} | {r.latency:.2f} | {r.input_throughput:.2f} | "
                     f"{r.output_throughput:.2f} | {r.last_ttft:.2f} | {r.acc_length:.2f} | {r.itl_ms:.2f} |")
    return "\n".join(lines)


async def run_case(session, url: str, headers: dict, pool: list[int], rng: random.Random,
                   batch_size: int, input_len: int, output_len: int, run_name: str) -> CaseResult:
    prompts = [[rng.choice(pool) for _ in range(input_len)] for _ in range(batch_size)]
    inputs = [RequestInput(api_url=url + "/generate", prompt=p, prompt_len=input_len, output_len=output_len,
                           headers=headers) for p in prompts]
    tic = time.perf_counter()
    outs = await asyncio.gather(*[request_generate(session, inp) for inp in inputs])
    failed = [o for o in outs if not o.success]
    if failed:
        raise RuntimeError(f"{len(failed)} of {batch_size} requests failed: {failed[0].error.strip()[-500:]}")
    short = [o.output_len for o in outs if o.output_len != output_len]
    if short:
        raise RuntimeError(f"asked for {output_len} tokens with ignore_eos, the server generated {short}")
    latency = max(o.start_time + o.latency for o in outs) - tic
    last_ttft = max(o.start_time + o.ttft for o in outs) - tic
    tokens = sum(o.output_len for o in outs)
    decode_s = latency - last_ttft
    output_throughput = batch_size * output_len / decode_s if output_len > 1 and decode_s > 0 else 0.0
    return CaseResult(
        run_name=run_name, batch_size=batch_size, input_len=input_len, output_len=output_len,
        latency=latency, last_ttft=last_ttft, input_throughput=batch_size * input_len / last_ttft,
        output_throughput=output_throughput, overall_throughput=batch_size * (input_len + output_len) / latency,
        tokens=tokens, speed=tokens / latency, acc_length=1.0,
        itl_ms=1000 * batch_size / output_throughput if output_throughput else 0.0)


def print_case(r: CaseResult) -> None:
    print(f"batch size: {r.batch_size}")
    print(f"input_len: {r.input_len}")
    print(f"output_len: {r.output_len}")
    print(f"latency: {r.latency:.2f} s")
    print(f"input throughput: {r.input_throughput:.2f} tok/s")
    if r.output_len != 1:
        print(f"output throughput: {r.output_throughput:.2f} tok/s")
    print(f"last_ttft: {r.last_ttft:.2f} s")
    print(pretty_table(["Latency (s)", "Tokens", "Acc Length", "Speed (token/s)"],
                       [[f"{r.latency:.3f}", str(r.tokens), f"{r.acc_length:.3f}", f"{r.speed:.2f}"]]))
    print()


async def run_all(args, base_url: str, headers: dict, pool: list[int]) -> list[CaseResult]:
    rng = random.Random(args.seed)
    cases = list(itertools.product(args.batch_size, args.input_len, args.output_len))
    results = []
    async with client_session() as session:
        if not args.skip_warmup:
            bs, il, _ = cases[0]
            await run_case(session, base_url, headers, pool, rng, bs, min(il, 64), 4, "warmup")
        for bs, il, ol in cases:
            r = await run_case(session, base_url, headers, pool, rng, bs, il, ol, args.run_name)
            print_case(r)
            results.append(r)
            if args.result_filename:
                with open(args.result_filename, "a") as f:
                    f.write(json.dumps(asdict(r)) + "\n")
        if args.profile:
            for bs, il, ol in cases:
                print(f"profiling bs={bs} input_len={il} output_len={ol}:",
                      await post_profile(session, base_url + "/start_profile", headers))
                await run_case(session, base_url, headers, pool, rng, bs, il, ol, args.run_name)
                print("  ", await post_profile(session, base_url + "/stop_profile", headers))
    return results


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    bad = [f"--{name} {v}" for name in ("batch_size", "input_len", "output_len") for v in getattr(args, name) if v < 1]
    if bad:
        print(f"error: sizes must be >= 1, got {', '.join(bad).replace('_', '-')}", file=sys.stderr)
        return 2
    base_url = base_url_of(args.base_url, args.host, args.port)
    headers = auth_headers(args.api_key)
    try:
        tokenizer, _ = load_tokenizer_for(base_url, headers, args.tokenizer)
        results = asyncio.run(run_all(args, base_url, headers, ordinary_token_ids(tokenizer)))
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.show_report:
        print(markdown_summary(results, args.input_len, args.output_len))
    return 0


if __name__ == "__main__":
    sys.exit(main())
