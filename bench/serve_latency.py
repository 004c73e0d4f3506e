"""Throughput and time-to-first-token of a running server at concurrency 1 and 16.

    python bench/serve_latency.py                                   # starts `mlaserve serve` (built-in model)
    python bench/serve_latency.py --server-args "--model-path /models/X --attention-backend triton"
    python bench/serve_latency.py --base-url http://127.0.0.1:30000 --api-key KEY   # an existing server

Each request streams /v1/completions (greedy, `ignore_eos`, exactly --output-len tokens) with
`stream_options.include_usage`, so token counts are the server's own. Per concurrency level it
prints output throughput (generated tokens / wall time), request throughput, and TTFT (mean,
p50, p99: request sent to first text received) and the mean inter-token latency.
(`mlaserve bench serving` is the full SGLang-style benchmark; this is the quick check.)
"""

import argparse
import asyncio
import json
import os
import random
import shlex
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

WORDS = ("the of and to in is was for on with as by at from his her that which this be are were it an or "
         "model cache page token batch kernel latent sparse dense attention decode prefill").split()


@dataclass
class Result:
    ttft: float
    latency: float
    output_tokens: int
    itl: list[float] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def make_prompts(n: int, input_len: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        words = [str(i)]
        while sum(len(w) + 1 for w in words) < input_len:
            words.append(rng.choice(WORDS))
        prompts.append(" ".join(words)[:input_len])
    return prompts


async def one_request(client: httpx.AsyncClient, url: str, headers: dict, model: str | None, prompt: str,
                      output_len: int) -> Result:
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    start = time.perf_counter()
    ttft, last, itl, tokens = None, start, [], 0
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RuntimeError(f"server error mid-stream: {event['error']}")
            now = time.perf_counter()
            if event.get("choices") and event["choices"][0].get("text"):
                if ttft is None:
                    ttft = now - start
                else:
                    itl.append(now - last)
                last = now
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return Result(ttft=ttft if ttft is not None else float("nan"), latency=time.perf_counter() - start,
                  output_tokens=tokens, itl=itl)


async def run_level(url: str, headers: dict, model: str | None, prompts: list[str], output_len: int,
                    concurrency: int) -> tuple[list[Result], float]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        async def limited(p: str) -> Result:
            async with sem:
                return await one_request(client, url, headers, model, p, output_len)
        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        return results, time.perf_counter() - start


def report(concurrency: int, results: list[Result], wall: float) -> dict:
    ttft_ms = [r.ttft * 1000 for r in results]
    itl_ms = [x * 1000 for r in results for x in r.itl]
    tokens = sum(r.output_tokens for r in results)
    return {"concurrency": concurrency, "requests": len(results), "duration_s": wall, "output_tokens": tokens,
            "output_throughput_tok_s": tokens / wall, "request_throughput_req_s": len(results) / wall,
            "ttft_mean_ms": statistics.fmean(ttft_ms), "ttft_p50_ms": percentile(ttft_ms, 50),
            "ttft_p99_ms": percentile(ttft_ms, 99),
            "itl_mean_ms": statistics.fmean(itl_ms) if itl_ms else float("nan")}


def print_table(rows: list[dict]) -> None:
    cols = [("concurrency", "conc", "{:>4d}"), ("requests", "reqs", "{:>5d}"), ("duration_s", "time s", "{:>7.2f}"),
            ("output_throughput_tok_s", "out tok/s", "{:>9.1f}"), ("request_throughput_req_s", "req/s", "{:>6.2f}"),
            ("ttft_mean_ms", "TTFT mean ms", "{:>12.1f}"), ("ttft_p50_ms", "TTFT p50 ms", "{:>11.1f}"),
            ("ttft_p99_ms", "TTFT p99 ms", "{:>11.1f}"), ("itl_mean_ms", "ITL mean ms", "{:>11.1f}")]
    print("  ".join(f"{title:>{len(fmt.format(0 if 'd' in fmt else 0.0))}}" for _, title, fmt in cols))
    for row in rows:
        print("  ".join(fmt.format(row[key]) for key, _, fmt in cols))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(server_args: str, api_key: str | None, timeout: float = 600) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "mlaserve.server.launch", *shlex.split(server_args), "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning"]
    if api_key:
        cmd += ["--api-key", api_key]
    print(f"starting: {shlex.join(cmd)}", file=sys.stderr)
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.perf_counter() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.perf_counter() > deadline:
            proc.terminate()
            raise RuntimeError(f"the server did not become healthy within {timeout} s")
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", help="an existing server; default: start `mlaserve serve` with --server-args")
    p.add_argument("--server-args", default="", help="flags for the server this script starts")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--model", default=None, help="`model` sent with each request (default: none)")
    p.add_argument("--num-requests", type=int, default=32, help="requests per concurrency level")
    p.add_argument("--concurrency", default="1,16", help="comma-separated concurrency levels")
    p.add_argument("--input-len", type=int, default=128, help="prompt length in characters")
    p.add_argument("--output-len", type=int, default=32, help="tokens generated per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-file", help="append one JSON line per concurrency level")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    proc = None
    url = args.base_url
    if url is None:
        proc, url = start_server(args.server_args, args.api_key)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        prompts = make_prompts(args.num_requests, args.input_len, args.seed)
        asyncio.run(run_level(url, headers, args.model, prompts[:2], 2, 1))      # warm-up
        rows = []
        for level in levels:
            results, wall = asyncio.run(run_level(url, headers, args.model, prompts, args.output_len, level))
            rows.append(report(level, results, wall))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    print_table(rows)
    if args.output_file:
        with open(args.output_file, "a") as f:
            for row in rows:
                f.write(json.dumps({"url": url, "input_len": args.input_len, "output_len": args.output_len, **row})
                        + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
