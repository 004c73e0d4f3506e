"""SGLang's native routes: POST /generate, GET /get_model_info, POST /start_profile and
/stop_profile; and the open routes GET /health and GET /metrics.

/generate takes `text` or `input_ids` (one prompt or a list), `sampling_params` (one for all, or
a list), `stream`, `return_logprob` / `top_logprobs_num` / `logprob_start_len`, `rid`. A response:
    {"text": str, "output_ids": [int],
     "meta_info": {"id", "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency",
                   "finish_reason": None | {"type": "length", "length": n} | {"type": "stop", "matched": id or str}
                                    | {"type": "abort"},
                   ["output_token_logprobs": [[logprob, id, text|None]], "output_top_logprobs": [[...]],
                    "input_token_logprobs": [...]]}}
a list of them for a list of prompts. Streaming sends SSE events `data: {...}` whose text,
output_ids and counts are cumulative (as SGLang's are), each with "index" for a list of
prompts, then `data: [DONE]`.
"""

import os
import time
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mlaserve.server.app import state_of
from mlaserve.server.errors import APIError
from mlaserve.server.generation import (SSE_DONE, Choice, ClientDisconnected, Job, build_params, collect, new_id,
                                        record_done, run_jobs, sse, sse_error, validate_jobs)
from mlaserve.server.logprobs import sglang_logprobs
from mlaserve.server.openai_api import parse_body
from mlaserve.server.protocol import GenerateRequest, GenerateSamplingParams

protected = APIRouter()
open_routes = APIRouter()


def _prompts(state, req: GenerateRequest) -> tuple[list[list[int]], bool]:
    """Token-id prompts, and whether the request was a batch (list in, list out)."""
    if (req.text is None) == (req.input_ids is None):
        raise APIError("give exactly one of `text` and `input_ids`", param="text")
    if req.text is not None:
        if isinstance(req.text, str):
            return [state.tokenizer(req.text)["input_ids"]], False
        if not req.text:
            raise APIError("text must not be an empty list", param="text")
        return [state.tokenizer(t)["input_ids"] for t in req.text], True
    if isinstance(req.input_ids[0], int):
        return [list(req.input_ids)], False
    return [list(ids) for ids in req.input_ids], True


def _job_params(req: GenerateRequest, num_prompts: int) -> list[GenerateSamplingParams]:
    sp = req.sampling_params
    if isinstance(sp, list):
        if len(sp) != num_prompts:
            raise APIError(f"sampling_params has {len(sp)} entries for {num_prompts} prompts",
                           param="sampling_params")
        return sp
    return [sp if sp is not None else GenerateSamplingParams()] * num_prompts


def _engine_params(req: GenerateRequest, sp: GenerateSamplingParams):
    problem = sp.unsupported()
    if problem is not None:
        raise APIError(problem[1], param=problem[0], code="unsupported_parameter")
    return build_params(
        "invalid sampling_params", max_tokens=sp.max_new_tokens, min_tokens=sp.min_new_tokens,
        temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, stop=sp.stop, stop_token_ids=sp.stop_token_ids,
        ignore_eos=sp.ignore_eos, seed=sp.sampling_seed if sp.sampling_seed is not None else sp.seed,
        skip_special_tokens=sp.skip_special_tokens,
        logprobs=req.top_logprobs_num if req.return_logprob else None,
        prompt_logprobs=req.return_logprob and req.logprob_start_len >= 0)


def _finish_reason(c: Choice) -> dict | None:
    if c.finish_reason is None:
        return None
    if c.finish_reason == "length":
        return {"type": "length", "length": len(c.token_ids)}
    if c.finish_reason == "stop":
        return {"type": "stop", "matched": c.stop_reason}
    return {"type": c.finish_reason}


def _result(state, req: GenerateRequest, job: Job, c: Choice, start: float) -> dict:
    meta = {"id": job.request_id, "prompt_tokens": len(job.prompt_token_ids), "completion_tokens": len(c.token_ids),
            "cached_tokens": c.num_cached_tokens, "finish_reason": _finish_reason(c),
            "e2e_latency": time.perf_counter() - start}
    if req.return_logprob:
        texts = state.token_texts if req.return_text_in_logprobs else None
        meta["output_token_logprobs"] = sglang_logprobs(texts, c.token_ids, c.logprobs)
        if req.top_logprobs_num:
            meta["output_top_logprobs"] = [sglang_logprobs(texts, list(top), list(top.values()))
                                           for top in c.top_logprobs]
        if c.prompt_logprobs is not None:
            first = req.logprob_start_len
            meta["input_token_logprobs"] = sglang_logprobs(texts, job.prompt_token_ids[first:],
                                                           c.prompt_logprobs[first:])
    return {"text": c.full_text, "output_ids": list(c.token_ids), "meta_info": meta}


