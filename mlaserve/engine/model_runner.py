"""One model step: ScheduledBatch -> BatchLayout -> backends' plans -> ForwardBatch -> logits.

Logits are computed only where they are used: the last token of each request whose step
reaches the end of its tokens (it samples), and the prompt positions of requests that asked
for prompt logprobs.
"""

from dataclasses import dataclass

import torch

from mlaserve.attention import registry
from mlaserve.attention.batch import BatchLayout, ForwardBatch, ForwardMode
from mlaserve.engine.kv_pool import KVPool
from mlaserve.engine.scheduler import ScheduledBatch


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
                 nsa_decode_backend: str, kv_cache_dtype: str, device: torch.device):
        self.model = model
        self.kv_pool = kv_pool
        self.device = device
        backend_config = model.backend_config(kv_cache_dtype, device)
        # registry.create raises ValueError naming why a backend cannot run here
        self.dense = registry.create(attention_backend, backend_config)
        self.sparse_prefill = self.sparse_decode = None
        if model.config.is_dsa:
            self.sparse_prefill = registry.create(nsa_prefill_backend, backend_config, dsa=True)
            self.sparse_decode = registry.create(nsa_decode_backend, backend_config, dsa=True)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepLogits:
        reqs = batch.requests
        layout = BatchLayout.build(batch.prefix_lens, batch.extend_lens, [r.pages for r in reqs],
                                   self.kv_pool.page_size, self.device, mode=batch.mode)
        sparse = self.sparse_decode if batch.mode is ForwardMode.DECODE else self.sparse_prefill
        input_ids = torch.tensor([t for r, p, e in zip(reqs, batch.prefix_lens, batch.extend_lens)
                                  for t in r.tokens[p:p + e]], dtype=torch.int64).to(self.device, non_blocking=True)
        fb = ForwardBatch(input_ids=input_ids, layout=layout, kv_cache=self.kv_pool, dense=self.dense,
                          sparse=sparse, dense_meta=self.dense.plan(layout),
                          sparse_meta=sparse.plan(layout) if sparse is not None else None)
        hidden = self.model.forward(fb)                                  # [T, hidden]

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
