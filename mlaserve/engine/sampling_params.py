"""Per-request sampling and stopping parameters, validated at construction.

`n` (several completions per prompt) is not here: the server fans a request out into
n engine requests.
"""

from dataclasses import dataclass, field


GREEDY_BELOW = 1e-5   # temperatures under this sample as greedy


class SamplingParamError(ValueError):
    """A bad sampling parameter; `param` names it (the server reports it in the OpenAI error)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param

@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    temperature: 0 (or below 1e-5) = greedy (argmax); larger divides the logits before top-k / top-p.
    top_p: nucleus mass in (0, 1]; 1 = off.   top_k: -1 or 0 = off.
    max_tokens: most tokens to generate (None: until EOS or the context length).
    min_tokens: EOS and stop_token_ids are banned until this many tokens exist.
    stop: strings that end the request; the text is cut before the stop string.
    stop_token_ids: token ids that end the request (besides the model's EOS).
    ignore_eos: keep generating past the model's EOS tokens.
    seed: a private torch.Generator for this request, so its samples do not depend on
        what else is in the batch.
    logprobs: None = none; k >= 0 = the sampled token's logprob plus the k most likely
        tokens' (True means 0). Logprobs are log_softmax of the model's raw logits, before
        temperature, top-k/top-p and min_tokens bans: they score the token under the model,
        not under the sampling distribution.
    prompt_logprobs: each prompt token's logprob given the tokens before it (the first is None).
    skip_special_tokens: leave special tokens out of the detokenized text.
    """
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | bool | None = None
    prompt_logprobs: bool = False
    skip_special_tokens: bool = True
    stop_strings: list[str] = field(init=False, repr=False)   # `stop` normalized to a list

    def __post_init__(self):
        def bad(name, why):
            raise SamplingParamError(name, f"{name} {why}, got {getattr(self, name)!r}")

        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not self.temperature >= 0:
            bad("temperature", "must be a number >= 0")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad("top_k", "must be an int >= -1 (-1 or 0 turn it off)")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", "must be an int >= 1 or None")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", "must be an int >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.stop is None:
            stops = []
        elif isinstance(self.stop, str):
            stops = [self.stop]
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            stops = list(self.stop)
        else:
            bad("stop", "must be a string or a list of strings")
        if any(s == "" for s in stops):
            bad("stop", "must not contain an empty string")
        self.stop_strings = stops
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                    _is_int(t) and t >= 0 for t in self.stop_token_ids):
                bad("stop_token_ids", "must be a list of token ids >= 0")
            self.stop_token_ids = list(self.stop_token_ids)
        if self.seed is not None and not _is_int(self.seed):
            bad("seed", "must be an int or None")
        if self.logprobs is True:
            self.logprobs = 0
        elif self.logprobs is False:
            self.logprobs = None
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            bad("logprobs", "must be None, a bool, or an int >= 0 (the number of top logprobs)")
        for name in ("ignore_eos", "prompt_logprobs", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be a bool")

    @property
    def greedy(self) -> bool:
        # dividing float32 logits by a tinier temperature overflows to inf (softmax then gives NaN):
        # such a temperature means argmax anyway (vLLM draws the same line)
        return self.temperature < GREEDY_BELOW

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
