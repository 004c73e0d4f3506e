"""Continuous batching: which requests run in the next step, and with how many tokens.

Requests join at every step and leave as soon as they finish. A request in `running`
holds pages for all its tokens from admission on (so prefill chunks never wait for pages);
only decoding grows it, a page at a time.

Each step is EXTEND (prompt chunks: at most `chunked_prefill_size` tokens in all) or DECODE
(every decoding request brings its one pending token). When both kinds of work exist the
steps alternate, so a long prompt prefilled over several chunks never stalls running decodes.

Admission is FIFO (no overtaking, so nothing starves) and takes a waiting request when
`max_running_requests` allows and the available pages (free + evictable cached) cover its
tokens plus one page of headroom per running request. When a decode step finds no page for a
request, the most recently admitted request is preempted: its pages are released (its full
pages stay in the prefix cache while room allows) and it goes back to the front of the queue
with its generated tokens, to be re-prefilled (recompute). Never dropped.
"""

from collections import deque
from dataclasses import dataclass

from mlaserve.attention.batch import ForwardMode
from mlaserve.engine.kv_manager import KVManager
from mlaserve.engine.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    """One step: per request, tokens [prefix_len, prefix_len + extend_len) of its `tokens` are computed."""
    mode: ForwardMode
    requests: list[Request]
    prefix_lens: list[int]
    extend_lens: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)


class Scheduler:
    def __init__(self, kv: KVManager, max_running_requests: int, chunked_prefill_size: int | None):
        self.kv = kv
        self.max_running_requests = max_running_requests
        self.chunked_prefill_size = chunked_prefill_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []       # in admission order
        self._last_mode: ForwardMode | None = None
        self.num_preemptions = 0

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Take `req` out (finished or aborted) and release its pages at once."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self.kv.release(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)

    def schedule(self) -> ScheduledBatch | None:
        """The next step, or None when there is nothing to run."""
        has_prefill = bool(self.waiting) or any(r.num_pending > 1 for r in self.running)
        has_decode = any(r.num_pending == 1 for r in self.running)
        batch = None
        if has_prefill and (not has_decode or self._last_mode is not ForwardMode.EXTEND):
            batch = self._schedule_extend()
        if batch is None and has_decode:
            batch = self._schedule_decode()
        if batch is None and has_prefill:
            batch = self._schedule_extend()     # the decodes were all preempted
        if batch is None and self.has_unfinished():
            raise RuntimeError(f"scheduler stalled: {len(self.waiting)} waiting, {len(self.running)} running, "
                               f"{self.kv.num_available} pages available")
        if batch is not None:
            self._last_mode = batch.mode
        return batch

    def _schedule_extend(self) -> ScheduledBatch | None:
        budget = self.chunked_prefill_size or float("inf")
        reqs, prefix_lens, extend_lens = [], [], []

        def take(r: Request):
            nonlocal budget
            n = int(min(r.num_pending, budget))
            reqs.append(r)
            prefix_lens.append(r.num_computed)
            extend_lens.append(n)
            budget -= n

        for r in self.running:
            if budget <= 0:
                break
            if r.num_pending > 1:
                take(r)
        while self.waiting and budget > 0 and len(self.running) < self.max_running_requests:
            r = self.waiting[0]
            if not self._try_admit(r):
                break
            take(r)
        if not reqs:
            return None
        return ScheduledBatch(ForwardMode.EXTEND, reqs, prefix_lens, extend_lens)

    def _try_admit(self, r: Request) -> bool:
        first = r.num_cached_tokens is None
        use_cache = not r.wants_prompt_logprobs    # cached positions would have no logits
        plan, cost = self.kv.plan_admission(r, use_cache)
        # One page of headroom per running request, so that admitting does not force a preemption
        # at the very next decode step.
        if cost + len(self.running) > self.kv.num_available:
            return False
        self.waiting.popleft()
        self.kv.admit(r, plan)
        r.status = RequestStatus.RUNNING
        self.running.append(r)
        if r.wants_prompt_logprobs:
            r.prompt_logprobs = [None]          # recomputed whole if a preemption interrupted it
        if first:
            r.num_cached_tokens = r.num_computed
            if self.kv.cache is not None:
                self.kv.cache.lookup_tokens += r.prompt_len
                self.kv.cache.hit_tokens += r.num_computed
        return True

    def _schedule_decode(self) -> ScheduledBatch | None:
        reqs = []
        for r in [r for r in self.running if r.num_pending == 1]:
            if r.status is not RequestStatus.RUNNING:
                continue                        # preempted below, while making room for an older one
            while not self.kv.can_grow(r, len(r.tokens)):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is r:
                    break
            if r.status is RequestStatus.RUNNING:
                self.kv.grow(r, len(r.tokens))
                reqs.append(r)
        if not reqs:
            return None
        return ScheduledBatch(ForwardMode.DECODE, reqs, [r.num_computed for r in reqs], [1] * len(reqs))

    def _preempt(self, r: Request) -> None:
        self.running.remove(r)
        self.kv.release(r)
        r.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(r)              # victims go newest first, so the oldest ends in front
