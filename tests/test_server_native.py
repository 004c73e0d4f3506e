"""SGLang's native /generate (text, input_ids, batches, streaming, logprobs), /metrics, /get_model_info,
and the profiler routes, against the real server."""

import json
import os

import httpx
import pytest

from server_harness import PAGE_SIZE, POOL_PAGES, shared_server, wait_idle


@pytest.fixture(scope="module")
def server():
    return shared_server()


def generate(server, body, **kw):
    r = httpx.post(f"{server.url}/generate", json=body, headers=server.headers, timeout=60, **kw)
    assert r.status_code == 200, r.text
    return r.json()


def stream_events(server, body) -> list:
    events = []
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True}, headers=server.headers,
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


def test_generate_text_and_input_ids_agree(server):
    text = "Hello there, General Kenobi"           # several pages long, so full pages can be shared
    by_text = generate(server, {"text": text, "sampling_params": GREEDY})
    meta = by_text["meta_info"]
    assert meta["completion_tokens"] == 10 == len(by_text["output_ids"])
    assert meta["finish_reason"] == {"type": "length", "length": 10}
    assert meta["prompt_tokens"] == len(text) + 1                     # BOS + one token per byte
    assert meta["e2e_latency"] > 0 and meta["id"]
    ids = [0] + [4 + b for b in text.encode()]                        # the built-in tokenizer's ids
    by_ids = generate(server, {"input_ids": ids, "sampling_params": GREEDY})
    assert by_ids["output_ids"] == by_text["output_ids"] and by_ids["text"] == by_text["text"]
    cached = by_ids["meta_info"]["cached_tokens"]                     # the same prompt again: its full pages hit
    assert cached % PAGE_SIZE == 0 and len(ids) - PAGE_SIZE <= cached < len(ids)


def test_generate_batch_of_prompts(server):
    out = generate(server, {"input_ids": [[0, 50, 60, 70], [0, 80]], "sampling_params": GREEDY})
    assert isinstance(out, list) and len(out) == 2
    alone = generate(server, {"input_ids": [0, 80], "sampling_params": GREEDY})
    assert out[1]["output_ids"] == alone["output_ids"]
    texts = generate(server, {"text": ["a", "bb"], "sampling_params": [dict(GREEDY, max_new_tokens=2),
                                                                       dict(GREEDY, max_new_tokens=3)]})
    assert [t["meta_info"]["completion_tokens"] for t in texts] == [2, 3]


