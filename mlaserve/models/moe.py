"""DeepSeek mixture of experts: the router (`gate`), the routed experts and the shared experts.

Routing, as transformers' DeepSeek-V2/V3 routers compute it (float32 throughout):
- "noaux_tc" (V3, Kimi K2, V3.2, GLM-5): sigmoid scores; experts are chosen by score +
  e_score_correction_bias, within the `topk_group` groups whose top-2 biased scores sum highest;
  the weights are the unbiased scores of the chosen experts, normalized if `norm_topk_prob`,
  times `routed_scaling_factor`.
- "greedy" / "group_limited_greedy" (V2): softmax scores; top-k overall, or within the groups with
  the highest maximum score; times `routed_scaling_factor`.
The experts run one of two ways, equal up to summation order:
- a loop over the experts that received tokens (any batch; one host sync per layer for the counts);
- every expert on every token, weighted by the routing (zero for unchosen experts), as two batched
  matmuls over the stacked weights: no host sync and few launches, so decode steps stay cheap on a
  GPU; used while tokens x experts <= `dense_max_pairs`, where the wasted FLOPs (experts / top_k
  times the routed ones) cost less than a launch-bound loop, and always inside a CUDA-graph capture.
After loading, `prepare_weights` stacks the experts' weights into gate_up [E, 2I, hidden] and
down [E, hidden, I] and turns each expert's parameters into views of them (memory does not grow).
"""

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve.models.config import ModelConfig
from mlaserve.models.layers import MLP
from mlaserve.models.parallel import SINGLE, ParallelConfig


class Router(nn.Module):
    """x [T, hidden] -> (weights float32 [T, top_k], expert ids int64 [T, top_k])."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size, dtype=torch.float32))
        if config.topk_method == "noaux_tc":
            self.register_buffer("e_score_correction_bias",
                                 torch.zeros(config.n_routed_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """group_scores [T, n_group] -> bool [T, n_experts]: experts of the `topk_group` best groups."""
        cfg = self.config
        best = group_scores.topk(cfg.topk_group, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return mask.repeat_interleave(cfg.n_routed_experts // cfg.n_group, dim=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        logits = F.linear(x.float(), self.weight.float())            # [T, E]
        per_group = (logits.shape[0], cfg.n_group, cfg.n_routed_experts // cfg.n_group)
        if cfg.scoring_func == "sigmoid":
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias.float()
            group_scores = choice.view(per_group).topk(2, dim=-1).values.sum(dim=-1)
            choice = choice.masked_fill(~self._group_mask(group_scores), float("-inf"))
            ids = choice.topk(cfg.num_experts_per_tok, dim=-1).indices
            weights = scores.gather(1, ids)
            if cfg.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            scores = logits.softmax(dim=-1)
            if cfg.topk_method == "group_limited_greedy":
                group_scores = scores.view(per_group).amax(dim=-1)
                scores = scores.masked_fill(~self._group_mask(group_scores), 0.0)
            weights, ids = scores.topk(cfg.num_experts_per_tok, dim=-1)
        return weights * cfg.routed_scaling_factor, ids


# Largest tokens x routed experts for which the dense-over-experts form runs (module docstring).
DENSE_MAX_PAIRS = 8192


class MoE(nn.Module):
    """Routed experts plus shared experts. x [T, hidden] -> [T, hidden].

    Under tensor parallelism every expert (shared ones included) holds this rank's slice of its
    intermediate dim; the router is replicated, and one all-reduce sums the partial outputs.
    """

    def __init__(self, config: ModelConfig, parallel: ParallelConfig = SINGLE):
        super().__init__()
        self.parallel = parallel
        inter = parallel.shard(config.moe_intermediate_size, "moe_intermediate_size")
        self.dense_max_pairs = DENSE_MAX_PAIRS
        self.gate_up: torch.Tensor | None = None   # [E, 2I, hidden], after prepare_weights
        self.down: torch.Tensor | None = None      # [E, hidden, I]
        self.gate = Router(config)
        self.experts = nn.ModuleList(MLP(config.hidden_size, inter)
                                     for _ in range(config.n_routed_experts))
        # V2's shared experts are its dense MLP class, with mlp_bias; routed experts never have biases
        self.shared_experts = (MLP(config.hidden_size, inter * config.n_shared_experts,
                                   bias=config.mlp_bias) if config.n_shared_experts else None)

    def prepare_weights(self) -> None:
        """Stacks the experts' weights; each expert's parameters become views into the stacks."""
        inter = self.experts[0].gate_proj.weight.shape[0]
        with torch.no_grad():
            self.gate_up = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in self.experts])
            self.down = torch.stack([e.down_proj.weight for e in self.experts])
        for i, e in enumerate(self.experts):
            e.gate_proj.weight = nn.Parameter(self.gate_up[i, :inter], requires_grad=False)
            e.up_proj.weight = nn.Parameter(self.gate_up[i, inter:], requires_grad=False)
            e.down_proj.weight = nn.Parameter(self.down[i], requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)                                  # [T, k] each
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()   # the loop's host sync can't be
        if self.gate_up is not None and (capturing or x.shape[0] * len(self.experts) <= self.dense_max_pairs):
            out = self._dense(x, weights, ids)
        else:
            out = self._loop(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.parallel.all_reduce(out)

    def _dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every expert on every token. x [T, hidden]; weights float32 / ids int64 [T, k] -> [T, hidden]."""
        inter = self.down.shape[-1]
        route = torch.zeros(x.shape[0], len(self.experts), dtype=torch.float32, device=x.device)
        route.scatter_(1, ids, weights)                              # [T, E]: 0 for unchosen experts
        h = torch.matmul(x, self.gate_up.transpose(1, 2))           # [E, T, 2I]
        y = torch.matmul(F.silu(h[..., :inter]) * h[..., inter:], self.down.transpose(1, 2))   # [E, T, hidden]
        return torch.einsum("eth,te->th", y.float(), route).to(x.dtype)

    def _loop(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The experts that received tokens, one after another. Same contract as `_dense`."""
        top_k = ids.shape[1]
        flat = ids.flatten()
        order = flat.argsort(stable=True)                            # (token, choice) pairs grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, n in zip(self.experts, counts):
            if n:
                pairs = order[start:start + n]
                tokens = pairs // top_k
                y = expert(x[tokens]) * weights.flatten()[pairs, None]
                out.index_add_(0, tokens, y.to(x.dtype))
                start += n
        return out
