"""Under load and under client disconnects: requests queue and are preempted in a small KV pool,
yet each gets exactly its tokens run alone; a client that leaves frees its pages at once."""

import asyncio
import json
import random
import socket
import time

import httpx
import pytest

from server_harness import CONTEXT_LENGTH, POOL_PAGES, shared_server, wait_idle


@pytest.fixture(scope="module")
def server():
    return shared_server()


def _prompts(n: int, seed: int = 0) -> list[tuple[str, int]]:
    """n distinct prompts of 10..60 characters (= tokens, plus BOS) with 6..10 tokens to generate."""
    rng = random.Random(seed)
    words = "alpha beta gamma delta echo fox golf hotel india juliet kilo lima mike".split()
    out = []
    for i in range(n):
        text = f"{i} " + " ".join(rng.choice(words) for _ in range(12))
        out.append((text[:rng.randint(10, 60)], rng.randint(6, 10)))
    return out


async def _stream_one(client: httpx.AsyncClient, server, prompt: str, max_tokens: int) -> tuple[str, int, str]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    text, usage, reason = [], None, None
    async with client.stream("POST", f"{server.url}/v1/completions", json=body, headers=server.headers) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            for c in event["choices"]:
                text.append(c["text"])
                reason = c["finish_reason"] or reason
            usage = event.get("usage") or usage
    return "".join(text), usage["completion_tokens"], reason


async def _all_at_once(server, prompts):
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        return await asyncio.gather(*(_stream_one(client, server, p, n) for p, n in prompts))


def test_64_concurrent_streams_in_a_small_pool_equal_each_alone(server):
    prompts = _prompts(64)
    before = wait_idle(server)
    assert before["mlaserve_kv_pages_free"] == before["mlaserve_kv_pages_total"] == POOL_PAGES

    results = asyncio.run(_all_at_once(server, prompts))

    after = wait_idle(server)
    assert after["mlaserve_num_preemptions_total"] > before["mlaserve_num_preemptions_total"], \
        "the pool was meant to be too small for all requests: no preemption happened"
    assert after["mlaserve_kv_pages_free"] == POOL_PAGES, "KV pages leaked"
    for (prompt, n), (text, count, reason) in zip(prompts, results):
        assert count == n and reason == "length"
        alone = httpx.post(f"{server.url}/v1/completions", headers=server.headers, timeout=60, json={
            "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}).json()
        assert alone["choices"][0]["text"] == text, prompt
    assert wait_idle(server)["mlaserve_kv_pages_free"] == POOL_PAGES


def _metrics_after_events(server, response, count: int) -> dict:
    """Read `count` events, then the metrics, while the stream is still open (leaving the line
    iterator early closes the connection)."""
    seen = 0
    for line in response.iter_lines():
        if line.startswith("data: "):
            seen += 1
            if seen == count:
                return server.metrics()
    raise AssertionError(f"the stream ended after {seen} events")


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Disconnect me please, I am long enough.", "max_tokens": 200}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Disconnect me, a chat."}], "max_tokens": 200}),
    ("/generate", {"text": "Disconnect me, native.", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}),
])
def test_disconnect_mid_stream_frees_pages(server, path, body):
    start = wait_idle(server)
    assert start["mlaserve_kv_pages_free"] == POOL_PAGES
    generated0 = start["mlaserve_engine_generation_tokens_total"]
    body = {**body, "stream": True, "ignore_eos": True, "temperature": 0}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", server.url + path, json=body, headers=server.headers) as r:
            assert r.status_code == 200
            busy = _metrics_after_events(server, r, 4)
            assert busy["mlaserve_num_running_reqs"] == 1 and busy["mlaserve_kv_pages_free"] < POOL_PAGES
    # the connection is closed: the server must abort the request, not generate its 200 tokens
    end = wait_idle(server, timeout=10)
    assert end["mlaserve_kv_pages_free"] == POOL_PAGES
    assert end["mlaserve_engine_generation_tokens_total"] - generated0 < 40


def test_disconnect_while_waiting_for_a_non_streamed_answer(server):
    """A raw socket sends a non-streaming request and closes once the engine is generating it: the
    request is aborted (never counted as finished), and its pages come back."""
    start = wait_idle(server)
    finished0 = start.get("mlaserve_requests_total", 0.0)
    generated0 = start["mlaserve_engine_generation_tokens_total"]
    body = json.dumps({"prompt": "Nobody waits for this answer", "max_tokens": 500, "ignore_eos": True,
                       "temperature": 0}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Authorization: {server.headers['Authorization']}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head + body)
        deadline = time.perf_counter() + 10
        while server.metrics()["mlaserve_engine_generation_tokens_total"] < generated0 + 3:
            assert time.perf_counter() < deadline, "the request never started generating"
            time.sleep(0.01)
    end = wait_idle(server, timeout=10)
    assert end["mlaserve_kv_pages_free"] == POOL_PAGES
    natural = CONTEXT_LENGTH - (1 + len("Nobody waits for this answer"))
    assert end["mlaserve_engine_generation_tokens_total"] - generated0 < natural - 10
    assert end.get("mlaserve_requests_total", 0.0) == finished0
