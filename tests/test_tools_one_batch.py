"""`mlaserve bench one-batch` against the fake server: every case runs, the table and report print."""

import json
import subprocess
import sys

import pytest

from mlaserve.bench import one_batch
from tools_fake_server import FakeServer, make_tokenizer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = FakeServer(make_tokenizer(str(tmp_path_factory.mktemp("tok"))), token_delay_s=0.002).start()
    yield s
    s.stop()


def test_cases_table_and_report(capsys, server, tmp_path):
    results = tmp_path / "one.jsonl"
    before = len(server.prompt_tokens)
    rc = one_batch.main(["--base-url", server.url, "--batch-size", "1", "3", "--input-len", "16", "24",
                         "--output-len", "5", "--show-report", "--profile", "--result-filename", str(results)])
    out = capsys.readouterr().out
    assert rc == 0
    cases = [json.loads(line) for line in results.read_text().splitlines()]
    assert [(c["batch_size"], c["input_len"]) for c in cases] == [(1, 16), (1, 24), (3, 16), (3, 24)]
    # warmup (1 request) + 4 timed cases + 4 profiled cases; every prompt exactly its length
    lens = server.prompt_tokens[before:]
    assert lens == [16] + [16, 24, 16, 16, 16, 24, 24, 24] * 2
    for c in cases:
        assert c["tokens"] == c["batch_size"] * 5
        assert 0 < c["last_ttft"] < c["latency"]
        assert c["input_throughput"] == pytest.approx(c["batch_size"] * c["input_len"] / c["last_ttft"])
        assert c["output_throughput"] == pytest.approx(c["batch_size"] * 5 / (c["latency"] - c["last_ttft"]))
        assert c["speed"] == pytest.approx(c["tokens"] / c["latency"])
    assert out.count("batch size: ") == 4 and out.count("last_ttft: ") == 4
    assert out.count("| Latency (s) | Tokens | Acc Length | Speed (token/s) |") == 4
    assert "| batch size | input len | latency (s) | input throughput (tok/s) | output throughput (tok/s) | TTFT (s) |" in out
    rows = [line for line in out.splitlines() if line.startswith("| 3 | 24 |") or line.startswith("| 1 | 16 |")]
    assert len(rows) == 2
    assert server.profile_calls[-8:] == ["/start_profile", "/stop_profile"] * 4


def test_pretty_table_shape():
    t = one_batch.pretty_table(["A", "Long header"], [["1.000", "2"]])
    lines = t.splitlines()
    assert len({len(line) for line in lines}) == 1 and lines[0] == lines[2] == lines[-1]
    assert lines[1] == "|   A   | Long header |" and lines[3] == "| 1.000 |      2      |"


def test_errors_are_reported(capsys, server):
    assert one_batch.main(["--base-url", server.url, "--batch-size", "0"]) == 2
    assert "--batch-size 0" in capsys.readouterr().err
    bad = FakeServer(server.tokenizer_dir, fail_every=2).start()
    try:
        rc = one_batch.main(["--base-url", bad.url, "--batch-size", "4", "--input-len", "8", "--output-len", "2",
                             "--skip-warmup"])
    finally:
        bad.stop()
    err = capsys.readouterr().err
    assert rc == 1 and "2 of 4 requests failed" in err and "injected failure" in err


def test_module_shim():
    r = subprocess.run([sys.executable, "-m", "mlaserve.bench_one_batch_server", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--show-report" in r.stdout