def test_generate_stream_is_cumulative(server):
    whole = generate(server, {"text": "Streaming test", "sampling_params": GREEDY})
    events = stream_events(server, {"text": "Streaming test", "sampling_params": GREEDY})
    counts = [e["meta_info"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 10 and len(events) >= 2
    for e in events:
        assert e["text"].startswith(events[0]["text"]) and len(e["output_ids"]) == e["meta_info"]["completion_tokens"]
    assert events[-1]["text"] == whole["text"] and events[-1]["output_ids"] == whole["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])


def test_generate_stream_batch_has_indices(server):
    events = stream_events(server, {"input_ids": [[0, 40], [0, 41, 42]], "sampling_params": dict(GREEDY,
                                                                                                max_new_tokens=3)})
    assert {e["index"] for e in events} == {0, 1}
    last = {e["index"]: e for e in events}
    assert all(last[i]["meta_info"]["completion_tokens"] == 3 for i in (0, 1))


def test_generate_stop_and_logprobs(server):
    full = generate(server, {"text": "Stop here", "sampling_params": dict(GREEDY, max_new_tokens=20)})
    stop = full["text"][5:7]
    cut = generate(server, {"text": "Stop here", "sampling_params": dict(GREEDY, max_new_tokens=20, stop=stop)})
    assert cut["text"] == full["text"][:full["text"].index(stop)]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    lp = generate(server, {"text": "Stop here", "sampling_params": dict(GREEDY, max_new_tokens=4),
                           "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0,
                           "return_text_in_logprobs": True})
    meta = lp["meta_info"]
    assert [t[1] for t in meta["output_token_logprobs"]] == lp["output_ids"]
    assert "".join(t[2] for t in meta["output_token_logprobs"]) == lp["text"]
    for (val, tid, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert len(top) == 2 and top[0][1] == tid and top[0][0] == pytest.approx(val)   # greedy: top-1
    inputs = meta["input_token_logprobs"]
    assert len(inputs) == meta["prompt_tokens"] and inputs[0][0] is None and all(v[0] <= 0 for v in inputs[1:])


def test_model_info(server):
    info = httpx.get(f"{server.url}/get_model_info", headers=server.headers).json()
    assert info["model_path"].endswith("builtin-1") and info["is_generation"] is True


def test_metrics_content(server):
    generate(server, {"text": "count me", "sampling_params": dict(GREEDY, max_new_tokens=5)})
    m = wait_idle(server)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("mlaserve_num_running_reqs", "mlaserve_num_waiting_reqs", "mlaserve_kv_pages_used",
                 "mlaserve_kv_pages_total", "mlaserve_prefix_cache_hit_rate", "mlaserve_engine_generation_tokens_total",
                 "mlaserve_time_to_first_token_seconds_bucket", "mlaserve_inter_token_latency_seconds_bucket",
                 "mlaserve_requests_total", "mlaserve_generation_tokens_total"):
        assert f"\n{name}{{" in text, name
    assert "# TYPE mlaserve_time_to_first_token_seconds histogram" in text
    assert m["mlaserve_kv_pages_total"] == POOL_PAGES and m["mlaserve_kv_page_size"] == PAGE_SIZE
    assert m["mlaserve_engine_generation_tokens_total"] >= 5
    assert m["mlaserve_time_to_first_token_seconds_count"] >= 1 and m["mlaserve_inter_token_latency_seconds_count"] >= 4
    assert 0 <= m["mlaserve_prefix_cache_hit_rate"] <= 1
    before = m["mlaserve_generation_tokens_total"]
    generate(server, {"text": "more", "sampling_params": dict(GREEDY, max_new_tokens=7)})
    assert server.metrics()["mlaserve_generation_tokens_total"] == before + 7


def test_profile_writes_a_trace_of_the_engine_thread(server, tmp_path):
    # the server reads MLASERVE_TORCH_PROFILER_DIR at /stop_profile; the shared server has none set,
    # so the trace goes to the temp dir and the route says where
    r = httpx.post(f"{server.url}/start_profile", headers=server.headers)
    assert r.status_code == 200, r.text
    assert httpx.post(f"{server.url}/start_profile", headers=server.headers).status_code == 400
    generate(server, {"text": "profile me", "sampling_params": dict(GREEDY, max_new_tokens=3)})
    r = httpx.post(f"{server.url}/stop_profile", headers=server.headers, timeout=60)
    assert r.status_code == 200, r.text
    path = r.json()["trace"]
    try:
        events = json.load(open(path))["traceEvents"]
        assert any(e.get("name", "").startswith("aten::") for e in events)   # the engine thread's ops
    finally:
        os.remove(path)
    assert httpx.post(f"{server.url}/stop_profile", headers=server.headers).status_code == 400


def test_duplicate_rid_is_refused_and_streams_report_errors_as_events(server):
    """While request "dup" runs, another "dup" is a 400 (non-streaming) or, once a stream has begun
    (status 200 sent), an error event followed by [DONE]; the first request is unharmed."""
    long = {"text": "first of two", "rid": "dup", "stream": True,
            "sampling_params": dict(GREEDY, max_new_tokens=60)}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{server.url}/generate", json=long, headers=server.headers) as first:
            lines = first.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            r = httpx.post(f"{server.url}/generate", headers=server.headers, timeout=60,
                           json={"text": "second", "rid": "dup", "sampling_params": GREEDY})
            assert r.status_code == 400 and "already in use" in r.json()["error"]["message"]
            events = []
            with httpx.stream("POST", f"{server.url}/generate", headers=server.headers, timeout=60,
                              json={"text": "third", "rid": "dup", "stream": True,
                                    "sampling_params": GREEDY}) as third:
                assert third.status_code == 200
                events = [line for line in third.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and "already in use" in json.loads(events[0][6:])["error"]["message"]
            last = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"][-1]
    assert last["meta_info"]["completion_tokens"] == 60
    assert wait_idle(server)["mlaserve_kv_pages_free"] == POOL_PAGES
