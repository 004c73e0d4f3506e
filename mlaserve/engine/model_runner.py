"""One model step: ScheduledBatch -> BatchLayout -> backends' plans -> ForwardBatch -> logits.

Logits are computed only where they are used: the last token of each request whose step
reaches the end of its tokens (it samples), and the prompt positions of requests that asked
for prompt logprobs.

Under tensor parallelism (engine/tp.py) rank 0's runner first sends the step's `StepInput` (host
lists only) to the worker ranks, whose runners run the same `forward` on their model shards; only
rank 0 computes logits.
"""

from dataclasses import dataclass

import torch

from mlaserve.attention import registry
from mlaserve.attention.batch import BatchLayout, ForwardBatch, ForwardMode
from mlaserve.engine.kv_pool import KVPool
from mlaserve.engine.scheduler import ScheduledBatch


@dataclass
class StepInput:
    """What every rank needs to run one step's forward: BatchLayout.build's host lists and the new tokens.
    pages[i] are request i's KV pages; input_ids are the requests' new tokens, concatenated."""
    mode: ForwardMode
    prefix_lens: list[int]
    extend_lens: list[int]
    pages: list[list[int]]
    input_ids: list[int]

    @classmethod
    def from_batch(cls, batch: ScheduledBatch) -> "StepInput":
        reqs = batch.requests
        ids = [t for r, p, e in zip(reqs, batch.prefix_lens, batch.extend_lens) for t in r.tokens[p:p + e]]
        return cls(batch.mode, list(batch.prefix_lens), list(batch.extend_lens), [list(r.pages) for r in reqs], ids)


@dataclass
class StepLogits:
    """sample_logits float32 [S, vocab]: row k belongs to batch.requests[sample_rows[k]].
    prompt_logits: batch index -> (first prompt position, float32 [n, vocab]) for prompt logprobs,
    where row j holds the logits at prompt position first + j (they score token first + j + 1)."""
    sample_rows: list[int]
    sample_logits: torch.Tensor
    prompt_logits: dict[int, tuple[int, torch.Tensor]]


class ModelRunner:
    def __init__(self, model, kv_pool: KVPool, attention_backend: str, nsa_prefill_backend: str,
                 nsa_decode_backend: str, kv_cache_dtype: str, device: torch.device, tp_workers=None):
        """tp_workers: on rank 0 of a tensor-parallel engine, the `tp.TPWorkers` each step is sent to first."""
        self.model = model
        self.tp_workers = tp_workers
        self.kv_pool = kv_pool
        self.device = device
        backend_config = model.backend_config(kv_cache_dtype, device, page_size=kv_pool.page_size)
        # registry.create raises ValueError naming why a backend cannot run here
        self.dense = registry.create(attention_backend, backend_config)
        self.sparse_prefill = self.sparse_decode = None
        if model.config.is_dsa:
            self.sparse_prefill = registry.create(nsa_prefill_backend, backend_config, dsa=True)
            self.sparse_decode = registry.create(nsa_decode_backend, backend_config, dsa=True)

    @torch.inference_mode()
    def forward(self, step: StepInput) -> torch.Tensor:
        """The model over one step's tokens -> final hidden states [T, hidden] (every rank runs this)."""
        layout = BatchLayout.build(step.prefix_lens, step.extend_lens, step.pages,
                                   self.kv_pool.page_size, self.device, mode=step.mode)
        sparse = self.sparse_decode if step.mode is ForwardMode.DECODE else self.sparse_prefill
        input_ids = torch.tensor(step.input_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        fb = ForwardBatch(input_ids=input_ids, layout=layout, kv_cache=self.kv_pool, dense=self.dense,
                          sparse=sparse, dense_meta=self.dense.plan(layout),
                          sparse_meta=sparse.plan(layout) if sparse is not None else None)
        return self.model.forward(fb)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepLogits:
        reqs = batch.requests
        step = StepInput.from_batch(batch)
        if self.tp_workers is not None:
            self.tp_workers.send_step(step)
        hidden = self.forward(step)                                      # [T, hidden]

        sample_rows, sample_pos, prompt_spans = [], [], []
        start = 0
        for i, (r, p, e) in enumerate(zip(reqs, batch.prefix_lens, batch.extend_lens)):
            if p + e == len(r.tokens):
                sample_rows.append(i)
                sample_pos.append(start + e - 1)
            if r.wants_prompt_logprobs:
                # positions p .. min(p + e, prompt_len - 1) - 1 score prompt tokens p+1 ..
                n = min(p + e, r.prompt_len - 1) - p
                if n > 0:
                    prompt_spans.append((i, p, start, n))
            start += e
        sample_logits = self.model.compute_logits(hidden[sample_pos]) if sample_pos else \
            torch.empty(0, 0, device=self.device)
        prompt_logits = {i: (p, self.model.compute_logits(hidden[s:s + n])) for i, p, s, n in prompt_spans}
        return StepLogits(sample_rows, sample_logits, prompt_logits)
