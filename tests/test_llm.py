"""The offline LLM API on real tiny models (dense DeepSeek-V3 and DSA DeepSeek-V3.2), float32 on the CPU.

Batched generation with a pool too small for all prompts at once (preemption happens) equals
each prompt run alone, token for token; the prefix cache and chunked prefill change nothing;
logprobs match transformers; no page leaks.
"""

import os

import pytest
import torch

from model_factory import cached_checkpoint, hf_greedy, hf_prompt_logprobs, load_hf, random_prompts
from mlaserve import LLM, SamplingParams

VOCAB = 258          # 2 special tokens + 256 bytes: the test tokenizer below


def write_byte_tokenizer(path: str) -> None:
    """A byte-level BPE tokenizer without merges: <bos>=0, <eos>=1, then the 256 bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<bos>": 0, "<eos>": 1, **{ch: i + 2 for i, ch in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<bos>", "<eos>"])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>").save_pretrained(path)


def checkpoint(arch: str) -> str:
    path = cached_checkpoint(arch, seed=1, vocab_size=VOCAB)
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        write_byte_tokenizer(path)
    return path


@pytest.fixture(scope="module", params=["v3", "v32"])
def model_path(request):
    return checkpoint(request.param)


def make_llm(path, **kwargs):
    kw = dict(device="cpu", dtype="float32", attention_backend="torch", page_size=8, num_pages=200,
              chunked_prefill_size=None)
    kw.update(kwargs)
    return LLM(path, **kw)


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_batch_with_preemption_equals_each_prompt_alone(model_path):
    prompts = random_prompts([5, 23, 12, 31, 9, 17], VOCAB, seed=3)
    alone_llm = make_llm(model_path, enable_prefix_caching=False)
    alone = [alone_llm.generate(prompt_token_ids=[p], sampling_params=greedy(14))[0].token_ids for p in prompts]
    # 12 usable pages of 8 tokens (96 tokens) for 97 prompt + 84 generated tokens
    llm = make_llm(model_path, num_pages=13, chunked_prefill_size=16)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy(14))
    assert [o.token_ids for o in outs] == alone
    assert all(o.finish_reason == "length" for o in outs)
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0
    assert llm.engine.leaked_pages() == [] and llm.engine.num_free_pages() == 12
    # and the engine's greedy continuation is transformers' own
    hf_tokens, _ = hf_greedy(load_hf(model_path), prompts[1], 14)
    assert alone[1] == hf_tokens


def test_prefix_cache_hit_gives_identical_output(model_path):
    system = random_prompts([26], VOCAB, seed=4)[0]
    tails = random_prompts([3, 7, 1], VOCAB, seed=5)
    prompts = [system + t for t in tails]
    params = greedy(8, logprobs=2)
    plain = make_llm(model_path, enable_prefix_caching=False).generate(prompt_token_ids=prompts, sampling_params=params)
    llm = make_llm(model_path)
    first = llm.generate(prompt_token_ids=prompts[:1], sampling_params=params)
    rest = llm.generate(prompt_token_ids=prompts[1:], sampling_params=params)
    cached = first + rest
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]
    for a, b in zip(cached, plain):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert first[0].num_cached_tokens == 0
    assert [o.num_cached_tokens for o in rest] == [24, 24]            # 3 full pages of the shared 26
    assert llm.engine.stats()["prefix_cache_hit_rate"] == pytest.approx(48 / sum(len(p) for p in prompts))
    assert llm.engine.leaked_pages() == []


def test_chunked_prefill_same_tokens_and_logprobs_as_transformers(model_path):
    prompts = random_prompts([29, 6, 40], VOCAB, seed=6)
    params = greedy(6, logprobs=3, prompt_logprobs=True)
    whole = make_llm(model_path).generate(prompt_token_ids=prompts, sampling_params=params)
    chunked = make_llm(model_path, chunked_prefill_size=7).generate(prompt_token_ids=prompts, sampling_params=params)
    hf = load_hf(model_path)
    for p, a, b in zip(prompts, whole, chunked):
        assert a.token_ids == b.token_ids
        ref = hf_prompt_logprobs(hf, p)                       # [len, vocab]: position j scores token j + 1
        expected = [ref[j - 1, p[j]].item() for j in range(1, len(p))]
        for out in (a, b):
            assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
            assert out.prompt_logprobs[1:] == pytest.approx(expected, abs=1e-4)
        # sampled-token logprobs: transformers' log_softmax after the prompt + the tokens so far
        seq = p + a.token_ids
        full = hf_prompt_logprobs(hf, seq)
        for k, tok in enumerate(a.token_ids):
            row = full[len(p) - 1 + k]
            assert a.logprobs[k] == pytest.approx(row[tok].item(), abs=1e-4)
            assert list(a.top_logprobs[k]) == row.topk(3).indices.tolist()


def test_seeded_sampling_does_not_depend_on_the_batch():
    path = checkpoint("v3")
    prompts = random_prompts([11, 4, 19], VOCAB, seed=7)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=12, seed=1234, ignore_eos=True)
    alone = make_llm(path).generate(prompt_token_ids=prompts[:1], sampling_params=seeded)[0].token_ids
    batch = make_llm(path, seed=5).generate(
        prompt_token_ids=prompts,
        sampling_params=[seeded, SamplingParams(temperature=1.0, max_tokens=12), greedy(5)])
    assert batch[0].token_ids == alone
    other = make_llm(path).generate(prompt_token_ids=prompts[:1],
                                    sampling_params=SamplingParams(temperature=0.9, top_p=0.95, top_k=50,
                                                                   max_tokens=12, seed=4321, ignore_eos=True))
    assert other[0].token_ids != alone


def test_text_prompts_stop_strings_and_eos():
    path = checkpoint("v3")
    llm = make_llm(path)
    tok = llm.tokenizer
    prompt = "Hello, world"
    free = llm.generate(prompt, greedy(24))[0]
    assert free.prompt_token_ids == tok(prompt)["input_ids"]
    assert free.text == tok.decode(free.token_ids)
    stop = free.text[5:7]
    assert stop and "\ufffd" not in stop
    cut = llm.generate([prompt], greedy(24, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == free.text[:free.text.find(stop)]
    stop_id = free.token_ids[3]
    by_id = llm.generate([prompt], greedy(24, stop_token_ids=[stop_id]))[0]
    first = free.token_ids.index(stop_id)
    assert by_id.token_ids == free.token_ids[:first + 1] and by_id.finish_reason == "stop"
    assert by_id.text == tok.decode(free.token_ids[:first])
    assert llm.engine.leaked_pages() == []


def test_bad_configurations_raise_at_construction():
    path = checkpoint("v3")
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        make_llm(path, attention_backend="nope")
    with pytest.raises(ValueError, match="flashinfer"):
        make_llm(path, attention_backend="flashinfer")
    with pytest.raises(ValueError, match="dtype"):
        make_llm(path, dtype="float64")
    with pytest.raises(ValueError, match="page_size"):
        make_llm(path, page_size=0)
    llm = make_llm(path, context_length=40)
    with pytest.raises(ValueError, match="context length 40"):
        llm.generate(prompt_token_ids=[[5] * 40])
    with pytest.raises(ValueError, match="exactly one"):
        llm.generate()
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        llm.generate(prompt_token_ids=[[5, 6]], sampling_params=[SamplingParams(), SamplingParams()])
    out = llm.generate(prompt_token_ids=[[5] * 30], sampling_params=greedy(100))[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


def test_generate_cli(capsys):
    from mlaserve.cli import main
    path = checkpoint("v3")
    rc = main(["generate", "--model-path", path, "--prompt", "abc", "--prompt", "de", "--max-tokens", "5",
               "--device", "cpu", "--dtype", "float32", "--attention-backend", "torch", "--page-size", "8",
               "--max-total-pages", "32", "--ignore-eos"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.count("finish_reason=length") == 2 and "5 tokens" in out
    rc = main(["generate", "--model-path", path, "--prompt", "x", "--device", "cpu", "--attention-backend",
               "flashinfer"])
    assert rc == 2 and "flashinfer" in capsys.readouterr().err
