"""`mlaserve bench serving` against a fake server: exact counts, SGLang's report, failures shown."""

import json
import random
import subprocess
import sys

import numpy as np
import pytest

from mlaserve.bench import serving
from mlaserve.bench.serving_data import exact_length_text, ordinary_token_ids, sample_lengths, whole_character_token_ids
from mlaserve.bench.serving_metrics import calculate_metrics, per_second_peaks
from mlaserve.bench.serving_data import DatasetRow
from mlaserve.bench.serving_requests import RequestResult
from tools_fake_server import CORPUS, FakeServer, make_tokenizer

REPORT_LABELS = [
    "Backend:", "Traffic request rate:", "Max request concurrency:", "Successful requests:",
    "Benchmark duration (s):", "Total input tokens:", "Total generated tokens:",
    "Total generated tokens (retokenized):", "Request throughput (req/s):", "Input token throughput (tok/s):",
    "Output token throughput (tok/s):", "Peak output token throughput (tok/s):", "Peak concurrent requests:",
    "Total token throughput (tok/s):", "Concurrency:",
    "Mean E2E Latency (ms):", "Median E2E Latency (ms):", "P90 E2E Latency (ms):", "P99 E2E Latency (ms):",
    "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):",
    "Mean TPOT (ms):", "Median TPOT (ms):", "P99 TPOT (ms):",
    "Mean ITL (ms):", "Median ITL (ms):", "P95 ITL (ms):", "P99 ITL (ms):", "Max ITL (ms):",
]
SECTIONS = [" Serving Benchmark Result ", "End-to-End Latency", "Time to First Token",
            "Time per Output Token (excl. 1st token)", "Inter-Token Latency"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture()
def server(tokenizer_dir):
    s = FakeServer(tokenizer_dir).start()
    yield s
    s.stop()


def report_values(out: str) -> dict[str, str]:
    """label -> value of every report line, checking the order and the section rules."""
    lines = out[out.index("=" * 12 + " Serving Benchmark Result"):].splitlines()
    for title in SECTIONS:
        assert any(line == f"{title:{'=' if 'Result' in title else '-'}^50}" for line in lines), title
    values = {}
    for line in lines:
        label, _, value = line.partition(":")
        if f"{label}:" in REPORT_LABELS:
            assert line.startswith(f"{label + ':':<40} "), line
            values[label + ":"] = value.strip()
    assert list(values) == REPORT_LABELS
    return values


def run(capsys, server, *flags):
    rc = serving.main(["--base-url", server.url, "--disable-tqdm", "--warmup-requests", "0", *flags])
    return rc, capsys.readouterr()


@pytest.mark.parametrize("backend,as_text", [("mlaserve", False), ("sglang", True), ("vllm", False),
                                             ("openai", True), ("openai-chat", True)])
def test_counts_are_exact(capsys, server, tmp_path, backend, as_text):
    out_file = tmp_path / "runs.jsonl"
    n, in_len, out_len = 24, 40, 12
    text_flag = ["--prompt-as-text"] if as_text and backend != "openai-chat" else []
    rc, cap = run(capsys, server, "--backend", backend, *text_flag, "--num-prompts", str(n), "--random-input-len", str(in_len),
                  "--random-output-len", str(out_len), "--random-range-ratio", "0.5", "--max-concurrency", "5",
                  "--seed", "7", "--output-file", str(out_file))
    assert rc == 0, cap.err
    values = report_values(cap.out)
    record = json.loads(out_file.read_text().splitlines()[-1])
    asked_in, asked_out = record["input_lens"], record["requested_output_lens"]
    assert len(asked_in) == n and all(in_len // 2 <= x <= in_len for x in asked_in) and len(set(asked_in)) > 1
    assert all(out_len // 2 <= x <= out_len for x in asked_out)
    # The server's own token counts agree with what was asked, prompt by prompt.
    template = 3 if backend == "openai-chat" else 0
    assert server.prompt_tokens == asked_in
    assert record["server_prompt_tokens"] == [x + template for x in asked_in]
    assert values["Backend:"] == backend
    assert values["Successful requests:"] == str(n)
    assert values["Total input tokens:"] == str(sum(asked_in))
    assert values["Total generated tokens:"] == str(sum(asked_out))
    assert record["output_lens"] == asked_out and record["completed"] == n and record["failed"] == 0
    assert values["Max request concurrency:"] == "5" and values["Traffic request rate:"] == "inf"
    assert 1 <= server.peak_in_flight <= 5
    assert record["mean_ttft_ms"] > 0 and record["mean_itl_ms"] > 0 and record["p99_e2e_latency_ms"] >= record["mean_ttft_ms"]
    assert [len(itl) for itl in record["itls"]] == [x - 1 for x in asked_out]
    assert float(values["Request throughput (req/s):"]) == pytest.approx(n / record["duration"], rel=0.01)
    sent = [p.get("input_ids", p.get("text", p.get("prompt"))) if "messages" not in p else p["messages"][-1]["content"]
            for p in server.payloads]
    assert all(isinstance(x, str) if as_text else isinstance(x, list) for x in sent)
    assert all(p.get("ignore_eos", p.get("sampling_params", {}).get("ignore_eos")) is True for p in server.payloads)


def test_failures_are_counted_and_summarized(capsys, tokenizer_dir, tmp_path):
    server = FakeServer(tokenizer_dir, fail_every=4).start()
    try:
        rc, cap = run(capsys, server, "--backend", "openai", "--num-prompts", "12", "--random-input-len", "10",
                      "--random-output-len", "4", "--output-file", str(tmp_path / "r.jsonl"))
    finally:
        server.stop()
    assert rc == 1
    assert report_values(cap.out)["Successful requests:"] == "9"
    assert "Failed requests:                         3" in cap.out
    assert "3 x HTTP 500 Internal Server Error" in cap.out and "injected failure" in cap.out
    record = json.loads((tmp_path / "r.jsonl").read_text())
    assert record["failed"] == 3 and record["success"].count(False) == 3
    assert record["errors_summary"][0]["count"] == 3


def test_without_ignore_eos_outputs_stop_early(capsys, server):
    rc, cap = run(capsys, server, "--backend", "mlaserve", "--num-prompts", "5", "--random-input-len", "8",
                  "--random-output-len", "10", "--random-range-ratio", "1", "--disable-ignore-eos")
    assert rc == 0
    assert report_values(cap.out)["Total generated tokens:"] == "15"      # the fake server's EOS after 3


def test_poisson_arrivals_and_profile(capsys, server, tmp_path):
    rate, n, seed = 40.0, 8, 3
    rc, cap = run(capsys, server, "--backend", "mlaserve", "--num-prompts", str(n), "--random-input-len", "8",
                  "--random-output-len", "2", "--request-rate", str(rate), "--seed", str(seed), "--profile",
                  "--output-file", str(tmp_path / "r.jsonl"))
    assert rc == 0
    assert server.profile_calls == ["/start_profile", "/stop_profile"]
    assert report_values(cap.out)["Traffic request rate:"] == "40.0"
    starts = json.loads((tmp_path / "r.jsonl").read_text())["start_times"]
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n - 1)
    # Request k is sent no earlier than the sum of the first k gaps after request 0 (less the
    # event loop's lag in starting request 0, bounded loosely for a loaded CI machine).
    since_first = np.asarray(starts[1:]) - starts[0]
    assert np.all(since_first >= np.cumsum(gaps) - 0.05), (since_first, np.cumsum(gaps))
    assert np.cumsum(gaps)[-1] > 0.1


def test_sharegpt_dataset(capsys, server, tokenizer, tmp_path):
    convs = [{"id": str(i), "conversations": [{"from": "human", "value": CORPUS[i % 4][: 30 + i]},
                                              {"from": "gpt", "value": CORPUS[(i + 1) % 4][:20]}]} for i in range(6)]
    convs.append({"id": "short", "conversations": [{"from": "human", "value": "hi"}]})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    rc, cap = run(capsys, server, "--backend", "vllm", "--dataset-name", "sharegpt", "--dataset-path", str(path),
                  "--num-prompts", "6")
    assert rc == 0
    values = report_values(cap.out)
    prompts = [c["conversations"][0]["value"] for c in convs[:6]]
    replies = [c["conversations"][1]["value"] for c in convs[:6]]
    enc = lambda t: len(tokenizer.encode(t, add_special_tokens=False))
    assert values["Total input tokens:"] == str(sum(map(enc, prompts)))
    assert values["Total generated tokens:"] == str(sum(map(enc, replies)))


def test_api_key_and_clear_errors(capsys, tokenizer_dir):
    server = FakeServer(tokenizer_dir, api_key="sekrit").start()
    try:
        flags = ["--backend", "mlaserve", "--tokenizer", tokenizer_dir, "--num-prompts", "2",
                 "--random-input-len", "4", "--random-output-len", "2"]
        rc, cap = run(capsys, server, *flags, "--api-key", "sekrit")
        assert rc == 0 and report_values(cap.out)["Successful requests:"] == "2"
        rc = serving.main(["--base-url", server.url, "--disable-tqdm", *flags])     # warmup on: fails loudly
        cap = capsys.readouterr()
        assert rc == 1 and "warmup failed" in cap.err and "HTTP 401" in cap.err
    finally:
        server.stop()
    assert serving.main(["--num-prompts", "0"]) == 2
    assert "--num-prompts must be >= 1, got 0" in capsys.readouterr().err
    assert serving.main(["--base-url", "http://127.0.0.1:9", "--backend", "openai"]) == 2
    assert "is the server running?" in capsys.readouterr().err


def test_exact_length_text(tokenizer):
    rng = random.Random(0)
    pool = whole_character_token_ids(tokenizer, ordinary_token_ids(tokenizer))
    assert set(pool) <= set(ordinary_token_ids(tokenizer)) and tokenizer.bos_token_id not in pool
    for target in [1, 2, 5, 17, 64, 200]:
        for _ in range(5):
            start = [rng.randrange(len(tokenizer)) for _ in range(target)]
            text, ids = exact_length_text(tokenizer, start, target, pool, rng)
            assert len(tokenizer.encode(text, add_special_tokens=False)) == target == len(ids)


def test_sample_lengths():
    rng = random.Random(1)
    xs = sample_lengths(100, 0.25, 2000, rng)
    assert min(xs) == 25 and max(xs) == 100
    assert sample_lengths(7, 1.0, 10, rng) == [7] * 10
    with pytest.raises(ValueError, match="range-ratio must be in \\[0, 1\\], got 1.5"):
        sample_lengths(8, 1.5, 1, rng)


def test_metrics_on_known_timings(tokenizer):
    rows = [DatasetRow("a", 10, 3), DatasetRow("b", 20, 2), DatasetRow("c", 5, 4)]
    outs = [
        RequestResult(success=True, generated_text="abc", output_len=3, start_time=100.0, ttft=0.5, latency=1.5, itl=[0.4, 0.6]),
        RequestResult(success=True, generated_text="de", output_len=2, start_time=100.2, ttft=0.3, latency=2.3, itl=[2.0]),
        RequestResult(success=False, error="Traceback...\nValueError: boom", start_time=100.1),
    ]
    m, out_lens, retok = calculate_metrics(rows, outs, duration_s=4.0, tokenizer=tokenizer)
    assert (m.completed, m.failed, m.total_input, m.total_output) == (2, 1, 30, 5)
    assert out_lens == [3, 2, 0] and retok[2] == 0
    assert m.request_throughput == 0.5 and m.input_throughput == 7.5 and m.total_throughput == 35 / 4
    assert m.mean_ttft_ms == pytest.approx(400.0) and m.median_e2e_latency_ms == pytest.approx(1900.0)
    assert m.mean_tpot_ms == pytest.approx(1000 * (0.5 + 2.0) / 2)        # (1.5-0.5)/2 and (2.3-0.3)/1
    assert m.max_itl_ms == pytest.approx(2000.0) and m.mean_itl_ms == pytest.approx(1000.0)
    assert m.concurrency == pytest.approx(3.8 / 4)
    # Token times 100.5, 100.9, 101.5 and 100.5, 102.5 -> one-second buckets from t0 = 100.0: [3, 1, 1];
    # in flight: [100.0, 101.5] and [100.2, 102.5] -> [2, 2, 1]
    assert per_second_peaks(outs) == (3.0, 2)


def test_module_shim_and_cli_dispatch():
    r = subprocess.run([sys.executable, "-m", "mlaserve.bench_serving", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--random-range-ratio" in r.stdout
    r = subprocess.run([sys.executable, "-m", "mlaserve.cli", "bench", "serving", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--max-concurrency" in r.stdout
