"""AsyncEngine: concurrent streams, cancellation frees pages, validation, latency records, shutdown."""

import asyncio
import random
import time

import pytest

from engine_fake import FakeModel, fake_greedy
from mlaserve.engine.async_engine import AsyncEngine
from mlaserve.engine.config import EngineConfig
from mlaserve.engine.sampling_params import SamplingParams


class SlowFakeModel(FakeModel):
    """Steps take a few milliseconds, so that a test can act while requests are running."""

    def forward(self, fb):
        time.sleep(0.003)
        return super().forward(fb)


@pytest.fixture
def engine():
    eng = AsyncEngine(EngineConfig(device="cpu", attention_backend="torch", page_size=4, num_pages=40,
                                   chunked_prefill_size=16), model=SlowFakeModel())
    yield eng
    eng.shutdown()


async def collect(eng, rid, prompt, params):
    tokens, outs = [], []
    async for out in eng.generate(rid, prompt, params):
        tokens += out.new_token_ids
        outs.append(out)
    return tokens, outs


async def wait_idle(eng, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = eng.stats()
        if s["running"] == 0 and s["waiting"] == 0:
            return s
        await asyncio.sleep(0.005)
    raise AssertionError(f"engine not idle after {timeout} s: {eng.stats()}")


def test_concurrent_streams_equal_greedy_and_record_latencies(engine):
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 101) for _ in range(rng.randint(1, 20))] for _ in range(12)]

    async def main():
        return await asyncio.gather(*[
            collect(engine, f"r{i}", p, SamplingParams(temperature=0, ignore_eos=True, max_tokens=12))
            for i, p in enumerate(prompts)])

    results = asyncio.run(main())
    for p, (tokens, outs) in zip(prompts, results):
        assert tokens == fake_greedy(p, 12, eos=None)
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert not any(o.finished for o in outs[:-1])
    s = engine.stats()
    assert s["ttft_count"] == 12 and s["itl_count"] == 12 * 11
    obs = engine.pop_latency_observations()
    assert len(obs["ttft"]) == 12 and all(t > 0 for t in obs["ttft"])
    assert engine.pop_latency_observations() == {"ttft": [], "itl": []}
    assert s["pages_free"] == s["pages_total"] == 39


def test_cancelled_stream_aborts_and_frees_pages(engine):
    async def main():
        start = engine.stats()["pages_free"]
        got = []

        async def consume():
            async for out in engine.generate("long", list(range(1, 30)),
                                              SamplingParams(temperature=0, ignore_eos=True, max_tokens=None)):
                got.append(out)

        task = asyncio.create_task(consume())
        while len(got) < 3:
            await asyncio.sleep(0.002)
        assert engine.stats()["pages_free"] < start
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        s = await wait_idle(engine)
        assert s["pages_free"] == start and s["open_streams"] == 0

        # leaving an `async for` early and closing the iterator aborts too
        gen = engine.generate("brk", [5, 6, 7], SamplingParams(temperature=0, ignore_eos=True, max_tokens=None))
        async for _ in gen:
            break
        await gen.aclose()
        s = await wait_idle(engine)
        assert s["pages_free"] == start
        # the id is free again, and the engine still serves
        tokens, _ = await collect(engine, "long", [1, 2, 3], SamplingParams(temperature=0, ignore_eos=True,
                                                                             max_tokens=4))
        assert tokens == fake_greedy([1, 2, 3], 4, eos=None)

    asyncio.run(main())
    assert engine.engine.kv.leaked_pages() == []


def test_cancelled_before_the_engine_adds_it_never_runs(engine):
    async def main():
        start = engine.stats()["pages_free"]
        busy = asyncio.create_task(collect(engine, "busy", list(range(1, 20)),
                                           SamplingParams(temperature=0, ignore_eos=True, max_tokens=60)))
        while engine.stats()["running"] == 0:
            await asyncio.sleep(0.001)
        # queued while the engine thread is inside a step, cancelled before its next loop adds it
        victim = engine.generate("victim", [1, 2, 3], SamplingParams(temperature=0, ignore_eos=True, max_tokens=200))
        first = asyncio.ensure_future(victim.__anext__())
        await asyncio.sleep(0)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await victim.aclose()
        await busy
        s = await wait_idle(engine)
        assert s["pages_free"] == start and s["open_streams"] == 0
        return s

    s = asyncio.run(main())
    # only the busy request's tokens were generated: the victim never ran
    assert s["tokens_generated"] == 60


def test_validation_errors_raise_at_once(engine):
    async def main():
        with pytest.raises(ValueError, match="does not fit"):
            await collect(engine, "a", list(range(1, 100)) * 2, SamplingParams())
        with pytest.raises(ValueError, match="token ids"):
            await collect(engine, "b", [1, 2, 1000], SamplingParams())
        with pytest.raises(ValueError, match="params"):
            await collect(engine, "c", [1], {"max_tokens": 3})

    asyncio.run(main())
    assert engine.stats()["open_streams"] == 0


def test_shutdown_ends_open_streams_and_refuses_new_ones():
    eng = AsyncEngine(EngineConfig(device="cpu", attention_backend="torch", page_size=4, num_pages=40),
                      model=SlowFakeModel())

    async def main():
        got = []

        async def consume():
            async for out in eng.generate("x", [1, 2], SamplingParams(ignore_eos=True, max_tokens=None)):
                got.append(out)

        task = asyncio.create_task(consume())
        while not got:
            await asyncio.sleep(0.002)
        await asyncio.to_thread(eng.shutdown)
        with pytest.raises(RuntimeError, match="shut down"):
            await task
        with pytest.raises(RuntimeError, match="shut down"):
            await collect(eng, "y", [1], SamplingParams())

    asyncio.run(main())
    assert not eng.stats()["alive"]
