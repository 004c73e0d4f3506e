"""Between the HTTP routes and the AsyncEngine: fan-out of several engine requests, SSE framing,
and aborting on client disconnect.

A route turns its body into `Job`s (one per prompt × n), then either collects every output
(`collect`) or streams them (`run_jobs`). Either way, when the client goes away the engine
requests still running are aborted at once, which frees their KV pages:
- streaming: Starlette cancels the response's body iterator on `http.disconnect`; `run_jobs`'s
  `finally` cancels its pump tasks, which closes each engine iterator (AsyncEngine aborts then);
- non-streaming: `until_disconnected` races the work against the client's `http.disconnect`.
"""

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import Request

from mlaserve.engine.request import RequestOutput
from mlaserve.engine.sampling_params import SamplingParams
from mlaserve.server.errors import APIError


@dataclass
class Job:
    """One engine request: prompt tokens [n] and how to sample."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class Choice:
    """What one job produced so far (summed over its outputs)."""
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        self.token_ids.extend(out.new_token_ids)
        self.text.append(out.new_text)
        self.logprobs.extend(out.new_logprobs)
        self.top_logprobs.extend(out.new_top_logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason

    @property
    def full_text(self) -> str:
        return "".join(self.text)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def build_params(job_name: str, **kwargs) -> SamplingParams:
    """SamplingParams, its ValueError turned into a 400."""
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise APIError(f"{job_name}: {e}", param=getattr(e, "param", None)) from None


def validate_jobs(engine, jobs: list[Job]) -> None:
    """The engine's own checks (vocabulary, context length, pool size) as 400s, before anything runs."""
    for job in jobs:
        try:
            engine.validate(job.prompt_token_ids, job.params)
        except ValueError as e:
            raise APIError(str(e), param="prompt", code="context_length_exceeded"
                           if "does not fit" in str(e) else "invalid_value") from None


async def run_jobs(engine, jobs: list[Job]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Every job at once; yields (job index, output) in arrival order. Closing or cancelling the
    iterator aborts every job still running. An engine error ends the iteration by raising it."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, job: Job) -> None:
        outputs = engine.generate(job.request_id, job.prompt_token_ids, job.params)
        try:
            async for out in outputs:
                queue.put_nowait((i, out, None))
        except Exception as e:          # cancellation (BaseException) is not reported: the consumer left
            queue.put_nowait((i, None, e))
            return
        finally:
            await outputs.aclose()
        queue.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        remaining = len(jobs)
        while remaining:
            i, out, err = await queue.get()
            if err is not None:
                raise err
            if out is None:
                remaining -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(request: Request, engine, jobs: list[Job]) -> list[Choice]:
    """Run the jobs to the end; one Choice per job. 400 on an engine ValueError."""
    async def work() -> list[Choice]:
        choices = [Choice() for _ in jobs]
        outputs = run_jobs(engine, jobs)
        try:
            async for i, out in outputs:
                choices[i].add(out)
        finally:
            await outputs.aclose()
        return choices

    try:
        return await until_disconnected(request, work())
    except ValueError as e:
        raise APIError(str(e)) from None


class ClientDisconnected(Exception):
    pass


async def until_disconnected(request: Request, coro):
    """Await `coro`, cancelling it if the client disconnects first (then ClientDisconnected)."""
    work = asyncio.ensure_future(coro)

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(wait_disconnect())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if work in done:
        return work.result()
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    raise ClientDisconnected()


def sse(data) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(err: Exception) -> str:
    """An error after the stream started (status 200 is already sent): an error event."""
    if isinstance(err, APIError):
        return sse(err.body())
    kind = "invalid_request_error" if isinstance(err, ValueError) else "server_error"
    return sse(APIError(str(err), type=kind).body())


def now() -> int:
    return int(time.time())


def record_done(metrics, route: str, jobs: list[Job], choices: list[Choice], start: float) -> None:
    """One finished request per job in the server's metrics (end-to-end latency from `start`)."""
    e2e = time.perf_counter() - start
    for job, c in zip(jobs, choices):
        metrics.request_done(route, c.finish_reason, len(job.prompt_token_ids), len(c.token_ids), e2e)
