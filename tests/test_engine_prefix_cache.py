"""Prefix cache: sharing full pages, refcounts, LRU eviction, hit reporting, no leaks."""

import random

import pytest

from engine_fake import fake_greedy, make_engine, run_to_end
from mlaserve.engine.kv_pool import PageAllocator
from mlaserve.engine.prefix_cache import ROOT, PrefixCache
from mlaserve.engine.sampling_params import SamplingParams

GREEDY = dict(temperature=0, ignore_eos=True)


def chain_insert(cache, alloc, tokens, ps):
    """Allocate and cache the full pages of `tokens` as a request would; returns its pages."""
    pages = alloc.allocate(len(tokens) // ps)
    parent = ROOT
    for i, p in enumerate(pages):
        parent = cache.insert(parent, tokens[i * ps:(i + 1) * ps], p)
    return pages


def test_match_insert_release_and_lru_eviction():
    ps = 2
    alloc = PageAllocator(20)
    cache = PrefixCache(alloc, ps)
    a = chain_insert(cache, alloc, [1, 2, 3, 4, 5, 6], ps)        # 3 pages
    assert [alloc.refcount(p) for p in a] == [2, 2, 2]            # request + cache
    assert cache.match([1, 2, 3, 4, 9, 9], 10) == (a[:2], cache.match([1, 2, 3, 4], 2)[1])
    assert cache.match([1, 2, 3, 4, 5, 6, 7], 2)[0] == a[:2]        # max_pages caps it
    assert cache.match([2, 1, 3, 4], 10)[0] == []                   # same page, other prefix: no hit
    assert cache.match([3, 4], 10)[0] == []                         # page 2 needs page 1 before it
    cache.release(a)
    assert cache.num_evictable == 3 and [alloc.refcount(p) for p in a] == [1, 1, 1]

    b = chain_insert(cache, alloc, [7, 8, 9, 9], ps)                 # released after a: newer
    cache.release(b)
    free_before = alloc.num_free
    # a's chain goes first, deepest page first
    assert cache.evict(1) == 1
    assert cache.match([1, 2, 3, 4, 5, 6], 10)[0] == a[:2]
    assert alloc.refcount(a[2]) == 0 and alloc.num_free == free_before + 1
    # a hit takes its pages out of the LRU list until they are released again
    hit, _ = cache.match([1, 2, 3, 4], 10)
    cache.acquire(hit)
    assert cache.num_evictable_in(hit) == 0 and cache.num_evictable == 2
    assert cache.evict(5) == 2                                       # only b's pages can go
    assert cache.match([7, 8], 10)[0] == [] and cache.match([1, 2, 3, 4], 10)[0] == hit
    cache.release(hit)
    cache.clear()
    assert alloc.num_free == 19 and cache.num_cached == 0


def test_duplicate_prefix_keeps_the_first_page():
    alloc = PageAllocator(10)
    cache = PrefixCache(alloc, 2)
    a = chain_insert(cache, alloc, [1, 2, 3, 4], 2)
    b = chain_insert(cache, alloc, [1, 2, 3, 4, 5, 6], 2)           # computed concurrently
    assert cache.match([1, 2, 3, 4, 5, 6], 10)[0] == a + [b[2]]     # b's third page continues a's chain
    assert alloc.refcount(b[0]) == 1                                 # b's duplicates stay private
    cache.release(b)
    assert alloc.refcount(b[0]) == 0 and alloc.refcount(b[2]) == 1
    cache.release(a)
    cache.clear()
    assert alloc.num_free == 9


def test_engine_prefix_hit_same_output_shared_pages_and_stats():
    rng = random.Random(7)
    ps = 4
    system = [rng.randrange(1, 101) for _ in range(21)]              # 5 full pages + 1 token
    tails = [[rng.randrange(1, 101) for _ in range(rng.randint(1, 6))] for _ in range(3)]
    engine, model = make_engine(page_size=ps, num_pages=100)
    engine.add_request("first", system + tails[0], SamplingParams(max_tokens=5, **GREEDY))
    first = run_to_end(engine)["first"]
    assert first["num_cached_tokens"] == 0
    computed = model.num_forward_tokens

    engine.add_request("b", system + tails[1], SamplingParams(max_tokens=40, **GREEDY))
    engine.add_request("c", system + tails[2], SamplingParams(max_tokens=40, **GREEDY))
    first_tokens = {o.request_id: o.new_token_ids for o in engine.step()}
    shared = engine._requests["b"].pages[:5]
    assert engine._requests["c"].pages[:5] == shared
    assert all(engine.kv_pool.allocator.refcount(p) == 3 for p in shared)   # b, c and the cache
    res = run_to_end(engine)
    for rid, tail in (("b", tails[1]), ("c", tails[2])):
        assert first_tokens[rid] + res[rid]["token_ids"] == fake_greedy(system + tail, 40, eos=None)
        assert res[rid]["num_cached_tokens"] == 20
    # only the uncached tokens were computed
    assert model.num_forward_tokens - computed == sum(len(system) + len(t) - 20 for t in tails[1:]) + 2 * 39
    stats = engine.stats()
    total_prompt = sum(len(system) + len(t) for t in tails)
    assert stats["prefix_cache_hit_tokens"] == 40
    assert stats["prefix_cache_hit_rate"] == pytest.approx(40 / total_prompt)
    assert engine.leaked_pages() == [] and engine.num_free_pages() == 99
    assert stats["pages_cached"] > 0 and stats["pages_used"] == 0


def test_full_prompt_hit_still_computes_the_last_token():
    engine, model = make_engine(page_size=4, num_pages=50)
    prompt = list(range(1, 13))                                        # exactly 3 pages
    engine.add_request("a", prompt, SamplingParams(max_tokens=3, **GREEDY))
    run_to_end(engine)
    before = model.num_forward_tokens
    engine.add_request("b", prompt, SamplingParams(max_tokens=3, **GREEDY))
    res = run_to_end(engine)["b"]
    assert res["token_ids"] == fake_greedy(prompt, 3, eos=None)
    assert res["num_cached_tokens"] == 8                              # the last page is recomputed
    assert model.num_forward_tokens - before == 4 + 2


def test_cached_pages_are_evicted_when_allocation_needs_room():
    rng = random.Random(8)
    ps = 4
    engine, model = make_engine(page_size=ps, num_pages=13)            # 12 usable pages
    old = [rng.randrange(1, 101) for _ in range(16)]
    engine.add_request("old", old, SamplingParams(max_tokens=4, **GREEDY))
    run_to_end(engine)
    assert engine.stats()["pages_cached"] == 4                         # 19 tokens computed: 4 full pages
    fresh = [[rng.randrange(1, 101) for _ in range(15)] for _ in range(3)]
    for i, p in enumerate(fresh):
        engine.add_request(str(i), p, SamplingParams(max_tokens=10, **GREEDY))
    res = run_to_end(engine)
    for i, p in enumerate(fresh):
        assert res[str(i)]["token_ids"] == fake_greedy(p, 10, eos=None)
    assert engine.kv.cache.match(old, 10)[0] == []                     # evicted for the newcomers
    assert engine.leaked_pages() == [] and engine.num_free_pages() == 12


def test_preempted_request_reuses_its_own_cached_pages():
    rng = random.Random(9)
    prompts = [[rng.randrange(1, 101) for _ in range(9)] for _ in range(3)]
    engine, model = make_engine(page_size=4, num_pages=14)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=20, **GREEDY))
    res = run_to_end(engine)
    assert engine.stats()["num_preemptions"] > 0
    for i, p in enumerate(prompts):
        assert res[str(i)]["token_ids"] == fake_greedy(p, 20, eos=None)
        assert res[str(i)]["num_cached_tokens"] == 0      # reported for the first admission only
    # recompute after preemption was served partly from the cache: fewer tokens than a full redo
    engine2, model2 = make_engine(page_size=4, num_pages=14, enable_prefix_caching=False)
    for i, p in enumerate(prompts):
        engine2.add_request(str(i), p, SamplingParams(max_tokens=20, **GREEDY))
    run_to_end(engine2)
    assert engine2.stats()["num_preemptions"] > 0
    assert model.num_forward_tokens < model2.num_forward_tokens
    assert engine.leaked_pages() == [] and engine2.leaked_pages() == []
