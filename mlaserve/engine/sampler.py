"""Next-token sampling for a batch: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

Sampling draws one Exp(1) noise per vocabulary entry and takes argmax(p / noise), which picks
token i with probability p_i (the "exponential race"). A request with a seed draws its noise
from its own torch.Generator, so its samples are the same whatever else is in the batch.

Logprobs are log_softmax of the raw logits, before temperature, top-k/top-p and min_tokens
bans (vLLM's default, and what accuracy checks compare across engines).
"""

from dataclasses import dataclass, field

import torch

from mlaserve.engine.sampling_params import SamplingParams


@dataclass
class SampleRow:
    """What sampling needs of one request."""
    params: SamplingParams
    generator: torch.Generator | None = None          # the request's own, when it has a seed
    banned_token_ids: list[int] = field(default_factory=list)   # e.g. EOS before min_tokens


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]                      # None where the request asked for none
    top_logprobs: list[dict[int, float] | None]       # most likely first


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k and top-p nucleus.

    logits float32 [n, V]; top_k int64 [n] in 1..V (V = off); top_p float32 [n] in (0, 1].
    Top-p keeps the most likely tokens until their mass (after top-k) reaches top_p; the most
    likely token is always kept. Returns a new [n, V] tensor.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # top_p == 1 must keep everything, whatever the rounding of the cumulative sum
    limit = torch.where(top_p >= 1, torch.full_like(top_p, float("inf")), top_p)
    sorted_logits = sorted_logits.masked_fill(mass_before >= limit[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


class Sampler:
    def __init__(self, device: torch.device | str, seed: int = 0):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)   # for unseeded requests

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
        """logits float32 [N, V], one row per SampleRow -> N sampled tokens with their logprobs."""
        n, vocab = logits.shape
        if n != len(rows):
            raise ValueError(f"{n} logit rows for {len(rows)} requests")
        logits = logits.float()
        logprobs = torch.log_softmax(logits, dim=-1) if any(r.params.logprobs is not None for r in rows) else None

        ban_r = [i for i, r in enumerate(rows) for _ in r.banned_token_ids]
        if ban_r:
            ban_c = [t for r in rows for t in r.banned_token_ids]
            logits = logits.clone()
            logits[torch.tensor(ban_r, device=logits.device), torch.tensor(ban_c, device=logits.device)] = float("-inf")

        tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if greedy:
            g = torch.tensor(greedy, device=logits.device)
            tokens[g] = logits[g].argmax(dim=-1)
        if sampled:
            s = torch.tensor(sampled, device=logits.device)
            tokens[s] = self._sample(logits[s], [rows[i] for i in sampled], vocab)

        token_list = tokens.tolist()
        out_lp: list[float | None] = [None] * n
        out_top: list[dict[int, float] | None] = [None] * n
        if logprobs is not None:
            chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
            k_max = max((r.params.logprobs or 0) for r in rows)
            top_v, top_i = logprobs.topk(k_max, dim=-1) if k_max else (None, None)
            top_v = top_v.tolist() if k_max else None
            top_i = top_i.tolist() if k_max else None
            for i, r in enumerate(rows):
                k = r.params.logprobs
                if k is None:
                    continue
                out_lp[i] = chosen[i]
                out_top[i] = {top_i[i][j]: top_v[i][j] for j in range(k)} if k else {}
        return SampleResult(token_list, out_lp, out_top)

    def _sample(self, logits: torch.Tensor, rows: list[SampleRow], vocab: int) -> torch.Tensor:
        """logits float32 [m, V] of non-greedy rows -> int64 [m] samples."""
        dev = logits.device
        temps = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32, device=dev)
        logits = logits / temps[:, None]
        if any(r.params.top_k_enabled or r.params.top_p < 1 for r in rows):
            top_k = torch.tensor([min(r.params.top_k, vocab) if r.params.top_k_enabled else vocab for r in rows],
                                 dtype=torch.int64, device=dev)
            top_p = torch.tensor([r.params.top_p for r in rows], dtype=torch.float32, device=dev)
            logits = apply_top_k_top_p(logits, top_k, top_p)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        shared = [j for j, r in enumerate(rows) if r.generator is None]
        if shared:
            noise[torch.tensor(shared, device=dev)] = torch.empty(
                len(shared), vocab, device=dev).exponential_(generator=self.generator)
        for j, r in enumerate(rows):
            if r.generator is not None:
                noise[j].exponential_(generator=r.generator)
        # a zero draw would turn a zero-probability (masked) token into 0/0
        return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
