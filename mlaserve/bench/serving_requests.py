"""One request to a server, timed token by token: SGLang's `/generate` and the OpenAI routes.

Each request function posts one prompt and returns a `RequestResult` with its time to first
token, inter-token latencies and end-to-end latency, or `success=False` and the error text
(HTTP status and body, or the exception) — never raised, so one bad request does not stop a
benchmark, and never dropped: the report counts and summarizes failures.
"""

import json
import time
import traceback
from dataclasses import dataclass, field

import aiohttp

# 6 h total: long benchmarks must not be cut by the client; 10 MB read buffer: big SSE chunks.
_TIMEOUT = aiohttp.ClientTimeout(total=6 * 3600)
_READ_BUFSIZE = 10 * 1024 ** 2


def client_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=_TIMEOUT, read_bufsize=_READ_BUFSIZE)


@dataclass
class RequestInput:
    api_url: str
    prompt: str | list[int]
    prompt_len: int
    output_len: int
    model: str | None = None
    stream: bool = True
    ignore_eos: bool = True
    headers: dict = field(default_factory=dict)
    extra_body: dict = field(default_factory=dict)


@dataclass
class RequestResult:
    success: bool = False
    generated_text: str = ""
    output_len: int = 0                 # tokens generated, as the server counted them
    prompt_len: int = 0                 # tokens the benchmark asked for
    server_prompt_tokens: int | None = None   # tokens the server says it saw (chat templates add some)
    start_time: float = 0.0             # time.perf_counter() when the request was sent
    ttft: float = 0.0                   # s
    latency: float = 0.0                # s, end to end
    itl: list[float] = field(default_factory=list)   # s, one entry per token after the first
    error: str = ""


def _sse_payload(line: bytes) -> str | None:
    """The JSON text of one SSE `data:` line; None for blank lines, comments and [DONE]."""
    text = line.decode("utf-8").strip()
    if not text.startswith("data:"):
        return None
    text = text[len("data:"):].strip()
    return None if text in ("", "[DONE]") else text


async def _fail(out: RequestResult, response: aiohttp.ClientResponse) -> RequestResult:
    body = await response.text()
    out.error = f"HTTP {response.status} {response.reason}: {body[:500]}"
    return out


async def request_generate(session: aiohttp.ClientSession, inp: RequestInput) -> RequestResult:
    """SGLang's native `POST /generate` (`input_ids` or `text`; streamed text is cumulative)."""
    payload = {
        ("input_ids" if isinstance(inp.prompt, list) else "text"): inp.prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": inp.output_len, "ignore_eos": inp.ignore_eos},
        "stream": inp.stream,
        **inp.extra_body,
    }
    out = RequestResult(prompt_len=inp.prompt_len)
    out.start_time = st = last = time.perf_counter()
    try:
        async with session.post(inp.api_url, json=payload, headers=inp.headers) as response:
            if response.status != 200:
                return await _fail(out, response)
            if not inp.stream:
                data = await response.json()
                out.latency = out.ttft = time.perf_counter() - st
                out.generated_text = data["text"]
                out.output_len = data["meta_info"]["completion_tokens"]
                out.server_prompt_tokens = data["meta_info"].get("prompt_tokens")
                out.success = True
                return out
            tokens_seen = 0
            async for line in response.content:
                payload_text = _sse_payload(line)
                if payload_text is None:
                    continue
                data = json.loads(payload_text)
                if "error" in data:
                    out.error = f"error event: {data['error']}"
                    return out
                now = time.perf_counter()
                meta = data.get("meta_info", {})
                out.server_prompt_tokens = meta.get("prompt_tokens", out.server_prompt_tokens)
                text = data.get("text", "")
                # SGLang streams the whole text so far; accept per-chunk deltas too.
                out.generated_text = text if text.startswith(out.generated_text) else out.generated_text + text
                n = meta.get("completion_tokens", tokens_seen + (1 if text else 0))
                if n <= tokens_seen:
                    continue
                if tokens_seen == 0:
                    out.ttft = now - st
                else:
                    # Several tokens in one chunk share its gap (as SGLang does).
                    out.itl += [(now - last) / (n - tokens_seen)] * (n - tokens_seen)
                last, tokens_seen = now, n
            out.latency = time.perf_counter() - st
            out.output_len = tokens_seen
            out.success = True
    except Exception:
        out.error = traceback.format_exc()
    return out


