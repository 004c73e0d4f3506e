"""Sampler: top-k/top-p masks, sampling distribution, seeds, bans, logprobs; SamplingParams checks."""

import math

import pytest
import torch

from mlaserve.engine.sampler import Sampler, SampleRow, apply_top_k_top_p
from mlaserve.engine.sampling_params import SamplingParams


def kept_reference(row: list[float], k: int, p: float) -> set[int]:
    """Tokens top-k then top-p keep, in float64 python."""
    order = sorted(range(len(row)), key=lambda i: -row[i])[:k]
    z = [math.exp(row[i] - row[order[0]]) for i in order]
    total = sum(z)
    kept, mass = set(), 0.0
    for i, zi in zip(order, z):
        if mass >= p and p < 1:
            break
        kept.add(i)
        mass += zi / total
    return kept


def test_top_k_top_p_mask_matches_reference():
    g = torch.Generator().manual_seed(0)
    n, vocab = 64, 50
    logits = torch.randn(n, vocab, generator=g) * 3
    top_k = torch.randint(1, vocab + 1, (n,), generator=g)
    top_k[::4] = vocab                              # off
    top_p = torch.rand(n, generator=g).clamp_min(0.05)
    top_p[1::5] = 1.0                               # off
    masked = apply_top_k_top_p(logits, top_k, top_p)
    for i in range(n):
        kept = set(torch.nonzero(torch.isfinite(masked[i]))[:, 0].tolist())
        assert kept == kept_reference(logits[i].tolist(), int(top_k[i]), float(top_p[i])), i
        assert torch.equal(masked[i][list(kept)], logits[i][list(kept)])


def test_sampling_distribution_follows_temperature_top_k_top_p():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    params = SamplingParams(temperature=0.7, top_k=6, top_p=0.9)
    kept = kept_reference((logits / 0.7).tolist(), 6, 0.9)
    z = {i: math.exp(float(logits[i]) / 0.7) for i in kept}
    expected = {i: z[i] / sum(z.values()) for i in kept}
    n = 20000
    sampler = Sampler("cpu", seed=123)
    tokens = sampler(logits.expand(n, -1).clone(), [SampleRow(params)] * n).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=8).tolist()
    for i in range(8):
        if i not in kept:
            assert counts[i] == 0, (i, counts)
        else:
            sd = math.sqrt(n * expected[i] * (1 - expected[i]))
            assert abs(counts[i] - n * expected[i]) < 5 * sd, (i, counts[i], n * expected[i])


def test_seeded_requests_do_not_depend_on_the_batch():
    vocab = 40
    g = torch.Generator().manual_seed(1)
    steps = [torch.randn(4, vocab, generator=g) for _ in range(25)]
    params = SamplingParams(temperature=1.0, seed=7)

    def alone(seed):
        gen = torch.Generator().manual_seed(seed)
        sampler = Sampler("cpu", seed=0)
        return [sampler(logits[0:1].clone(), [SampleRow(params, gen)]).token_ids[0] for logits in steps]

    # the same request as row 2, behind an unseeded and a greedy request, beside another seeded one
    gen, other_gen = torch.Generator().manual_seed(7), torch.Generator().manual_seed(3)
    sampler = Sampler("cpu", seed=99)
    batched = []
    for logits in steps:
        shifted = torch.cat([logits[1:3], logits[0:1], logits[3:]])
        rows = [SampleRow(SamplingParams(temperature=1.0)), SampleRow(SamplingParams(temperature=0)),
                SampleRow(params, gen), SampleRow(SamplingParams(temperature=0.5, seed=3), other_gen)]
        batched.append(sampler(shifted, rows).token_ids[2])
    assert alone(7) == batched
    assert alone(8) != batched


def test_greedy_bans_and_logprobs_are_raw():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 30, generator=g)
    top = logits.argmax(-1)
    rows = [SampleRow(SamplingParams(temperature=0, logprobs=4)),
            SampleRow(SamplingParams(temperature=0, logprobs=True), banned_token_ids=[int(top[1])]),
            SampleRow(SamplingParams(temperature=2.0, top_k=1))]
    res = Sampler("cpu")(logits.clone(), rows)
    assert res.token_ids[0] == int(top[0])
    second = logits[1].clone()
    second[top[1]] = -float("inf")
    assert res.token_ids[1] == int(second.argmax())                 # the ban moved the choice
    assert res.token_ids[2] == int(top[2])                           # top_k=1 is greedy
    ref = torch.log_softmax(logits.double(), -1)
    assert res.logprobs[0] == pytest.approx(ref[0, top[0]].item(), abs=1e-6)
    # the banned request's logprob is still the raw model's (before the ban)
    assert res.logprobs[1] == pytest.approx(ref[1, res.token_ids[1]].item(), abs=1e-6)
    assert res.logprobs[2] is None and res.top_logprobs[2] is None
    assert list(res.top_logprobs[0]) == ref[0].topk(4).indices.tolist()
    assert list(res.top_logprobs[0].values()) == pytest.approx(ref[0].topk(4).values.tolist(), abs=1e-6)
    assert res.top_logprobs[1] == {}


@pytest.mark.parametrize("kwargs,name", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"), (dict(top_k=1.5), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(stop=[1]), "stop"), (dict(stop=""), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(seed="x"), "seed"), (dict(logprobs=-1), "logprobs"),
    (dict(ignore_eos="yes"), "ignore_eos"),
])
def test_sampling_params_reject_bad_values(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_sampling_params_normalize():
    p = SamplingParams(stop="###", logprobs=True)
    assert p.stop_strings == ["###"] and p.logprobs == 0
    assert SamplingParams(logprobs=False).logprobs is None
    assert SamplingParams(temperature=0).greedy and not SamplingParams(top_k=0).top_k_enabled


def test_tiny_temperature_is_greedy_not_nan():
    # logits / 1e-39 overflow float32 to inf; the softmax of that is NaN and argmax of NaN was token 0
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(9))
    for t in (1e-39, 1e-7):
        assert SamplingParams(temperature=t).greedy
    assert not SamplingParams(temperature=1e-3).greedy
    rows = [SampleRow(SamplingParams(temperature=1e-39)) for _ in range(3)]
    assert Sampler("cpu")(logits.clone(), rows).token_ids == logits.argmax(-1).tolist()
