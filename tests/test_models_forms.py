"""The ways of computing one model step agree: absorbed vs MHA prefill, and prefill in one step vs in chunks
vs token by token (each chunk attending over the pages the previous chunks wrote)."""

import pytest
import torch

from model_factory import cached_checkpoint, random_prompts, rel_err
from model_harness import PagedRunner, set_moe_dense_max_pairs
from mlaserve.models import load_model
from mlaserve.models.moe import DENSE_MAX_PAIRS

LENGTHS = [21, 7, 30]


@pytest.fixture(scope="module")
def models():
    return {arch: load_model(cached_checkpoint(arch)) for arch in ("v3", "v2_lite", "v32", "glm5")}


def _prefill(model, prompts, chunk=None, extend_form="mha", page_size=8):
    runner = PagedRunner(model, page_size=page_size, extend_form=extend_form, seed=len(prompts) + (chunk or 0))
    return runner.prefill([runner.add(p) for p in prompts], chunk=chunk)


@pytest.mark.parametrize("arch", ["v3", "v2_lite"])
@pytest.mark.parametrize("chunk", [None, 8])
def test_absorbed_and_mha_prefill_agree(models, arch, chunk):
    model = models[arch]
    prompts = random_prompts(LENGTHS, model.config.vocab_size, seed=21)
    mha = _prefill(model, prompts, chunk, extend_form="mha")
    absorbed = _prefill(model, prompts, chunk, extend_form="absorbed")
    for a, b in zip(absorbed, mha):
        assert torch.isfinite(a).all()
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("arch", ["v3", "v32", "glm5"])
def test_chunked_and_token_by_token_prefill_agree(models, arch):
    model = models[arch]
    prompts = random_prompts(LENGTHS, model.config.vocab_size, seed=22)
    whole = _prefill(model, prompts)
    for chunk in (5, 1):   # chunk=1: every step is a DECODE step
        for a, b in zip(_prefill(model, prompts, chunk=chunk, page_size=4), whole):
            assert torch.isfinite(a).all()
            assert rel_err(a, b) < 1e-5, f"{arch}: chunk {chunk}"


def test_batch_composition_does_not_change_results(models):
    """A request's logits are the same alone and next to others of different lengths (DSA model)."""
    model = models["v32"]
    prompts = random_prompts(LENGTHS, model.config.vocab_size, seed=23)
    together = _prefill(model, prompts)
    for prompt, logits in zip(prompts, together):
        assert rel_err(_prefill(model, [prompt])[0], logits) < 1e-5


@pytest.mark.parametrize("arch", ["v3", "v2_lite"])
def test_moe_dense_and_loop_forms_agree(models, arch):
    model = models[arch]
    prompts = random_prompts(LENGTHS, model.config.vocab_size, seed=24)
    try:
        set_moe_dense_max_pairs(model, 0)
        loop = _prefill(model, prompts)
        set_moe_dense_max_pairs(model, 1 << 30)
        dense = _prefill(model, prompts)
    finally:
        set_moe_dense_max_pairs(model, DENSE_MAX_PAIRS)
    for a, b in zip(dense, loop):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("arch", ["v3", "glm5"])
def test_triton_backend_gives_the_torch_backend_results(models, arch):
    """The model over the Triton kernels (the CPU interpreter here, fp32): same greedy tokens and logits."""
    model = models[arch]
    prompts = random_prompts([13, 6], model.config.vocab_size, seed=25)
    results = {}
    for backend in ("torch", "triton"):
        runner = PagedRunner(model, page_size=4, backend=backend)
        results[backend] = runner.greedy([runner.add(p) for p in prompts], 4)
    assert results["triton"][0] == results["torch"][0]
    assert rel_err(results["triton"][1], results["torch"][1]) < 1e-5


@pytest.mark.parametrize("arch,extend_form", [("v3", "mha"), ("v3", "absorbed"), ("glm5", "mha")])
def test_mixed_extend_step_agrees_with_whole_prefill(models, arch, extend_form):
    """One EXTEND step holding a request's next single token, another's first chunk and a third's middle
    chunk (what a continuous-batching engine schedules) gives each token the logits of a whole prefill."""
    model = models[arch]
    prompts = random_prompts([18, 12, 15], model.config.vocab_size, seed=26)
    whole = _prefill(model, prompts)
    runner = PagedRunner(model, page_size=4, extend_form=extend_form, seed=5)
    a, b, c = (runner.add(p) for p in prompts)
    first_a = runner.step([a, c], [17, 5])
    mixed = runner.step([a, b, c], [1, 12, 4])       # a: one token after 17; b: all 12; c: tokens 5..8
    last_c = runner.step([c], [6])
    assert rel_err(torch.cat([first_a[0], mixed[0]]), whole[0]) < 1e-5
    assert rel_err(mixed[1], whole[1]) < 1e-5
    assert rel_err(torch.cat([first_a[1], mixed[2], last_c[0]]), whole[2]) < 1e-5
