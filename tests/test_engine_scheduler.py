"""Continuous batching, chunked prefill, admission, preemption and stop conditions (fake model)."""

import random

import pytest

from engine_fake import fake_greedy, make_engine, next_token, run_to_end
from mlaserve.engine.sampling_params import SamplingParams

GREEDY = dict(temperature=0, ignore_eos=True)


def random_prompts(rng, n, lo, hi, vocab=101):
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_batch_equals_each_alone_with_late_joiners():
    rng = random.Random(1)
    prompts = random_prompts(rng, 8, 1, 23)
    engine, model = make_engine(page_size=4, num_pages=200, chunked_prefill_size=16)
    results, added = {}, 0

    def add_some(n):
        nonlocal added
        for _ in range(n):
            engine.add_request(str(added), prompts[added], SamplingParams(max_tokens=10 + added, **GREEDY))
            added += 1

    add_some(3)
    while engine.has_unfinished():
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
        if added < len(prompts):
            add_some(1)                       # new requests join while others decode
    for i, p in enumerate(prompts):
        assert results[str(i)] == fake_greedy(p, 10 + i, eos=None), i
    assert engine.leaked_pages() == []
    assert engine.num_free_pages() == engine.kv.capacity_pages


def test_chunked_prefill_respects_budget_and_interleaves_decodes():
    rng = random.Random(2)
    engine, model = make_engine(page_size=4, num_pages=100, chunked_prefill_size=8)
    short = random_prompts(rng, 2, 3, 4)
    long_prompt = random_prompts(rng, 1, 60, 60)[0]
    for i, p in enumerate(short):
        engine.add_request(f"s{i}", p, SamplingParams(max_tokens=30, **GREEDY))
    first = {o.request_id: o.new_token_ids for o in engine.step()}   # the short prompts prefill
    engine.add_request("long", long_prompt, SamplingParams(max_tokens=5, **GREEDY))
    long_req = engine._requests["long"]
    progress = []                                  # (step mode, tokens of the long prompt computed)
    res = run_to_end(engine, on_step=lambda e: progress.append((model.steps[-1][0], long_req.num_computed)))
    assert res["long"]["token_ids"] == fake_greedy(long_prompt, 5, eos=None)
    for i, p in enumerate(short):
        assert first[f"s{i}"] + res[f"s{i}"]["token_ids"] == fake_greedy(p, 30, eos=None)
    assert all(sum(lens) <= 8 for mode, _, lens in model.steps if mode == "extend")
    # the 60-token prompt took 8 chunks, and a decode step ran between every two of them
    chunks = [k for k, (mode, done) in enumerate(progress) if mode == "extend"]
    assert len(chunks) >= 8
    for a, b in zip(chunks, chunks[1:]):
        assert any(progress[k][0] == "decode" for k in range(a + 1, b)), progress


def test_chunked_equals_unchunked_and_counts_forward_tokens():
    rng = random.Random(3)
    prompts = random_prompts(rng, 5, 10, 40)
    outs = []
    for chunk in (None, 7, 1):
        engine, model = make_engine(page_size=8, num_pages=100, chunked_prefill_size=chunk, enable_prefix_caching=False)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=6, **GREEDY))
        res = run_to_end(engine)
        outs.append([res[str(i)]["token_ids"] for i in range(len(prompts))])
        # every prompt token computed exactly once, plus one token per decode step
        assert model.num_forward_tokens == sum(len(p) for p in prompts) + 5 * len(prompts)
    assert outs[0] == outs[1] == outs[2]


def test_max_running_requests_is_respected():
    rng = random.Random(4)
    engine, _ = make_engine(num_pages=200, max_running_requests=3)
    for i, p in enumerate(random_prompts(rng, 7, 2, 9)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=4, **GREEDY))
    peak = []
    run_to_end(engine, on_step=lambda e: peak.append(e.stats()["running"]))
    assert max(peak) == 3


def test_preemption_requeues_and_recomputes_without_changing_outputs():
    rng = random.Random(5)
    prompts = random_prompts(rng, 6, 3, 12)
    # 16 usable pages of 4 tokens; each request grows to up to 12 + 24 tokens = 9 pages
    for prefix in (True, False):
        engine, model = make_engine(page_size=4, num_pages=17, enable_prefix_caching=prefix)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=24, **GREEDY))
        used = []
        res = run_to_end(engine, on_step=lambda e: used.append(e.stats()["pages_used"]))
        assert engine.stats()["num_preemptions"] > 0
        assert max(used) <= 16
        for i, p in enumerate(prompts):
            assert res[str(i)]["token_ids"] == fake_greedy(p, 24, eos=None)
            assert res[str(i)]["finish_reason"] == "length"
        assert engine.leaked_pages() == []
        assert engine.num_free_pages() == 16


