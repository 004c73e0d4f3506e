"""The client tools against the real server serving the built-in model (tests/server_harness.py),
and the chat route's reasoning / tool-call parsing wired through `--reasoning-parser` /
`--tool-call-parser`."""

import json
from pathlib import Path

import httpx
import pytest

from mlaserve.bench import gsm8k, one_batch, serving
from tests.server_harness import API_KEY, shared_server
from tests.test_tools_serving import report_values

MINI = str(Path(__file__).parent / "data" / "gsm8k_mini.jsonl")


@pytest.fixture(scope="module")
def server():
    return shared_server()


@pytest.fixture(scope="module")
def tokenizer(server):
    from transformers import AutoTokenizer
    root = httpx.get(f"{server.url}/v1/models", headers=server.headers).json()["data"][0]["root"]
    return AutoTokenizer.from_pretrained(root)


@pytest.mark.parametrize("backend,flags", [("mlaserve", []), ("openai", []), ("openai", ["--prompt-as-text"]),
                                           ("openai-chat", [])])
def test_bench_serving_counts_are_exact(capsys, server, tokenizer, tmp_path, backend, flags):
    out_file = tmp_path / "runs.jsonl"
    n = 6
    rc = serving.main(["--backend", backend, *flags, "--base-url", server.url, "--api-key", API_KEY, "--num-prompts", str(n),
                       "--random-input-len", "40", "--random-output-len", "6", "--random-range-ratio", "0.5",
                       "--max-concurrency", "3", "--disable-tqdm", "--output-file", str(out_file)])
    cap = capsys.readouterr()
    assert rc == 0, cap.out + cap.err
    values = report_values(cap.out)
    r = json.loads(out_file.read_text())
    assert values["Successful requests:"] == str(n) and r["failed"] == 0
    assert values["Total input tokens:"] == str(sum(r["input_lens"]))
    assert values["Total generated tokens:"] == str(sum(r["requested_output_lens"]))
    assert r["output_lens"] == r["requested_output_lens"]          # ignore_eos reached the engine
    if not flags and backend != "openai-chat":
        assert r["server_prompt_tokens"] == r["input_lens"]        # token ids: exactly what was asked
    elif backend == "openai":
        # text prompts: the server adds the tokenizer's special tokens (BOS) to the exact text
        extra = len(tokenizer("x")["input_ids"]) - len(tokenizer.encode("x", add_special_tokens=False))
        assert r["server_prompt_tokens"] == [x + extra for x in r["input_lens"]]
    else:
        assert all(s > x for s, x in zip(r["server_prompt_tokens"], r["input_lens"]))   # + chat template
    assert r["mean_ttft_ms"] > 0 and r["mean_e2e_latency_ms"] >= r["mean_ttft_ms"]


def test_bench_one_batch(capsys, server):
    rc = one_batch.main(["--base-url", server.url, "--api-key", API_KEY, "--batch-size", "1", "3",
                         "--input-len", "24", "--output-len", "4", "--show-report"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.count("| Latency (s) | Tokens | Acc Length | Speed (token/s) |") == 2
    assert "| 3 | 24 |" in out and "| 1 | 24 |" in out


def test_eval_gsm8k_runs_on_the_mini_file(capsys, server, tmp_path):
    result = tmp_path / "gsm8k.jsonl"
    # Zero shots: the built-in model's tokenizer is byte-level and the shared server's context is 256.
    rc = gsm8k.main(["--base-url", server.url, "--api-key", API_KEY, "--data-path", MINI, "--num-shots", "0",
                     "--num-questions", "3", "--max-new-tokens", "8", "--parallel", "3", "--disable-tqdm",
                     "--result-file", str(result)])
    out = capsys.readouterr().out
    assert rc == 0, out
    for label in ("Accuracy: ", "Invalid: ", "Latency: ", "Output throughput: "):
        assert label in out
    r = json.loads(result.read_text())
    assert r["num_questions"] == 3 and r["failed"] == 0
    assert all("Question" not in a["output"] for a in r["answers"])     # the stop string reached the engine


@pytest.fixture(scope="module")
def parsing_server():
    return shared_server(("--reasoning-parser", "deepseek-r1", "--tool-call-parser", "deepseekv3"))


def _chat(server, stream: bool, **extra):
    body = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "stream": stream, **extra}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=server.headers, timeout=120)


def test_chat_reasoning_parser_is_wired(parsing_server):
    # The random model never closes a <think> block: with deepseek-r1 all of it is reasoning.
    whole = _chat(parsing_server, stream=False).json()
    msg = whole["choices"][0]["message"]
    assert msg["content"] == "" and msg["reasoning_content"] and whole["choices"][0]["finish_reason"] == "length"
    events = [json.loads(line[6:]) for line in _chat(parsing_server, stream=True).text.splitlines()
              if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == ""
    # With tools the answer also passes the tool-call parser: plain text stays, no calls invented.
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = _chat(parsing_server, stream=False, tools=tools).json()["choices"][0]
    assert with_tools["message"]["reasoning_content"] == msg["reasoning_content"]
    assert "tool_calls" not in with_tools["message"] and with_tools["finish_reason"] == "length"


def test_flags_are_validated():
    from mlaserve.server.args import parse_args
    args = parse_args(["--reasoning-parser", "glm45", "--tool-call-parser", "deepseekv3"])
    assert (args.reasoning_parser, args.tool_call_parser) == ("glm45", "deepseekv3")
    with pytest.raises(SystemExit):
        parse_args(["--reasoning-parser", "nope"])
