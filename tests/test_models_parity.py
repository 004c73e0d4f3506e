"""mlaserve's models against transformers' own, for every architecture: prompt log-probs and greedy decoding.

Prompts of different lengths run in one batch over a paged cache whose pages are smaller than
the prompts; decoding runs all requests together in DECODE steps. DSA models use index_topk
smaller than the prompts, so that the indexer's selection decides the results.
"""

import pytest
import torch

from model_factory import ARCHS, cached_checkpoint, hf_greedy, hf_prompt_logprobs, load_hf, random_prompts, rel_err
from model_harness import PagedRunner, set_moe_dense_max_pairs
from mlaserve.models import load_model

LENGTHS = [23, 9, 37]
PAGE_SIZE = 8
NEW_TOKENS = 16


@pytest.fixture(scope="module", params=list(ARCHS))
def models(request):
    path = cached_checkpoint(request.param)
    model = load_model(path)
    # prefills (T >= 9) through the expert loop, decode steps (T = 3) through the dense-over-experts form
    set_moe_dense_max_pairs(model, 3 * model.config.n_routed_experts)
    return request.param, model, load_hf(path)


def test_prompt_logprobs_match_transformers(models):
    arch, model, hf = models
    prompts = random_prompts(LENGTHS, model.config.vocab_size, seed=11)
    if model.config.is_dsa:
        assert max(LENGTHS) > 2 * model.config.index_topk   # sparsity must really select
    runner = PagedRunner(model, page_size=PAGE_SIZE)
    rids = [runner.add(p) for p in prompts]
    for prompt, logits in zip(prompts, runner.prefill(rids)):
        ref = hf_prompt_logprobs(hf, prompt)
        err = rel_err(torch.log_softmax(logits, dim=-1), ref)
        assert err < 1e-4, f"{arch}: prompt of {len(prompt)} tokens, relative log-prob error {err:.2e}"


def test_greedy_decode_matches_generate(models):
    arch, model, hf = models
    prompts = random_prompts(LENGTHS, model.config.vocab_size, seed=12)
    runner = PagedRunner(model, page_size=PAGE_SIZE, seed=3)
    tokens, logits = runner.greedy([runner.add(p) for p in prompts], NEW_TOKENS)
    for i, prompt in enumerate(prompts):
        ref_tokens, ref_logits = hf_greedy(hf, prompt, NEW_TOKENS)
        assert tokens[i] == ref_tokens, f"{arch}: prompt {i} continues {tokens[i]}, transformers {ref_tokens}"
        err = rel_err(logits[i], ref_logits)
        assert err < 1e-4, f"{arch}: prompt {i}, relative decode-logit error {err:.2e}"
    # continuations stuck on one token would decide little
    assert len({t for seq in tokens for t in seq}) >= 8, tokens
