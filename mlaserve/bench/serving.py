"""`mlaserve bench serving`: load-test an OpenAI-compatible server (mlaserve, SGLang, vLLM).

Flags and report follow SGLang's `python -m sglang.bench_serving`:

    mlaserve bench serving --backend mlaserve --port 30000 --dataset-name random \\
        --random-input-len 1024 --random-output-len 256 --num-prompts 200 --max-concurrency 32

Backends: `sglang`/`mlaserve` post to `/generate`, `vllm`/`openai`/`sglang-oai` to
`/v1/completions`, `openai-chat` to `/v1/chat/completions`. Random prompts go as token ids where
the API takes them (exact lengths, no special tokens added by the server); with --prompt-as-text,
and always for chat, as text checked to re-tokenize to exactly the asked length (the server may
still add a BOS token, and chat templates add their own tokens; the report counts the asked
length, as SGLang's does, and --output-file keeps the server's own counts too). Datasets:
`random-ids` draws prompts from the vocabulary's ordinary tokens; `random` draws windows of ShareGPT prompt
tokens when --dataset-path is given, else acts as random-ids (nothing is downloaded); `sharegpt` uses a local
ShareGPT JSON's first turns.
Lengths are uniform in [len * --random-range-ratio, len]. Outputs are forced to their length with
`ignore_eos`. Requests
arrive as a Poisson process of `--request-rate` per second (all at once when inf), at most
`--max-concurrency` in flight. `OPENAI_API_KEY` (or --api-key) is sent as a bearer token.

`--profile` posts `/start_profile` before the timed requests and `/stop_profile` after them
(empty JSON bodies); an mlaserve server writes torch profiler traces to
`MLASERVE_TORCH_PROFILER_DIR`. `--output-file` appends one JSON line per run: the arguments,
every metric and the per-request data. Exit status 1 when any request failed (the failures are
counted and their errors summarized after the report).
"""

import argparse
import asyncio
import json
import os
import random
import sys
import time
from datetime import datetime

import numpy as np
from tqdm import tqdm

from mlaserve.bench.serving_data import (
    DatasetRow,
    sample_random_requests,
    sample_sharegpt_requests,
    sharegpt_token_stream,
)
from mlaserve.bench.serving_metrics import calculate_metrics, error_summary, format_failures, format_report
from mlaserve.bench.serving_requests import BACKENDS, RequestInput, RequestResult, client_session, post_profile
from mlaserve.bench.server_info import auth_headers, base_url_of, load_tokenizer_for, served_model_id


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlaserve bench serving", description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=sorted(BACKENDS), default="mlaserve")
    p.add_argument("--base-url", default=None, help="server URL; else http://HOST:PORT")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="default: 30000 for sglang/mlaserve, 8000 for vllm/openai")
    p.add_argument("--api-key", default=None, help="bearer token; default $OPENAI_API_KEY")
    p.add_argument("--model", default=None, help="model name for the OpenAI routes; default: the server's first model")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer path; default: the served model's path as /get_model_info or /v1/models reports it")
    p.add_argument("--dataset-name", choices=("random", "random-ids", "sharegpt"), default="random")
    p.add_argument("--dataset-path", default=None,
                   help="local ShareGPT JSON (sharegpt; random draws its tokens from it)")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--sharegpt-output-len", type=int, default=None, help="fixed output length for sharegpt prompts")
    p.add_argument("--sharegpt-context-len", type=int, default=None, help="skip sharegpt pairs longer than this")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=1024)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len * ratio, len]; 1.0 = fixed lengths")
    p.add_argument("--prompt-as-text", action="store_true",
                   help="send random prompts as text even where the API takes token ids")
    p.add_argument("--tokenize-prompt", action="store_true",
                   help="accepted for SGLang compatibility: token ids are already sent where the API takes them")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s, Poisson arrivals; inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--warmup-requests", type=int, default=1, help="untimed requests first (output length <= 32)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--disable-stream", action="store_true")
    p.add_argument("--disable-ignore-eos", action="store_true")
    p.add_argument("--extra-request-body", default=None, help='JSON merged into every request, e.g. \'{"top_p": 0.9}\'')
    p.add_argument("--output-file", default=None, help="append one JSON line with every metric and per-request data")
    p.add_argument("--profile", action="store_true", help="POST /start_profile and /stop_profile around the run")
    return p


def validate(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf for all at once), got {args.request_rate}")
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path (a local ShareGPT JSON file)")
    if args.dataset_path and not os.path.isfile(args.dataset_path):
        raise ValueError(f"--dataset-path {args.dataset_path!r} is not a file")


def make_dataset(args, tokenizer, send_ids: bool) -> list[DatasetRow]:
    rng = random.Random(args.seed)
    if args.dataset_name == "sharegpt":
        return sample_sharegpt_requests(args.dataset_path, args.num_prompts, tokenizer, rng,
                                        args.sharegpt_output_len, args.sharegpt_context_len)
    source = None
    if args.dataset_name == "random" and args.dataset_path:
        source = sharegpt_token_stream(args.dataset_path, tokenizer, 4 * args.random_input_len * 16)
    return sample_random_requests(tokenizer, args.random_input_len, args.random_output_len, args.num_prompts,
                                  args.random_range_ratio, rng, as_ids=send_ids, source_ids=source)


