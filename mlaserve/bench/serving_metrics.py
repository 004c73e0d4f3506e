"""Metrics and the report of `mlaserve bench serving`, laid out field for field as SGLang's
`sglang.bench_serving` prints its "Serving Benchmark Result" block, so that results read the same
and parse with the same scripts."""

from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np

from mlaserve.bench.serving_data import DatasetRow
from mlaserve.bench.serving_requests import RequestResult


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    total_output_retokenized: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    output_throughput_retokenized: float
    total_throughput: float
    total_throughput_retokenized: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    concurrency: float
    mean_e2e_latency_ms: float
    median_e2e_latency_ms: float
    std_e2e_latency_ms: float
    p90_e2e_latency_ms: float
    p99_e2e_latency_ms: float
    mean_ttft_ms: float
    median_ttft_ms: float
    std_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    std_tpot_ms: float
    p99_tpot_ms: float
    mean_itl_ms: float
    median_itl_ms: float
    std_itl_ms: float
    p95_itl_ms: float
    p99_itl_ms: float
    max_itl_ms: float

    def as_dict(self) -> dict:
        return {k: (float(v) if isinstance(v, np.floating) else v) for k, v in asdict(self).items()}


def _ms(values: list[float], stat: str, q: float | None = None) -> float:
    """A statistic of seconds, in ms; 0 when there are no values (e.g. one-token outputs have no ITL)."""
    if not values:
        return 0.0
    arr = np.asarray(values, dtype=np.float64)
    if stat == "percentile":
        return float(np.percentile(arr, q)) * 1000
    return float(getattr(np, stat)(arr)) * 1000


def per_second_peaks(outputs: list[RequestResult]) -> tuple[float, int]:
    """Peak output tokens in any one-second bucket and peak requests in flight in any second,
    bucketed from the first request's start as SGLang does."""
    ok = [o for o in outputs if o.success]
    if not ok:
        return 0.0, 0
    t0 = min(o.start_time for o in ok)
    t_end = max(o.start_time + o.latency for o in ok)
    n_buckets = int(np.ceil(t_end - t0)) + 1
    tokens = np.zeros(n_buckets)
    in_flight = np.zeros(n_buckets)
    for o in ok:
        t = o.start_time + o.ttft
        times = [t]
        for gap in o.itl:
            t += gap
            times.append(t)
        for t in times:
            b = int(t - t0)
            if 0 <= b < n_buckets:
                tokens[b] += 1
        first, last = int(o.start_time - t0), int(o.start_time + o.latency - t0)
        in_flight[first:min(last + 1, n_buckets)] += 1
    return float(tokens.max()), int(in_flight.max())


def calculate_metrics(rows: list[DatasetRow], outputs: list[RequestResult], duration_s: float,
                      tokenizer) -> tuple[BenchmarkMetrics, list[int], list[int]]:
    """Metrics over successful requests; returns them with per-request output and retokenized lengths
    (0 for failed requests)."""
    output_lens, retok_lens = [], []
    total_input = completed = 0
    ttfts, tpots, itls, e2e = [], [], [], []
    for row, o in zip(rows, outputs):
        if not o.success:
            output_lens.append(0)
            retok_lens.append(0)
            continue
        completed += 1
        total_input += row.prompt_len
        output_lens.append(o.output_len)
        retok_lens.append(len(tokenizer.encode(o.generated_text, add_special_tokens=False)))
        if o.output_len > 1:
            tpots.append((o.latency - o.ttft) / (o.output_len - 1))
        itls += o.itl
        ttfts.append(o.ttft)
        e2e.append(o.latency)
    total_output, total_retok = sum(output_lens), sum(retok_lens)
    peak_tokens, peak_in_flight = per_second_peaks(outputs)
    d = duration_s
    metrics = BenchmarkMetrics(
        completed=completed, failed=len(outputs) - completed,
        total_input=total_input, total_output=total_output, total_output_retokenized=total_retok,
        request_throughput=completed / d, input_throughput=total_input / d,
        output_throughput=total_output / d, output_throughput_retokenized=total_retok / d,
        total_throughput=(total_input + total_output) / d,
        total_throughput_retokenized=(total_input + total_retok) / d,
        max_output_tokens_per_s=peak_tokens, max_concurrent_requests=peak_in_flight,
        concurrency=sum(e2e) / d,
        mean_e2e_latency_ms=_ms(e2e, "mean"), median_e2e_latency_ms=_ms(e2e, "median"),
        std_e2e_latency_ms=_ms(e2e, "std"), p90_e2e_latency_ms=_ms(e2e, "percentile", 90),
        p99_e2e_latency_ms=_ms(e2e, "percentile", 99),
        mean_ttft_ms=_ms(ttfts, "mean"), median_ttft_ms=_ms(ttfts, "median"),
        std_ttft_ms=_ms(ttfts, "std"), p99_ttft_ms=_ms(ttfts, "percentile", 99),
        mean_tpot_ms=_ms(tpots, "mean"), median_tpot_ms=_ms(tpots, "median"),
        std_tpot_ms=_ms(tpots, "std"), p99_tpot_ms=_ms(tpots, "percentile", 99),
        mean_itl_ms=_ms(itls, "mean"), median_itl_ms=_ms(itls, "median"), std_itl_ms=_ms(itls, "std"),
        p95_itl_ms=_ms(itls, "percentile", 95), p99_itl_ms=_ms(itls, "percentile", 99),
        max_itl_ms=_ms(itls, "max"),
    )
    return metrics, output_lens, retok_lens


