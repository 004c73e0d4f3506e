"""DeepSeek mixture of experts: the router (`gate`), the routed experts and the shared experts.

Routing, as transformers' DeepSeek-V2/V3 routers compute it (float32 throughout):
- "noaux_tc" (V3, Kimi K2, V3.2, GLM-5): sigmoid scores; experts are chosen by score +
  e_score_correction_bias, within the `topk_group` groups whose top-2 biased scores sum highest;
  the weights are the unbiased scores of the chosen experts, normalized if `norm_topk_prob`,
  times `routed_scaling_factor`.
- "greedy" / "group_limited_greedy" (V2): softmax scores; top-k overall, or within the groups with
  the highest maximum score; times `routed_scaling_factor`.
The experts run as a plain loop over the experts that received tokens.
"""

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve.models.config import ModelConfig
from mlaserve.models.layers import MLP


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


class MoE(nn.Module):
    """Routed experts plus shared experts. x [T, hidden] -> [T, hidden]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate = Router(config)
        self.experts = nn.ModuleList(MLP(config.hidden_size, config.moe_intermediate_size)
                                     for _ in range(config.n_routed_experts))
        self.shared_experts = (MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
                               if config.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)                                  # [T, k] each
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
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