@protected.post("/generate")
async def generate(request: Request):
    start = time.perf_counter()
    state = state_of(request)
    req: GenerateRequest = await parse_body(request, GenerateRequest)
    prompts, batch = _prompts(state, req)
    if isinstance(req.rid, str) and len(prompts) > 1:
        raise APIError(f"rid must be a list of {len(prompts)} ids for {len(prompts)} prompts, got one string",
                       param="rid")
    rids = req.rid if isinstance(req.rid, list) else [req.rid] if req.rid else None
    if rids is not None and len(rids) != len(prompts):
        raise APIError(f"rid has {len(rids)} entries for {len(prompts)} prompts", param="rid")
    base = new_id("gen")
    jobs = [Job(rids[i] if rids else f"{base}-{i}", ids, _engine_params(req, sp))
            for i, (ids, sp) in enumerate(zip(prompts, _job_params(req, len(prompts))))]
    validate_jobs(state.engine, jobs)
    if req.stream:
        return StreamingResponse(_stream(state, req, jobs, batch, start), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        choices = await collect(request, state.engine, jobs)
    except ClientDisconnected:
        return JSONResponse({}, status_code=499)
    results = [_result(state, req, job, c, start) for job, c in zip(jobs, choices)]
    record_done(state.metrics, "generate", jobs, choices, start)
    return results if batch else results[0]


async def _stream(state, req: GenerateRequest, jobs: list[Job], batch: bool, start: float):
    choices = [Choice() for _ in jobs]
    try:
        async for k, out in run_jobs(state.engine, jobs):
            choices[k].add(out)
            if not out.new_token_ids and not out.finished:
                continue
            event = _result(state, req, jobs[k], choices[k], start)
            if batch:
                event["index"] = k
            yield sse(event)
        record_done(state.metrics, "generate", jobs, choices, start)
    except Exception as e:
        yield sse_error(e)
    yield SSE_DONE


@protected.get("/get_model_info")
async def model_info(request: Request):
    s = state_of(request)
    return {"model_path": s.model_path, "tokenizer_path": s.model_path, "served_model_name": s.served_model_name,
            "is_generation": True, "context_length": s.context_length}


@protected.post("/start_profile")
async def start_profile(request: Request):
    """Start a torch profiler over every thread (the engine's included); traces go to
    $MLASERVE_TORCH_PROFILER_DIR (default: the system temp dir) at /stop_profile."""
    import torch

    state = state_of(request)
    if state.profiler is not None:
        raise APIError("a profile is already running; POST /stop_profile first")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    try:
        config = torch.profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError as e:
        raise APIError(f"this torch ({torch.__version__}) cannot profile the engine thread: {e}", status=500,
                       type="server_error") from None
    prof = torch.profiler.profile(activities=activities, experimental_config=config)
    prof.start()
    state.profiler = prof
    return {"message": "profiling started"}


@protected.post("/stop_profile")
async def stop_profile(request: Request):
    import tempfile

    state = state_of(request)
    prof = state.profiler
    if prof is None:
        raise APIError("no profile is running; POST /start_profile first")
    state.profiler = None
    prof.stop()
    out_dir = Path(os.environ.get("MLASERVE_TORCH_PROFILER_DIR") or tempfile.gettempdir())
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"mlaserve-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.trace.json"
    prof.export_chrome_trace(str(path))
    return {"message": "profiling stopped", "trace": str(path)}


@open_routes.get("/health")
async def health(request: Request):
    if not state_of(request).engine.stats().get("alive", True):
        raise APIError("the engine loop has stopped", status=503, type="server_error")
    return Response(status_code=200)


@open_routes.get("/metrics")
async def metrics(request: Request):
    body, content_type = state_of(request).metrics.render()
    return Response(body, media_type=content_type)
