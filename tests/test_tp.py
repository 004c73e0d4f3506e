"""Tensor parallelism with two gloo ranks on the CPU (marker `tp`: these tests spawn worker processes).

tp_size 2 gives the tokens and logprobs of tp_size 1 on tiny V3 and V3.2 (DSA) models, through
chunked prefill, batched decode and prefix-cache hits; indivisible shapes are refused before any
process starts; a dead worker makes rank 0 raise; the server runs with `--tp 2` and leaves no
process behind.
"""

import dataclasses
import os
import signal
import time

import httpx
import pytest
import torch

from model_factory import cached_checkpoint, random_prompts
from mlaserve import LLM, SamplingParams
from mlaserve.models.config import ModelConfig
from mlaserve.models.deepseek import DeepseekForCausalLM
from mlaserve.models.parallel import ParallelConfig
from server_harness import start_server
from test_llm import VOCAB, checkpoint

pytestmark = pytest.mark.tp


def make_llm(path, **kwargs):
    kw = dict(device="cpu", dtype="float32", attention_backend="torch", page_size=8, num_pages=64,
              chunked_prefill_size=16)
    kw.update(kwargs)
    return LLM(path, **kw)


def _gone(pid: int) -> bool:
    """True once `pid` no longer runs (absent, or a zombie awaiting its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if not _gone(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


@pytest.mark.parametrize("arch", ["v3", "v32"])
def test_two_ranks_equal_one(arch):
    path = checkpoint(arch)
    system = random_prompts([20], VOCAB, seed=11)[0]
    prompts = [system + t for t in random_prompts([3, 9, 1], VOCAB, seed=12)] + random_prompts([27], VOCAB, seed=13)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    # prompt logprobs bypass the prefix cache, so they get requests of their own
    prompt_params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=True)

    def run(llm):
        # the first prompt alone, then the rest: the later ones hit the prefix cache
        outs = llm.generate(prompt_token_ids=prompts[:1], sampling_params=params)
        outs += llm.generate(prompt_token_ids=prompts[1:], sampling_params=params)
        assert llm.engine.stats()["prefix_cache_hit_tokens"] > 0
        return outs, llm.generate(prompt_token_ids=prompts, sampling_params=prompt_params)

    ref, ref_prompt = run(make_llm(path))
    with make_llm(path, tp_size=2) as llm:
        workers = llm.engine.tp_workers.procs
        assert [p.is_alive() for p in workers] == [True]
        outs, outs_prompt = run(llm)
        assert llm.engine.leaked_pages() == []
    for a, b in zip(ref, outs):
        assert b.token_ids == a.token_ids
        assert torch.allclose(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)
    for a, b in zip(ref_prompt, outs_prompt):
        assert a.prompt_logprobs[0] is None and b.prompt_logprobs[0] is None
        assert torch.allclose(torch.tensor(b.prompt_logprobs[1:]), torch.tensor(a.prompt_logprobs[1:]),
                              atol=1e-4, rtol=0)
    assert [p.exitcode for p in workers] == [0]


def test_indivisible_shapes_are_refused_before_spawning():
    import multiprocessing
    path = cached_checkpoint("v3", seed=2, num_attention_heads=3, num_key_value_heads=3)
    with pytest.raises(ValueError, match="num_attention_heads = 3 is not divisible by tp_size 2"):
        make_llm(path, tp_size=2)
    with pytest.raises(ValueError, match="num_attention_heads = 4 is not divisible by tp_size 3"):
        make_llm(checkpoint("v3"), tp_size=3)
    assert multiprocessing.active_children() == []
    # the model itself refuses, too: MoE and dense intermediate sizes (heads divide here)
    config = ModelConfig.from_pretrained(checkpoint("v3"))
    parallel = ParallelConfig(1, 2, group=object())
    for field in ["moe_intermediate_size", "intermediate_size"]:
        with torch.device("meta"), pytest.raises(ValueError, match=f"{field} = 33 is not divisible by tp_size 2"):
            DeepseekForCausalLM(dataclasses.replace(config, **{field: 33}), parallel)


def test_failed_start_stops_the_workers():
    import multiprocessing
    # refused only after the workers are up and the KV pools are built
    with pytest.raises(ValueError, match="context_length 100000 exceeds"):
        make_llm(checkpoint("v3"), tp_size=2, context_length=100000)
    assert multiprocessing.active_children() == []


def test_dead_worker_makes_rank0_raise():
    llm = make_llm(checkpoint("v3"), tp_size=2)
    try:
        worker = llm.engine.tp_workers.procs[0]
        worker.kill()
        worker.join(10)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1 is not running"):
            llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=2))
        assert time.monotonic() - start < 10
    finally:
        llm.shutdown()


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError):
                continue      # exited while we listed
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def test_server_with_tp2_answers_and_leaves_no_process():
    server = start_server(["--tp", "2", "--device", "cpu", "--page-size", "16", "--max-total-tokens", "512",
                           "--log-level", "warning"])
    try:
        workers = _descendants(server.proc.pid)
        assert workers, "the server spawned no worker process"
        r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "prompt": "Two ranks", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
    finally:
        server.proc.send_signal(signal.SIGINT)
        code = server.proc.wait(timeout=30)
        log = server.log()
        server.stop()
    assert code == 0, log
    assert _wait_gone(workers) == [], "worker processes outlived the server"


def test_sglang_tp_flags():
    from mlaserve.server.args import parse_args
    for flag in ["--tp", "--tp-size", "--tensor-parallel-size"]:
        assert parse_args([flag, "2"]).engine_config("/m").tp_size == 2
    assert parse_args([]).engine_config("/m").tp_size == 1
    with pytest.raises(SystemExit):
        parse_args(["--tp", "0"])
