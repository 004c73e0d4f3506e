"""Drives an mlaserve model the way the engine does: paged KV pool, BatchLayout, ForwardBatch, torch backend.

    runner = PagedRunner(model, page_size=8)            # backend="triton" etc. through the registry
    rids = [runner.add(p) for p in prompts]
    logits = runner.prefill(rids)                   # one EXTEND step for all: list of float32 [len, vocab]
    logits = runner.prefill(rids, chunk=5)          # chunked prefill: several EXTEND steps
    tokens, step_logits = runner.greedy(rids, 16)   # DECODE steps

Pages come from the pool's allocator in a shuffled order, so that block tables are not contiguous,
and every cache slot starts as NaN (0xFF bytes, NaN in every field, for an FP8 cache), so that a
read of a slot the model never wrote shows up in the results.
"""

import random
from dataclasses import dataclass, field

import torch

from mlaserve.attention import registry
from mlaserve.attention.batch import BatchLayout, ForwardBatch
from mlaserve.attention.torch_backend import TorchBackend
from mlaserve.engine.kv_pool import KVPool


def set_moe_dense_max_pairs(model, pairs: int) -> None:
    """Where the MoE layers switch from the dense-over-experts form to the expert loop (tokens x experts)."""
    for layer in model.model.layers:
        if hasattr(layer.mlp, "dense_max_pairs"):
            layer.mlp.dense_max_pairs = pairs


@dataclass
class Sequence:
    tokens: list[int]
    num_cached: int = 0
    pages: list[int] = field(default_factory=list)


class PagedRunner:
    def __init__(self, model, page_size: int = 8, num_pages: int = 64, kv_cache_dtype: str = "auto",
                 extend_form: str = "mha", seed: int = 0, pool_cls: type = KVPool, backend: str = "torch"):
        self.model = model
        config = model.backend_config(kv_cache_dtype, model.device, page_size=page_size)
        if backend == "torch":
            self.dense = TorchBackend(config, extend_form=extend_form)
        else:
            self.dense = registry.create(backend, config)
        self.sparse = self.dense if model.config.is_dsa else None
        self.pool = pool_cls(**model.kv_pool_spec(), num_pages=num_pages, page_size=page_size, dtype=model.dtype,
                           device=model.device, kv_cache_dtype=kv_cache_dtype)
        for layer in range(model.config.num_layers):
            kv = self.pool.kv(layer)
            kv.fill_(255) if kv.dtype == torch.uint8 else kv.fill_(float("nan"))
            if model.config.is_dsa:
                self.pool.index_k(layer).fill_(float("nan"))
        self._free = self.pool.allocator.allocate(num_pages - 1)
        random.Random(seed).shuffle(self._free)
        self.seqs: list[Sequence] = []

    def add(self, prompt: list[int]) -> int:
        self.seqs.append(Sequence(list(prompt)))
        return len(self.seqs) - 1

    def _reserve(self, seq: Sequence, length: int) -> None:
        while len(seq.pages) * self.pool.page_size < length:
            seq.pages.append(self._free.pop())

    @torch.no_grad()
    def step(self, rids: list[int], counts: list[int]) -> list[torch.Tensor]:
        """Runs the next counts[i] uncached tokens of each request rids[i] in one model step.

        Returns each request's float32 logits [counts[i], vocab] for those tokens.
        """
        seqs = [self.seqs[r] for r in rids]
        for seq, n in zip(seqs, counts):
            if seq.num_cached + n > len(seq.tokens):
                raise ValueError(f"asked for {n} tokens past {seq.num_cached} of {len(seq.tokens)}")
            self._reserve(seq, seq.num_cached + n)
        device = self.model.device
        layout = BatchLayout.build([s.num_cached for s in seqs], counts, [s.pages for s in seqs],
                                   self.pool.page_size, device)
        ids = torch.tensor([t for s, n in zip(seqs, counts) for t in s.tokens[s.num_cached:s.num_cached + n]],
                           dtype=torch.int64, device=device)
        fb = ForwardBatch(input_ids=ids, layout=layout, kv_cache=self.pool, dense=self.dense, sparse=self.sparse,
                          dense_meta=self.dense.plan(layout),
                          sparse_meta=self.sparse.plan(layout) if self.sparse is not None else None)
        logits = self.model.compute_logits(self.model.forward(fb))
        for seq, n in zip(seqs, counts):
            seq.num_cached += n
        return list(logits.split(counts))

    def prefill(self, rids: list[int], chunk: int | None = None) -> list[torch.Tensor]:
        """Caches every request's uncached tokens, `chunk` tokens per request per step (None: one step).

        Returns each request's logits float32 [uncached tokens, vocab].
        """
        out: list[list[torch.Tensor]] = [[] for _ in rids]
        while True:
            todo = [(i, len(self.seqs[r].tokens) - self.seqs[r].num_cached) for i, r in enumerate(rids)]
            todo = [(i, left if chunk is None else min(chunk, left)) for i, left in todo if left > 0]
            if not todo:
                return [torch.cat(parts) for parts in out]
            logits = self.step([rids[i] for i, _ in todo], [n for _, n in todo])
            for (i, _), lg in zip(todo, logits):
                out[i].append(lg)

    def greedy(self, rids: list[int], steps: int) -> tuple[list[list[int]], torch.Tensor]:
        """Prefills, then decodes `steps` greedy tokens per request, all requests in each DECODE step.

        Returns (new tokens per request, logits float32 [b, steps, vocab] that chose them).
        """
        last = [lg[-1] for lg in self.prefill(rids)]
        new: list[list[int]] = [[] for _ in rids]
        chosen: list[list[torch.Tensor]] = [[] for _ in rids]
        for step in range(steps):
            for i, r in enumerate(rids):
                token = int(last[i].argmax())
                new[i].append(token)
                chosen[i].append(last[i])
                self.seqs[r].tokens.append(token)
            if step + 1 < steps:
                last = [lg[0] for lg in self.step(rids, [1] * len(rids))]
        return new, torch.stack([torch.stack(c) for c in chosen])