def test_single_request_as_large_as_the_pool():
    engine, _ = make_engine(page_size=4, num_pages=5)          # 16 tokens of room
    prompt = [5, 6, 7, 8, 9, 10]
    engine.add_request("a", prompt, SamplingParams(max_tokens=100, **GREEDY))
    res = run_to_end(engine)["a"]
    assert res["finish_reason"] == "length"
    assert res["token_ids"] == fake_greedy(prompt, 10, eos=None)   # stops at 16 tokens in all
    with pytest.raises(ValueError, match="KV pool"):
        engine.add_request("b", list(range(1, 17)), SamplingParams())
    assert engine.leaked_pages() == []


def test_reject_prompts_that_cannot_fit_the_context():
    engine, _ = make_engine(page_size=4, num_pages=100, context_length=20, max_position_embeddings=64)
    with pytest.raises(ValueError, match="context length 20"):
        engine.add_request("a", list(range(1, 21)), SamplingParams())
    with pytest.raises(ValueError, match="token ids must be ints"):
        engine.add_request("b", [1, 2, 101], SamplingParams())
    with pytest.raises(ValueError, match="non-empty"):
        engine.add_request("c", [], SamplingParams())
    with pytest.raises(ValueError, match="max_position_embeddings"):
        make_engine(context_length=100, max_position_embeddings=64)
    engine.add_request("d", list(range(1, 19)), SamplingParams(max_tokens=10, **GREEDY))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("d", [1], SamplingParams())
    res = run_to_end(engine)["d"]
    assert len(res["token_ids"]) == 2 and res["finish_reason"] == "length"


def test_abort_frees_pages_at_once():
    engine, _ = make_engine(page_size=4, num_pages=40)
    engine.add_request("a", list(range(1, 30)), SamplingParams(max_tokens=50, **GREEDY))
    engine.add_request("b", list(range(2, 9)), SamplingParams(max_tokens=50, **GREEDY))
    engine.add_request("w", list(range(3, 9)), SamplingParams(max_tokens=50, **GREEDY))
    engine.step()
    engine.step()
    held = engine.stats()["pages_used"]
    assert held > 0
    assert engine.abort("a") and engine.abort("w")
    assert not engine.abort("a") and not engine.abort("nope")
    assert engine.stats()["pages_used"] < held
    outs = engine.step()
    aborted = {o.request_id: o for o in outs if o.finish_reason == "abort"}
    assert set(aborted) == {"a", "w"} and all(o.finished for o in aborted.values())
    engine.abort("b")
    run_to_end(engine)
    assert engine.leaked_pages() == [] and engine.num_free_pages() == 39


def test_stop_conditions():
    engine, _ = make_engine()
    prompt = [3, 1, 4, 1, 5]
    expected = fake_greedy(prompt, 40, eos=None)
    stop_tok = expected[6]
    first = expected.index(stop_tok)
    engine.add_request("stop_id", prompt, SamplingParams(max_tokens=40, stop_token_ids=[stop_tok], **GREEDY))
    engine.add_request("max", prompt, SamplingParams(max_tokens=3, **GREEDY))
    engine.add_request("min", prompt, SamplingParams(max_tokens=40, min_tokens=first + 2, temperature=0,
                                                     ignore_eos=True, stop_token_ids=[stop_tok]))
    res = run_to_end(engine)
    assert res["stop_id"]["token_ids"] == expected[:first + 1]
    assert res["stop_id"]["finish_reason"] == "stop" and res["stop_id"]["stop_reason"] == stop_tok
    assert res["max"]["token_ids"] == expected[:3] and res["max"]["finish_reason"] == "length"
    # min_tokens bans the stop token while too few tokens exist: the output diverges there
    assert len(res["min"]["token_ids"]) >= first + 2
    assert res["min"]["token_ids"][first] != stop_tok


