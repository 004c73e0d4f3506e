"""A model over the FP8 latent cache (kv_cache_dtype="fp8_e4m3", 656-byte rows): exactly the model over a
float32 cache whose rows were rounded through the FP8 format, and close to the unrounded run.
The FP8 format is defined for kv_lora_rank 512 and rope 64."""

import pytest
import torch

from model_factory import cached_checkpoint, random_prompts, rel_err
from model_harness import PagedRunner
from mlaserve.engine.kv_pool import KVPool
from mlaserve.kernels import fp8_format
from mlaserve.models import load_model

FP8_DIMS = dict(kv_lora_rank=512, qk_rope_head_dim=64, num_hidden_layers=2)
# e4m3 rounds c_kv by up to 1/16 relative; the tiny test models' sharp logits (spanning ~20 nats) turn
# that into a measured worst log-prob shift of ~0.5 nats and a mean of ~0.06.
MAX_ABS_LOGPROB_SHIFT = 1.0


class RoundTripPool(KVPool):
    """A float cache holding each row as the FP8 format would return it."""

    def store_kv(self, layer, slots, ckv, kpe):
        rows = fp8_format.dequantize(fp8_format.quantize(torch.cat([ckv, kpe], dim=-1)), torch.float32)
        super().store_kv(layer, slots, rows[:, :self.kv_lora_rank], rows[:, self.kv_lora_rank:])


def _logprobs(model, prompts, **runner_kwargs) -> torch.Tensor:
    """Prefill, then 4 more tokens one DECODE step at a time over the cache the run wrote -> log-probs [N, vocab]."""
    runner = PagedRunner(model, page_size=16, **runner_kwargs)
    rids = [runner.add(p) for p in prompts]
    out = runner.prefill(rids)
    for rid, prompt in zip(rids, prompts):
        runner.seqs[rid].tokens += prompt[:4]
    out += runner.prefill(rids, chunk=1)
    return torch.log_softmax(torch.cat(out), dim=-1)


def _model(arch, **overrides):
    dsa = dict(index_head_dim=96) if arch == "v32" else {}
    return load_model(cached_checkpoint(arch, seed=6, **FP8_DIMS, **dsa, **overrides))


@pytest.mark.parametrize("arch", ["v3", "v32"])
def test_fp8_kv_cache_is_the_rounded_float_cache(arch):
    model = _model(arch)
    prompts = random_prompts([33, 12], model.config.vocab_size, seed=41)
    fp8 = _logprobs(model, prompts, kv_cache_dtype="fp8_e4m3")
    assert rel_err(fp8, _logprobs(model, prompts, pool_cls=RoundTripPool)) < 1e-4


# index_topk above the prompt lengths for V3.2 here: the indexer's choice is discrete, and FP8 noise in
# one layer's output would flip near-tied picks of the next layer's indexer; this measures the format.
@pytest.mark.parametrize("arch,overrides", [("v3", {}), ("v32", dict(index_topk=64))])
def test_fp8_kv_cache_stays_close_to_fp32_cache(arch, overrides):
    model = _model(arch, **overrides)
    prompts = random_prompts([33, 12], model.config.vocab_size, seed=41)
    fp8 = _logprobs(model, prompts, kv_cache_dtype="fp8_e4m3")
    fp32 = _logprobs(model, prompts)
    shift = (fp8 - fp32).abs().max().item()
    agree = (fp8.argmax(-1) == fp32.argmax(-1)).float().mean().item()
    print(f"{arch}: FP8 vs fp32 KV cache: max |Δ logprob| {shift:.4f}, mean {(fp8 - fp32).abs().mean():.4f}, "
          f"argmax agreement {agree:.3f}")
    assert 0 < shift < MAX_ABS_LOGPROB_SHIFT
    assert agree >= 0.9
