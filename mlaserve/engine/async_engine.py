"""AsyncEngine: the Engine's step loop in one background thread, streamed to asyncio callers.

The API the server is built on (stable):

    eng = AsyncEngine(EngineConfig(model_path=..., ...))     # loads the model; raises ValueError on bad config
    eng.tokenizer, eng.model_config, eng.max_seq_len
    eng.validate(prompt_token_ids, params)                   # ValueError naming the problem (thread-safe)
    async for out in eng.generate(request_id, prompt_token_ids, params):
        out.new_token_ids, out.new_text, out.new_logprobs, out.new_top_logprobs,
        out.prompt_logprobs (first output), out.finished, out.finish_reason,
        out.num_prompt_tokens, out.num_cached_tokens, out.num_output_tokens
    eng.abort(request_id)        # thread-safe; generate's iterator then ends without more outputs
    eng.stats()                  # Engine.stats() of the last step + latency summary
    eng.pop_latency_observations()   # {"ttft": [...], "itl": [...]} seconds since the last call
    eng.shutdown()

`generate` validates before queuing, so a bad request raises ValueError at once. Cancelling
the task iterating it (a client disconnect) or closing the iterator aborts the request and
frees its pages. request_id must be unique among unfinished requests (ValueError otherwise).
Every output of a request comes in order; the last has finished=True.

Threads: only the engine thread touches the Engine, hence the model and the KV pool. Callers
hand it work through a lock-protected inbox; it hands outputs back with
`loop.call_soon_threadsafe` on the caller's own event loop. If a step raises, the error is
raised to every open stream and to later generate calls: the engine is not used again.
"""

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator

import torch

from mlaserve.engine.config import EngineConfig
from mlaserve.engine.engine import Engine
from mlaserve.engine.request import RequestOutput
from mlaserve.engine.sampling_params import SamplingParams

MAX_KEPT_OBSERVATIONS = 100_000


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float                 # time.perf_counter() at generate()
    last_token: float | None = None


class AsyncEngine:
    def __init__(self, config: EngineConfig, model=None, tokenizer=None):
        self.engine = Engine(config, model=model, tokenizer=tokenizer)
        self.config = config
        self.tokenizer = self.engine.tokenizer
        self.model_config = self.engine.model_config
        self.max_seq_len = self.engine.max_seq_len
        self._cond = threading.Condition()
        self._adds: list[tuple[str, list[int], SamplingParams]] = []
        self._aborts: list[str] = []
        self._streams: dict[str, _Stream] = {}
        self._shutdown = False
        self._error: BaseException | None = None
        self._stats = self.engine.stats()
        self._ttft: deque[float] = deque(maxlen=MAX_KEPT_OBSERVATIONS)
        self._itl: deque[float] = deque(maxlen=MAX_KEPT_OBSERVATIONS)
        self._ttft_count = self._itl_count = 0
        self._ttft_sum = self._itl_sum = 0.0
        self._thread = threading.Thread(target=self._run, name="mlaserve-engine", daemon=True)
        self._thread.start()

    # -- caller side (any thread / event loop) --
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate(prompt_token_ids, params)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        params = SamplingParams() if params is None else params
        self.engine.validate(prompt_token_ids, params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), time.perf_counter())
        with self._cond:
            self._raise_if_dead()
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._adds.append((request_id, list(prompt_token_ids), params))
            self._cond.notify()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True          # the engine dropped the request already
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._cond:
            self._streams.pop(request_id, None)
            queued = len(self._adds)
            # a request still waiting to be added never reaches the engine; otherwise the engine aborts it
            self._adds = [add for add in self._adds if add[0] != request_id]
            if len(self._adds) == queued:
                self._aborts.append(request_id)
            self._cond.notify()

    def stats(self) -> dict:
        with self._cond:
            s = dict(self._stats)
            s.update(ttft_count=self._ttft_count, ttft_mean_s=self._ttft_sum / max(self._ttft_count, 1),
                     itl_count=self._itl_count, itl_mean_s=self._itl_sum / max(self._itl_count, 1),
                     open_streams=len(self._streams), alive=self._error is None and not self._shutdown)
        return s

    def pop_latency_observations(self) -> dict[str, list[float]]:
        """TTFT and inter-token latencies (seconds) observed since the last call (for histograms)."""
        with self._cond:
            out = {"ttft": list(self._ttft), "itl": list(self._itl)}
            self._ttft.clear()
            self._itl.clear()
        return out

    def shutdown(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._shutdown = True
            self._cond.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"the engine thread did not stop within {timeout} s")
        self.engine.shutdown()      # tensor-parallel workers, if any

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise RuntimeError("the engine loop failed; see the chained error") from self._error
        if self._shutdown:
            raise RuntimeError("the engine is shut down")

    # -- engine thread --
    def _run(self) -> None:
        try:
            device = self.config.torch_device
            if device.type == "cuda" and device.index is not None:
                torch.cuda.set_device(device)   # per thread: kernels launch on the current device
            while True:
                with self._cond:
                    while not (self._shutdown or self._adds or self._aborts or self.engine.has_unfinished()):
                        self._cond.wait()
                    if self._shutdown:
                        break
                    adds, self._adds = self._adds, []
                    aborts, self._aborts = self._aborts, []
                for rid in aborts:
                    self.engine.abort(rid)
                for rid, ids, params in adds:
                    try:
                        self.engine.add_request(rid, ids, params)
                    except ValueError as e:     # validated already; a race on the id, say: tell the caller
                        self._deliver_error(rid, e)
                outputs = self.engine.step()
                now = time.perf_counter()
                with self._cond:
                    self._stats = self.engine.stats()
                    for out in outputs:
                        self._deliver(out, now)
        except BaseException as e:
            with self._cond:
                self._error = e
                streams, self._streams = self._streams, {}
            for stream in streams.values():
                self._put(stream, RuntimeError(f"the engine loop failed: {e!r}"))
            raise
        with self._cond:
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            self._put(stream, RuntimeError("the engine was shut down"))

    def _deliver(self, out: RequestOutput, now: float) -> None:
        """Called with the lock held."""
        stream = self._streams.get(out.request_id)
        if stream is None:
            return                          # aborted by its caller meanwhile
        if out.new_token_ids:
            if stream.last_token is None:
                self._observe_ttft(now - stream.arrival)
            else:
                gap = (now - stream.last_token) / len(out.new_token_ids)
                for _ in out.new_token_ids:
                    self._observe_itl(gap)
            stream.last_token = now
        if out.finished:
            del self._streams[out.request_id]
        self._put(stream, out)

    def _deliver_error(self, request_id: str, error: BaseException) -> None:
        with self._cond:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._put(stream, error)

    def _put(self, stream: _Stream, item) -> None:
        if stream.loop.is_closed():
            return                          # the caller's event loop is gone, and its request with it
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _observe_ttft(self, s: float) -> None:
        self._ttft.append(s)
        self._ttft_count += 1
        self._ttft_sum += s

    def _observe_itl(self, s: float) -> None:
        self._itl.append(s)
        self._itl_count += 1
        self._itl_sum += s
