"""`mlaserve serve` on a CUDA GPU with its defaults (built-in model, bf16, the fastest backends):
it starts, answers the OpenAI routes and SGLang's /generate, sustains 16 concurrent streams, and
gives every KV page back."""

import asyncio

import httpx
import pytest
import torch

from tests.server_harness import API_KEY, start_server, wait_idle

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def server():
    s = start_server(["--device", "cuda", "--api-key", API_KEY, "--max-total-tokens", "8192",
                      "--log-level", "warning"], timeout=300)
    yield s
    s.stop()


def test_starts_and_answers(server):
    # plain HTTP: the device image has httpx but not the openai client (the CPU tests use that one)
    assert server.start_seconds < 120, server.start_seconds
    post = lambda route, body: httpx.post(f"{server.url}{route}", headers=server.headers, json=body,  # noqa: E731
                                          timeout=60)
    out = post("/v1/completions", {"model": "mlaserve-builtin", "prompt": "Hello from the GPU", "max_tokens": 16,
                                   "temperature": 0, "logprobs": 2, "ignore_eos": True}).json()
    assert out["usage"]["completion_tokens"] == 16 and len(out["choices"][0]["logprobs"]["tokens"]) == 16
    chat = post("/v1/chat/completions", {"model": "mlaserve-builtin", "max_tokens": 8, "ignore_eos": True,
                                         "messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["usage"]["completion_tokens"] == 8 and chat["choices"][0]["message"]["role"] == "assistant"
    r = post("/generate", {"text": "native", "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 8


async def _streams(server, n: int) -> list[int]:
    async def one(i: int) -> int:
        body = {"prompt": f"stream {i} " * (1 + i % 7), "max_tokens": 64, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        tokens = 0
        async with client.stream("POST", f"{server.url}/v1/completions", json=body, headers=server.headers) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"usage": {' in line:
                    tokens = int(line.split('"completion_tokens": ')[1].split(",")[0])
        return tokens

    async with httpx.AsyncClient(timeout=300) as client:
        return await asyncio.gather(*(one(i) for i in range(n)))


def test_16_concurrent_streams_and_no_leak(server):
    total = wait_idle(server)["mlaserve_kv_pages_total"]
    assert asyncio.run(_streams(server, 16)) == [64] * 16
    assert wait_idle(server)["mlaserve_kv_pages_free"] == total
