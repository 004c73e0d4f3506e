"""A request's state inside the engine, and what a step reports about it (RequestOutput)."""

from dataclasses import dataclass, field
from enum import Enum

import torch

from mlaserve.engine.detokenizer import IncrementalDetokenizer
from mlaserve.engine.sampling_params import SamplingParams


class RequestStatus(Enum):
    WAITING = "waiting"      # queued (new, or preempted and waiting to recompute); holds no pages
    RUNNING = "running"      # admitted: holds pages for its tokens, prefilling or decoding
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What one step reports for one request. Text and tokens are deltas since the last output.

    new_logprobs[i] is the logprob of new_token_ids[i]; new_top_logprobs[i] maps the most likely
    token ids to their logprobs, most likely first (empty lists when logprobs were not asked).
    prompt_logprobs (first output only, when asked): one entry per prompt token, the first None.
    """
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None          # "stop" | "length" | "abort" once finished
    num_prompt_tokens: int
    num_cached_tokens: int             # prompt tokens served by the prefix cache
    num_output_tokens: int             # all tokens generated so far
    new_logprobs: list[float] = field(default_factory=list)
    new_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    stop_reason: int | str | None = None   # the stop token id or stop string that finished it


class Request:
    """One sequence: prompt + generated tokens, its pages, and where its KV computation stands.

    tokens = prompt + output. num_computed counts the leading tokens whose KV is in the cache;
    the tokens after it are pending (the last generated token is always pending until the next
    decode step). pages cover at least num_computed tokens (all of them after admission).
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 detokenizer: IncrementalDetokenizer | None, generator: torch.Generator | None):
        self.request_id = request_id
        self.prompt_len = len(prompt_token_ids)
        self.tokens: list[int] = list(prompt_token_ids)
        self.params = params
        self.detokenizer = detokenizer
        self.generator = generator              # only for requests with a seed
        self.status = RequestStatus.WAITING
        self.num_computed = 0
        self.pages: list[int] = []
        self.cache_nodes: list[int] = []        # prefix-cache node ids of its leading full pages
        self.num_cached_tokens: int | None = None   # set at first admission
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] = []
        self.prompt_logprobs: list[float | None] | None = None
        self.prompt_logprobs_reported = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # what the next RequestOutput reports
        self.pending_token_ids: list[int] = []
        self.pending_text: list[str] = []
        self.pending_logprobs: list[float] = []
        self.pending_top_logprobs: list[dict[int, float]] = []

    @property
    def num_output_tokens(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def num_pending(self) -> int:
        return len(self.tokens) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Still needs logits at prompt positions: asked, and not yet all computed."""
        return self.params.prompt_logprobs and (
            self.prompt_logprobs is None or len(self.prompt_logprobs) < self.prompt_len)

    def take_output(self) -> RequestOutput:
        """The delta since the last output, and reset it."""
        out = RequestOutput(
            request_id=self.request_id, new_token_ids=self.pending_token_ids, new_text="".join(self.pending_text),
            finished=self.is_finished, finish_reason=self.finish_reason, num_prompt_tokens=self.prompt_len,
            num_cached_tokens=self.num_cached_tokens or 0, num_output_tokens=self.num_output_tokens,
            new_logprobs=self.pending_logprobs, new_top_logprobs=self.pending_top_logprobs,
            stop_reason=self.stop_reason)
        if self.params.prompt_logprobs and not self.prompt_logprobs_reported and not self.wants_prompt_logprobs:
            out.prompt_logprobs = list(self.prompt_logprobs)
            self.prompt_logprobs_reported = True
        self.pending_token_ids, self.pending_text = [], []
        self.pending_logprobs, self.pending_top_logprobs = [], []
        return out
