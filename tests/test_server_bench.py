"""bench/serve_latency.py against the real server: counts are exact, every field is there."""

import importlib.util
import json

from server_harness import API_KEY, REPO, shared_server


def _script():
    spec = importlib.util.spec_from_file_location("serve_latency", REPO / "bench" / "serve_latency.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_serve_latency_reports_both_levels(tmp_path, capsys):
    server = shared_server()
    out = tmp_path / "latency.jsonl"
    assert _script().main(["--base-url", server.url, "--api-key", API_KEY, "--num-requests", "6",
                           "--concurrency", "1,3", "--input-len", "30", "--output-len", "5",
                           "--output-file", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["concurrency"] for r in rows] == [1, 3]
    for r in rows:
        assert r["requests"] == 6 and r["output_tokens"] == 30
        assert r["output_throughput_tok_s"] > 0 and 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"]
        assert r["ttft_mean_ms"] > 0 and r["itl_mean_ms"] > 0
    table = capsys.readouterr().out
    assert "TTFT p99 ms" in table and "out tok/s" in table


def test_percentile():
    p = _script().percentile
    assert p([3.0, 1.0, 2.0], 50) == 2.0 and p([1.0, 2.0], 50) == 1.5 and p([5.0], 99) == 5.0
