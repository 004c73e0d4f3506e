"""The OpenAI-compatible routes through the official `openai` client, against the real server
serving the built-in model."""

import openai
import pytest
import torch

from server_harness import API_KEY, shared_server

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def server():
    return shared_server()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(server):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(client_model_path(server))


def client_model_path(server) -> str:
    import httpx
    return httpx.get(f"{server.url}/v1/models", headers=server.headers).json()["data"][0]["root"]


def greedy(client, prompt=PROMPT, max_tokens=24, **kw):
    return client.completions.create(model="mlaserve-builtin", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True}, **kw)


def test_models_lists_the_served_model(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == ["mlaserve-builtin"]
    assert client_model_path(server).endswith("builtin-1")


def test_completion_usage_and_exact_length(client, tokenizer):
    out = greedy(client, max_tokens=12)
    assert out.object == "text_completion" and out.model == "mlaserve-builtin"
    c = out.choices[0]
    assert c.finish_reason == "length" and len(c.text) == 12     # byte tokens, printable ASCII
    assert out.usage.prompt_tokens == len(tokenizer(PROMPT)["input_ids"])
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_streaming_completion_equals_non_streaming(client):
    whole = greedy(client, max_tokens=16).choices[0].text
    chunks = list(greedy(client, max_tokens=16, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])
    assert all(ch.usage is None for ch in chunks)


def test_stream_include_usage(client, tokenizer):
    chunks = list(greedy(client, max_tokens=10, stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert last.usage.prompt_tokens == len(tokenizer(PROMPT)["input_ids"])
    assert all(ch.usage is None for ch in chunks[:-1])


def test_stop_string_cuts_before_it(client):
    full = greedy(client, max_tokens=24).choices[0].text
    stop = full[10:13]
    expected = full[:full.index(stop)]
    out = greedy(client, max_tokens=24, stop=[stop, "never-matches"])
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in greedy(client, max_tokens=24, stop=stop, stream=True))
    assert streamed == expected


def test_n2_seeded_samples_differ_and_repeat(client):
    def sample():
        return client.completions.create(model="mlaserve-builtin", prompt=PROMPT, max_tokens=16, n=2, temperature=1.0,
                                         seed=1234, extra_body={"ignore_eos": True})
    a, b = sample(), sample()
    assert sorted(c.index for c in a.choices) == [0, 1]
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert texts[0] != texts[1]
    assert a.usage.completion_tokens == 32


def test_several_prompts_times_n(client):
    out = client.completions.create(model="mlaserve-builtin", prompt=["Hello", "Goodbye, world"], max_tokens=4, n=2,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text                # greedy: same prompt, same text
    assert out.usage.completion_tokens == 16


def test_completion_logprobs_match_transformers(client, server, tokenizer):
    """Logprobs are the model's log_softmax: checked against transformers on the built-in model."""
    from transformers import AutoModelForCausalLM

    out = greedy(client, max_tokens=8, logprobs=3)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text and lp.text_offset == list(range(8))
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and top[tok] == pytest.approx(val) and max(top.values()) == pytest.approx(val)
    model = AutoModelForCausalLM.from_pretrained(client_model_path(server), dtype=torch.float32)
    ids = tokenizer(PROMPT + out.choices[0].text)["input_ids"]
    n_prompt = len(tokenizer(PROMPT)["input_ids"])
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
    expected = [ref[i - 1, ids[i]].item() for i in range(n_prompt, len(ids))]
    assert lp.token_logprobs == pytest.approx(expected, abs=2e-4)


def test_chat_completion_and_stream(client, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
    kw = dict(model="mlaserve-builtin", messages=messages, max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})
    out = client.chat.completions.create(**kw)
    msg = out.choices[0].message
    assert msg.role == "assistant" and len(msg.content) == 12 and out.choices[0].finish_reason == "length"
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert out.usage.prompt_tokens == len(tokenizer(templated, add_special_tokens=False)["input_ids"])
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == msg.content
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-2].choices[0].finish_reason == "length"


def test_chat_max_completion_tokens_and_content_parts(client):
    out = client.chat.completions.create(
        model="mlaserve-builtin", max_completion_tokens=5, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}])
    same = client.chat.completions.create(model="mlaserve-builtin", max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True},
                                          messages=[{"role": "user", "content": "Hi there"}])
    assert out.usage.completion_tokens == 5 and out.choices[0].message.content == same.choices[0].message.content


def test_chat_logprobs_shape(client):
    out = client.chat.completions.create(model="mlaserve-builtin", messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                                         extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert "".join(e.token for e in content) == out.choices[0].message.content
    for e in content:
        assert bytes(e.bytes).decode() == e.token and e.logprob <= 0
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == pytest.approx(e.logprob)   # greedy
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
    chunks = list(client.chat.completions.create(model="mlaserve-builtin", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                                                 stream=True, extra_body={"ignore_eos": True}))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]


def test_chat_n2_streams_both_choices(client):
    chunks = list(client.chat.completions.create(
        model="mlaserve-builtin", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, n=2, seed=7,
        stream=True, extra_body={"ignore_eos": True}))
    text = {0: "", 1: ""}
    finished = set()
    for ch in chunks:
        for c in ch.choices:
            text[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1} and all(len(t) == 5 for t in text.values())
