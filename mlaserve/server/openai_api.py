"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

A request with `n` choices (and, for completions, several prompts) becomes one engine request
per choice, all run at once; choice index = prompt index * n + j. Seeded requests give choice j
the seed `seed + j` (wrapped to 64 bits), so the n samples differ but repeat exactly. `usage` counts each prompt once
and every generated token.
"""

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from mlaserve.server.app import ServerState, state_of
from mlaserve.server.errors import APIError, from_validation_error
from mlaserve.server.generation import (SSE_DONE, Choice, ClientDisconnected, Job, build_params, collect, new_id,
                                        record_done, run_jobs, sse, sse_error, validate_jobs)
from mlaserve.server.logprobs import CompletionLogprobs, chat_logprobs_content
from mlaserve.server.parsers.chat import ChatOutputParser
from mlaserve.server.protocol import ChatCompletionRequest, CompletionRequest

router = APIRouter()


async def parse_body(request: Request, model_cls):
    """The JSON body as `model_cls`; malformed JSON, wrong fields and unsupported values are 400s."""
    raw = await request.body()
    try:
        body = model_cls.model_validate_json(raw or b"null")
    except ValidationError as e:
        raise from_validation_error(e) from None
    problem = body.unsupported()
    if problem is not None:
        raise APIError(problem[1], param=problem[0], code="unsupported_parameter")
    return body


def _sampling(req, choice: int, max_tokens: int | None, logprobs: int | None):
    return build_params(
        "invalid sampling parameters",
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos, seed=None if req.seed is None else _choice_seed(req.seed, choice), logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens)


def _choice_seed(seed: int, choice: int) -> int:
    """seed + choice, wrapped to stay a signed 64-bit seed."""
    return (seed + choice + 2 ** 63) % 2 ** 64 - 2 ** 63


def _usage(prompts: list[list[int]], choices: list[Choice], n: int) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for c in choices)
    cached = sum(choices[i * n].num_cached_tokens for i in range(len(prompts)))
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


def _completion_prompts(state: ServerState, prompt) -> list[list[int]]:
    """`prompt` as token-id lists: a string, strings, token ids, or lists of token ids."""
    if isinstance(prompt, str):
        return [state.tokenizer(prompt)["input_ids"]]
    if not prompt:
        raise APIError("prompt must not be empty", param="prompt")
    if isinstance(prompt[0], str):
        return [state.tokenizer(p)["input_ids"] for p in prompt]
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [list(p) for p in prompt]


@router.get("/v1/models")
async def list_models(request: Request):
    s = state_of(request)
    return {"object": "list", "data": [{"id": s.served_model_name, "object": "model", "created": s.created,
                                        "owned_by": "mlaserve", "root": s.model_path,
                                        "max_model_len": s.context_length}]}


@router.post("/v1/completions")
async def completions(request: Request):
    start = time.perf_counter()
    state = state_of(request)
    req: CompletionRequest = await parse_body(request, CompletionRequest)
    state.check_model(req.model)
    prompts = _completion_prompts(state, req.prompt)
    rid = new_id("cmpl")
    jobs = [Job(f"{rid}-{i * req.n + j}", ids, _sampling(req, j, req.max_tokens, req.logprobs))
            for i, ids in enumerate(prompts) for j in range(req.n)]
    validate_jobs(state.engine, jobs)
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": state.served_model_name}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _stream(state, "completions", jobs, prompts, req.n, include_usage,
                       _CompletionChunks(state, head, len(jobs), req.logprobs is not None), start)
    try:
        choices = await collect(request, state.engine, jobs)
    except ClientDisconnected:
        return JSONResponse({}, status_code=499)
    record_done(state.metrics, "completions", jobs, choices, start)
    out = []
    for k, c in enumerate(choices):
        lp = None
        if req.logprobs is not None:
            lp = CompletionLogprobs(state.token_texts).chunk(c.token_ids, c.logprobs, c.top_logprobs)
        out.append({"index": k, "text": c.full_text, "logprobs": lp, "finish_reason": c.finish_reason,
                    "matched_stop": c.stop_reason})
    return {**head, "choices": out, "usage": _usage(prompts, choices, req.n)}


def _chat_prompt(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    if not getattr(state.tokenizer, "chat_template", None):
        raise APIError(f"the model {state.served_model_name!r} has no chat template; use /v1/completions",
                       param="messages")
    try:
        text = state.tokenizer.apply_chat_template(
            [m.for_template() for m in req.messages], tools=req.tools, tokenize=False,
            add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message,
            **(req.chat_template_kwargs or {}))
    except Exception as e:     # a template's raise_exception() or a bad kwarg: the request's fault
        raise APIError(f"the chat template rejected the messages: {e}", param="messages") from None
    return state.tokenizer(text, add_special_tokens=False)["input_ids"]


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    start = time.perf_counter()
    state = state_of(request)
    req: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest)
    state.check_model(req.model)
    prompt = _chat_prompt(state, req)
    parsers = [ChatOutputParser(state.reasoning_parser, state.tool_call_parser, req.tools, req.tool_choice)
               for _ in range(req.n)]
    if parsers[0].needs_special_tokens:
        req.skip_special_tokens = False
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    rid = new_id("chatcmpl")
    jobs = [Job(f"{rid}-{j}", prompt, _sampling(req, j, req.output_limit, logprobs)) for j in range(req.n)]
    validate_jobs(state.engine, jobs)
    head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": state.served_model_name}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _stream(state, "chat", jobs, [prompt], req.n, include_usage,
                       _ChatChunks(state, head, req.n, req.logprobs, parsers), start)
    try:
        choices = await collect(request, state.engine, jobs)
    except ClientDisconnected:
        return JSONResponse({}, status_code=499)
    record_done(state.metrics, "chat", jobs, choices, start)
    out = []
    for k, c in enumerate(choices):
        lp = None
        if req.logprobs:
            lp = {"content": chat_logprobs_content(state.token_texts, c.token_ids, c.logprobs, c.top_logprobs),
                  "refusal": None}
        out.append({"index": k, "message": parsers[k].message(c.full_text), "logprobs": lp,
                    "finish_reason": parsers[k].finish_reason(c.finish_reason), "matched_stop": c.stop_reason})
    return {**head, "choices": out, "usage": _usage([prompt], choices, req.n)}


class _CompletionChunks:
    """Stream chunks of /v1/completions."""

    def __init__(self, state: ServerState, head: dict, num_choices: int, logprobs: bool):
        self.head = head
        self._logprobs = [CompletionLogprobs(state.token_texts) for _ in range(num_choices)] if logprobs else None

    def opening(self) -> list[dict]:
        return []

    def chunk(self, k: int, out) -> dict | None:
        lp = None
        if self._logprobs is not None and out.new_token_ids:
            lp = self._logprobs[k].chunk(out.new_token_ids, out.new_logprobs, out.new_top_logprobs)
        if not out.new_text and lp is None and not out.finished:
            return None
        return {**self.head, "choices": [{"index": k, "text": out.new_text, "logprobs": lp,
                                          "finish_reason": out.finish_reason if out.finished else None}]}


class _ChatChunks:
    """Stream chunks of /v1/chat/completions: a role chunk per choice first, then content deltas."""

    def __init__(self, state: ServerState, head: dict, n: int, logprobs: bool, parsers: list[ChatOutputParser]):
        self.head = {**head, "object": "chat.completion.chunk"}
        self._state = state
        self._n = n
        self._logprobs = logprobs
        self._parsers = parsers

    def opening(self) -> list[dict]:
        return [{**self.head, "choices": [{"index": k, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}]} for k in range(self._n)]

    def chunk(self, k: int, out) -> dict | None:
        lp = None
        if self._logprobs and out.new_token_ids:
            lp = {"content": chat_logprobs_content(self._state.token_texts, out.new_token_ids, out.new_logprobs,
                                                   out.new_top_logprobs), "refusal": None}
        parser = self._parsers[k]
        if parser.active:
            delta = parser.delta(out.new_text, out.finished)
        else:
            delta = {"content": out.new_text} if out.new_text else {}
        if not delta and lp is None and not out.finished:
            return None
        return {**self.head, "choices": [{"index": k, "delta": delta, "logprobs": lp,
                                          "finish_reason": parser.finish_reason(out.finish_reason)
                                          if out.finished else None}]}


def _stream(state: ServerState, route: str, jobs: list[Job], prompts: list[list[int]], n: int,
            include_usage: bool, chunks, start: float) -> StreamingResponse:
    async def events():
        choices = [Choice() for _ in jobs]
        extra = {"usage": None} if include_usage else {}
        try:
            for c in chunks.opening():
                yield sse({**c, **extra})
            async for k, out in run_jobs(state.engine, jobs):
                choices[k].add(out)
                c = chunks.chunk(k, out)
                if c is not None:
                    yield sse({**c, **extra})
            record_done(state.metrics, route, jobs, choices, start)
            if include_usage:
                yield sse({**chunks.head, "choices": [], "usage": _usage(prompts, choices, n)})
        except Exception as e:
            yield sse_error(e)
        yield SSE_DONE

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