def test_eos_stops_unless_ignored():
    # find a prompt whose greedy continuation reaches EOS (token 0) within 60 tokens
    rng = random.Random(6)
    while True:
        prompt = random_prompts(rng, 1, 3, 8)[0]
        cont = fake_greedy(prompt, 60, eos=0)
        if cont[-1] == 0 and len(cont) > 1:
            break
    engine, _ = make_engine()
    engine.add_request("eos", prompt, SamplingParams(max_tokens=60, temperature=0))
    engine.add_request("ign", prompt, SamplingParams(max_tokens=len(cont) + 3, temperature=0, ignore_eos=True))
    res = run_to_end(engine)
    assert res["eos"]["token_ids"] == cont and res["eos"]["finish_reason"] == "stop"
    assert res["ign"]["token_ids"][:len(cont)] == cont and len(res["ign"]["token_ids"]) == len(cont) + 3


def test_prompt_logprobs_across_chunks_and_logprobs():
    import torch
    engine, model = make_engine(page_size=4, num_pages=60, chunked_prefill_size=5)
    prompt = [7, 3, 9, 12, 44, 2, 8, 19, 23, 5, 61, 17, 4]
    engine.add_request("a", list(prompt), SamplingParams(max_tokens=4, logprobs=3, prompt_logprobs=True, **GREEDY))
    engine.add_request("b", list(prompt), SamplingParams(max_tokens=4, **GREEDY))   # shares the prefix
    res = run_to_end(engine)
    a = res["a"]

    def logprobs_after(ctx):
        lp = torch.log_softmax(model.compute_logits(torch.tensor([[float(next_token(ctx, 101))]])), -1)[0]
        return lp

    expected_prompt = [None] + [logprobs_after(prompt[:j])[prompt[j]].item() for j in range(1, len(prompt))]
    assert a["prompt_logprobs"][0] is None
    assert a["prompt_logprobs"][1:] == pytest.approx(expected_prompt[1:], abs=1e-5)
    seq = list(prompt)
    for k, tok in enumerate(a["token_ids"]):
        lp = logprobs_after(seq)
        assert a["logprobs"][k] == pytest.approx(lp[tok].item(), abs=1e-5)
        top = a["top_logprobs"][k]
        assert list(top) == lp.topk(3).indices.tolist()
        assert list(top.values()) == pytest.approx(lp.topk(3).values.tolist(), abs=1e-5)
        seq.append(tok)
    assert res["b"]["token_ids"] == a["token_ids"] and res["b"]["prompt_logprobs"] is None
    assert res["b"]["logprobs"] == []


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_with_aborts_keeps_outputs_and_pages_consistent(seed):
    """Random arrivals, shared prefixes, aborts, a small pool: finished requests are exact,
    every page's refcount matches its holders after every step, nothing leaks."""
    rng = random.Random(100 + seed)
    ps = rng.choice([2, 4, 8])
    engine, _ = make_engine(page_size=ps, num_pages=rng.randint(48, 80) // ps + 1,   # <= 41 tokens each
                            chunked_prefill_size=rng.choice([None, 5, 16]), max_running_requests=rng.randint(2, 8))
    stems = random_prompts(rng, 3, 4, 20)
    expected, results, aborted, n = {}, {}, set(), 0
    for step in range(400):
        if n < 40 and rng.random() < 0.5:
            prompt = rng.choice(stems)[:rng.randint(1, 20)] + random_prompts(rng, 1, 0, 6)[0]
            max_tokens = rng.randint(1, 15)
            engine.add_request(str(n), prompt, SamplingParams(max_tokens=max_tokens, **GREEDY))
            expected[str(n)] = fake_greedy(prompt, max_tokens, eos=None)
            n += 1
        if rng.random() < 0.05 and engine._requests:
            rid = rng.choice(sorted(engine._requests))
            engine.abort(rid)
            aborted.add(rid)
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
        holders = {}
        for r in engine._requests.values():
            for p in r.pages:
                holders[p] = holders.get(p, 0) + 1
        alloc, cache = engine.kv_pool.allocator, engine.kv.cache
        for p in range(1, alloc.num_pages):
            assert alloc.refcount(p) == holders.get(p, 0) + cache.holds(p), (step, p)
        if n >= 40 and not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    for rid, toks in expected.items():
        if rid not in aborted:
            assert results[rid] == toks, rid
    assert engine.leaked_pages() == []
    assert engine.num_free_pages() == engine.kv.capacity_pages