async def arrivals(rows: list[DatasetRow], rate: float, rng: np.random.Generator):
    """Yield rows at Poisson arrival times (exponential gaps of mean 1/rate)."""
    for i, row in enumerate(rows):
        yield i, row
        if rate != float("inf") and i + 1 < len(rows):
            await asyncio.sleep(rng.exponential(1.0 / rate))


async def run_benchmark(args, rows: list[DatasetRow], api_url: str, base_url: str, model: str | None,
                        headers: dict, extra_body: dict) -> tuple[list[RequestResult], float]:
    backend = BACKENDS[args.backend]

    def request_input(row: DatasetRow, output_len: int) -> RequestInput:
        return RequestInput(api_url=api_url, prompt=row.prompt, prompt_len=row.prompt_len, output_len=output_len,
                            model=model, stream=not args.disable_stream, ignore_eos=not args.disable_ignore_eos,
                            headers=headers, extra_body=extra_body)

    async with client_session() as session:
        if args.warmup_requests > 0:
            warm = await asyncio.gather(*[backend.request(session, request_input(rows[0], min(rows[0].output_len, 32)))
                                          for _ in range(args.warmup_requests)])
            if not any(o.success for o in warm):
                raise RuntimeError(f"warmup failed, check the benchmark arguments: {warm[0].error.strip()}")
        if args.profile:
            print("Starting profiler:", await post_profile(session, base_url + "/start_profile", headers))

        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        pbar = tqdm(total=len(rows), disable=args.disable_tqdm)

        async def one(row: DatasetRow) -> RequestResult:
            if semaphore is None:
                out = await backend.request(session, request_input(row, row.output_len))
            else:
                async with semaphore:
                    out = await backend.request(session, request_input(row, row.output_len))
            pbar.update(1)
            return out

        start = time.perf_counter()
        tasks = []
        async for _, row in arrivals(rows, args.request_rate, np.random.default_rng(args.seed)):
            tasks.append(asyncio.create_task(one(row)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        pbar.close()
        if args.profile:
            print("Stopping profiler:", await post_profile(session, base_url + "/stop_profile", headers))
    return list(outputs), duration


def run_record(args, model, tokenizer_path, rows, outputs, duration, metrics, output_lens, retok_lens) -> dict:
    t0 = min(o.start_time for o in outputs)
    return {
        "date": datetime.now().isoformat(timespec="seconds"),
        "backend": args.backend, "model": model, "tokenizer": tokenizer_path, "dataset_name": args.dataset_name,
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "max_concurrency": args.max_concurrency, "num_prompts": args.num_prompts,
        "random_input_len": args.random_input_len, "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio, "seed": args.seed,
        "duration": duration, **metrics.as_dict(),
        "errors_summary": [{"count": n, "error": msg} for n, msg in error_summary(outputs)],
        "input_lens": [r.prompt_len for r in rows],
        "requested_output_lens": [r.output_len for r in rows],
        "output_lens": output_lens, "retokenized_output_lens": retok_lens,
        "server_prompt_tokens": [o.server_prompt_tokens for o in outputs],
        "success": [o.success for o in outputs],
        "start_times": [o.start_time - t0 for o in outputs],
        "ttfts": [o.ttft for o in outputs], "e2e_latencies": [o.latency for o in outputs],
        "itls": [o.itl for o in outputs], "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        validate(args)
        extra_body = json.loads(args.extra_request_body) if args.extra_request_body else {}
    except (ValueError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    backend = BACKENDS[args.backend]
    base_url = base_url_of(args.base_url, args.host, args.port or backend.default_port)
    headers = auth_headers(args.api_key)
    send_ids = backend.takes_token_ids and not args.prompt_as_text
    try:
        model = args.model or (None if backend.endpoint == "/generate" else served_model_id(base_url, headers))
        tokenizer, tokenizer_path = load_tokenizer_for(base_url, headers, args.tokenizer)
        rows = make_dataset(args, tokenizer, send_ids)
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"backend={args.backend} base_url={base_url} model={model} tokenizer={tokenizer_path} "
          f"dataset={args.dataset_name} num_prompts={args.num_prompts} prompts_as={'ids' if send_ids else 'text'}")
    print(f"#Input tokens: {sum(r.prompt_len for r in rows)}")
    print(f"#Output tokens: {sum(r.output_len for r in rows)}")
    print(f"Traffic request rate: {args.request_rate}, max concurrency: {args.max_concurrency}")

    try:
        outputs, duration = asyncio.run(run_benchmark(args, rows, base_url + backend.endpoint, base_url, model,
                                                      headers, extra_body))
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    metrics, output_lens, retok_lens = calculate_metrics(rows, outputs, duration, tokenizer)
    print()
    print(format_report(args.backend, args.request_rate, args.max_concurrency, duration, metrics))
    failures = format_failures(outputs)
    if failures:
        print(failures)
    if args.output_file:
        record = run_record(args, model, tokenizer_path, rows, outputs, duration, metrics, output_lens, retok_lens)
        with open(args.output_file, "a") as f:
            f.write(json.dumps(record) + "\n")
    return 1 if metrics.failed else 0


if __name__ == "__main__":
    sys.exit(main())