async def _stream_openai(response, out: RequestResult, st: float, piece_of) -> None:
    """Read an OpenAI SSE stream: `piece_of(choice)` is the text a chunk adds."""
    last = st
    async for line in response.content:
        payload_text = _sse_payload(line)
        if payload_text is None:
            continue
        data = json.loads(payload_text)
        if "error" in data:
            raise RuntimeError(f"error event: {data['error']}")
        usage = data.get("usage") or {}
        if "completion_tokens" in usage:
            out.output_len = usage["completion_tokens"]
            out.server_prompt_tokens = usage.get("prompt_tokens")
        choices = data.get("choices") or []
        piece = piece_of(choices[0]) if choices else ""
        if piece:
            now = time.perf_counter()
            if not out.generated_text:
                out.ttft = now - st
            else:
                out.itl.append(now - last)
            last = now
            out.generated_text += piece
    out.latency = time.perf_counter() - st


async def request_completions(session: aiohttp.ClientSession, inp: RequestInput) -> RequestResult:
    """OpenAI `POST /v1/completions` (vLLM, SGLang, mlaserve): text or token-id prompt."""
    payload = {
        "model": inp.model, "prompt": inp.prompt, "temperature": 0.0, "max_tokens": inp.output_len,
        "stream": inp.stream, "ignore_eos": inp.ignore_eos, **inp.extra_body,
    }
    if inp.stream:
        payload["stream_options"] = {"include_usage": True}
    return await _post_openai(session, inp, payload, lambda c: c.get("text") or "", lambda c: c["text"])


async def request_chat(session: aiohttp.ClientSession, inp: RequestInput) -> RequestResult:
    """OpenAI `POST /v1/chat/completions`: the prompt is one user message."""
    if not isinstance(inp.prompt, str):
        raise ValueError("the chat backend takes text prompts, not token ids")
    payload = {
        "model": inp.model, "messages": [{"role": "user", "content": inp.prompt}], "temperature": 0.0,
        "max_tokens": inp.output_len, "stream": inp.stream, "ignore_eos": inp.ignore_eos, **inp.extra_body,
    }
    if inp.stream:
        payload["stream_options"] = {"include_usage": True}
    return await _post_openai(session, inp, payload,
                              lambda c: (c.get("delta") or {}).get("content") or "",
                              lambda c: c["message"]["content"] or "")


async def _post_openai(session, inp: RequestInput, payload: dict, stream_piece, whole_text) -> RequestResult:
    out = RequestResult(prompt_len=inp.prompt_len)
    out.start_time = st = time.perf_counter()
    out.output_len = -1
    try:
        async with session.post(inp.api_url, json=payload, headers=inp.headers) as response:
            if response.status != 200:
                return await _fail(out, response)
            if inp.stream:
                await _stream_openai(response, out, st, stream_piece)
            else:
                data = await response.json()
                out.latency = out.ttft = time.perf_counter() - st
                out.generated_text = whole_text(data["choices"][0])
                usage = data.get("usage") or {}
                out.output_len = usage.get("completion_tokens", -1)
                out.server_prompt_tokens = usage.get("prompt_tokens")
            if out.output_len < 0:
                # No usage from the server: count what was asked for, as SGLang's client does.
                out.output_len = inp.output_len
            out.success = True
    except Exception:
        out.error = traceback.format_exc()
    return out


@dataclass(frozen=True)
class Backend:
    endpoint: str
    request: object            # async (session, RequestInput) -> RequestResult
    default_port: int
    takes_token_ids: bool      # the API accepts a prompt as token ids


BACKENDS = {
    "sglang": Backend("/generate", request_generate, 30000, True),
    "mlaserve": Backend("/generate", request_generate, 30000, True),
    "sglang-oai": Backend("/v1/completions", request_completions, 30000, True),
    "vllm": Backend("/v1/completions", request_completions, 8000, True),
    "openai": Backend("/v1/completions", request_completions, 8000, True),
    "openai-chat": Backend("/v1/chat/completions", request_chat, 8000, False),
    "sglang-oai-chat": Backend("/v1/chat/completions", request_chat, 30000, False),
    "vllm-chat": Backend("/v1/chat/completions", request_chat, 8000, False),
}


async def post_profile(session: aiohttp.ClientSession, url: str, headers: dict) -> str:
    """POST /start_profile or /stop_profile; returns the server's answer, raises on failure."""
    async with session.post(url, json={}, headers=headers) as response:
        body = await response.text()
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {body[:500]}")
        return body
