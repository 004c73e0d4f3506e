"""Tensor parallelism: which rank this model shard is, and the all-reduce that joins the shards.

    parallel = ParallelConfig(tp_rank=r, tp_size=n, group=pg)   # pg: a torch.distributed ProcessGroup
    model = DeepseekForCausalLM(config, parallel)               # or load_model(path, parallel=parallel)

How the DeepSeek-family model splits (as SGLang splits MLA models):
- MLA: the heads. q_proj / q_b_proj and kv_b_proj keep the rows of this rank's heads, o_proj the
  matching input columns; the partial o_proj outputs are summed across ranks. The latent path
  (q_a_proj, kv_a_proj_with_mqa, their norms) and hence the latent KV cache are replicated: every
  rank holds the whole cache.
- Dense MLP, each routed expert and the shared experts: the intermediate dim (gate/up rows, down
  columns), one all-reduce per MLP / MoE layer. The router is replicated, so every rank routes alike.
- Embeddings, lm_head and the DSA indexer are replicated (simplest; the indexer's top-k must agree
  on all ranks anyway, and computing it everywhere costs no communication).
A row-parallel layer's bias (o_proj, down_proj) is loaded on rank 0 only (zeros elsewhere), so that
the all-reduce adds it once.

No process-wide state: the group object is passed down explicitly. tp_size 1 makes no
torch.distributed call at all.
"""

import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParallelConfig:
    tp_rank: int = 0
    tp_size: int = 1
    group: object | None = None      # torch.distributed ProcessGroup; None only when tp_size == 1

    def __post_init__(self):
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp_size must be an int >= 1, got {self.tp_size!r}")
        if not (isinstance(self.tp_rank, int) and 0 <= self.tp_rank < self.tp_size):
            raise ValueError(f"tp_rank must be in [0, {self.tp_size}), got {self.tp_rank!r}")
        if self.tp_size > 1 and self.group is None:
            raise ValueError(f"tp_size {self.tp_size} needs a process group")

    def shard(self, size: int, what: str) -> int:
        """This rank's part of a dimension of `size` split evenly; ValueError naming `what` if it does not divide."""
        return shard_size(size, self.tp_size, what)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks, in place (a no-op at tp_size 1); returns x."""
        if self.tp_size > 1:
            self.group.allreduce([x]).wait()
        return x


SINGLE = ParallelConfig()


def shard_size(size: int, tp_size: int, what: str) -> int:
    if size % tp_size:
        raise ValueError(f"{what} = {size} is not divisible by tp_size {tp_size}")
    return size // tp_size


def check_divisible(config, tp_size: int) -> None:
    """ValueError naming the first model dimension (of a ModelConfig) that tp_size does not divide."""
    shard_size(config.num_heads, tp_size, "num_attention_heads")
    if "dense" in config.mlp_layer_types:
        shard_size(config.intermediate_size, tp_size, "intermediate_size")
    if "sparse" in config.mlp_layer_types:
        shard_size(config.moe_intermediate_size, tp_size, "moe_intermediate_size")


# Checkpoint tensors split across ranks (HF names): column-parallel layers keep this rank's rows
# (heads, or intermediate units), row-parallel ones this rank's input columns; everything else is replicated.
_ROWS = re.compile(r"self_attn\.(q_proj|q_b_proj|kv_b_proj)\.weight$|\.(gate_proj|up_proj)\.(weight|bias)$")
_COLUMNS = re.compile(r"self_attn\.o_proj\.weight$|\.down_proj\.weight$")
_ROW_PARALLEL_BIAS = re.compile(r"self_attn\.o_proj\.bias$|\.down_proj\.bias$")


def shard_tensor(name: str, tensor: torch.Tensor, parallel: ParallelConfig) -> torch.Tensor:
    """This rank's part of checkpoint tensor `name` (the whole tensor at tp_size 1 or when replicated).

    Rows/columns are split into tp_size equal contiguous blocks: q/kv_b rows are head-major, so a
    block is whole heads. A row-parallel bias is kept on rank 0 and zeroed elsewhere (added once).
    """
    if parallel.tp_size == 1:
        return tensor
    if _ROWS.search(name):
        return tensor.chunk(parallel.tp_size, dim=0)[parallel.tp_rank]
    if _COLUMNS.search(name):
        return tensor.chunk(parallel.tp_size, dim=1)[parallel.tp_rank]
    if _ROW_PARALLEL_BIAS.search(name) and parallel.tp_rank != 0:
        return torch.zeros_like(tensor)
    return tensor