def _line(label: str, value, fmt: str = "") -> str:
    return f"{label:<40} {format(value, fmt):<10}"


def _title(text: str, fill: str) -> str:
    return f"{text:{fill}^50}"


def format_report(backend: str, request_rate: float, max_concurrency: int | None, duration_s: float,
                  m: BenchmarkMetrics) -> str:
    """SGLang's "Serving Benchmark Result" block."""
    lines = [
        _title(" Serving Benchmark Result ", "="),
        _line("Backend:", backend),
        _line("Traffic request rate:", request_rate),
        _line("Max request concurrency:", max_concurrency if max_concurrency else "not set"),
        _line("Successful requests:", m.completed),
        _line("Benchmark duration (s):", duration_s, ".2f"),
        _line("Total input tokens:", m.total_input),
        _line("Total generated tokens:", m.total_output),
        _line("Total generated tokens (retokenized):", m.total_output_retokenized),
        _line("Request throughput (req/s):", m.request_throughput, ".2f"),
        _line("Input token throughput (tok/s):", m.input_throughput, ".2f"),
        _line("Output token throughput (tok/s):", m.output_throughput, ".2f"),
        _line("Peak output token throughput (tok/s):", m.max_output_tokens_per_s, ".2f"),
        _line("Peak concurrent requests:", m.max_concurrent_requests),
        _line("Total token throughput (tok/s):", m.total_throughput, ".2f"),
        _line("Concurrency:", m.concurrency, ".2f"),
        _title("End-to-End Latency", "-"),
        _line("Mean E2E Latency (ms):", m.mean_e2e_latency_ms, ".2f"),
        _line("Median E2E Latency (ms):", m.median_e2e_latency_ms, ".2f"),
        _line("P90 E2E Latency (ms):", m.p90_e2e_latency_ms, ".2f"),
        _line("P99 E2E Latency (ms):", m.p99_e2e_latency_ms, ".2f"),
        _title("Time to First Token", "-"),
        _line("Mean TTFT (ms):", m.mean_ttft_ms, ".2f"),
        _line("Median TTFT (ms):", m.median_ttft_ms, ".2f"),
        _line("P99 TTFT (ms):", m.p99_ttft_ms, ".2f"),
        _title("Time per Output Token (excl. 1st token)", "-"),
        _line("Mean TPOT (ms):", m.mean_tpot_ms, ".2f"),
        _line("Median TPOT (ms):", m.median_tpot_ms, ".2f"),
        _line("P99 TPOT (ms):", m.p99_tpot_ms, ".2f"),
        _title("Inter-Token Latency", "-"),
        _line("Mean ITL (ms):", m.mean_itl_ms, ".2f"),
        _line("Median ITL (ms):", m.median_itl_ms, ".2f"),
        _line("P95 ITL (ms):", m.p95_itl_ms, ".2f"),
        _line("P99 ITL (ms):", m.p99_itl_ms, ".2f"),
        _line("Max ITL (ms):", m.max_itl_ms, ".2f"),
        "=" * 50,
    ]
    return "\n".join(lines)


def error_summary(outputs: list[RequestResult], max_kinds: int = 5) -> list[tuple[int, str]]:
    """Failed requests grouped by the last line of their error (the message, not the traceback)."""
    kinds = Counter((o.error.strip().splitlines() or ["(no error text)"])[-1][:300] for o in outputs if not o.success)
    return [(n, msg) for msg, n in kinds.most_common(max_kinds)]


def format_failures(outputs: list[RequestResult]) -> str:
    failed = sum(not o.success for o in outputs)
    if not failed:
        return ""
    lines = [_title(" Failed Requests ", "!"), _line("Failed requests:", failed)]
    lines += [f"  {n} x {msg}" for n, msg in error_summary(outputs)]
    lines.append("!" * 50)
    return "\n".join(lines)
