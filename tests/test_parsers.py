"""Reasoning and tool-call parsers on hand-written model outputs, streamed in every awkward split."""

import itertools
import json
import random

import pytest

from mlaserve.server.parsers import make_reasoning_parser, make_tool_call_parser
from mlaserve.engine.detokenizer import held_suffix_len
from mlaserve.server.parsers.tool_calls import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP


def splits(text: str, seed: int = 0):
    """Every way to cut `text` in two, one character at a time, and a few random many-way cuts."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(2, 8))))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def stream_reasoning(name: str, chunks: list[str]) -> tuple[str, str]:
    parser = make_reasoning_parser(name)
    reasoning, content = "", ""
    for chunk in chunks:
        d = parser.feed(chunk)
        reasoning += d.reasoning_content
        content += d.content
    d = parser.finish()
    return reasoning + d.reasoning_content, content + d.content


REASONING_CASES = [
    # (parser, model output, reasoning, content)
    ("deepseek-r1", "Let me add 2 and 2.\nThat is 4.\n</think>\n\nThe answer is 4.",
     "Let me add 2 and 2.\nThat is 4.", "The answer is 4."),
    ("deepseek-r1", "<think>\nFirst, 3*3=9.\n</think>\n\n9", "First, 3*3=9.", "9"),
    ("deepseek-r1", "still thinking <b>bold</b> and < and </thin", "still thinking <b>bold</b> and < and </thin", ""),
    ("deepseek-r1", "</think>Only an answer.", "", "Only an answer."),
    ("deepseek-r1", "a</think>b</think>c", "a", "b</think>c"),
    ("glm45", "<think>plan: greet</think>Hello there!", "plan: greet", "Hello there!"),
    ("glm45", "\n<think>\nx < y\n</think>\n\nSo y.", "x < y", "So y."),
    ("glm45", "No thinking today: <think> is just text.", "", "No thinking today: <think> is just text."),
    ("glm45", "  <thin", "", "  <thin"),
    ("glm45", "<think></think>Direct.", "", "Direct."),
    ("glm45", "<think>cut off mid-thought\n", "cut off mid-thought", ""),
]


@pytest.mark.parametrize("name,text,reasoning,content", REASONING_CASES)
def test_reasoning_parse_and_every_split(name, text, reasoning, content):
    whole = make_reasoning_parser(name).parse(text)
    assert (whole.reasoning_content, whole.content) == (reasoning, content)
    for chunks in splits(text):
        assert stream_reasoning(name, chunks) == (reasoning, content), chunks


def test_reasoning_holds_back_only_what_could_be_a_tag():
    parser = make_reasoning_parser("deepseek-r1")
    assert parser.feed("abc</th").reasoning_content == "abc"
    d = parser.feed("ink>answer")
    assert (d.reasoning_content, d.content) == ("", "answer")
    parser = make_reasoning_parser("glm45")
    assert parser.feed("<thi").content == ""                    # undecided: might open a block
    assert parser.feed("s is text").content == "<this is text"


def test_reasoning_errors():
    with pytest.raises(ValueError, match="unknown reasoning parser 'qwen9'"):
        make_reasoning_parser("qwen9")
    parser = make_reasoning_parser("glm45")
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")


def test_held_suffix_len():
    assert held_suffix_len("abc</thi", ("</think>",)) == 5
    assert held_suffix_len("abc", ("</think>",)) == 0
    assert held_suffix_len("x<", ("</think>", "<think>")) == 1
    assert held_suffix_len("</think>", ("</think>",)) == 0   # a whole marker is found, not held


def call(name: str, args: str, sep_ws: str = "") -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{args}\n```{CALL_END}{sep_ws}"


TOOL_CASES = [
    # (model output, content, [(name, arguments)])
    ("Let me check the weather." + CALLS_BEGIN + call("get_weather", '{"location": "Tokyo"}', "\n")
     + call("get_weather", '{"location": "Paris", "unit": "celsius"}') + CALLS_END,
     "Let me check the weather.",
     [("get_weather", '{"location": "Tokyo"}'), ("get_weather", '{"location": "Paris", "unit": "celsius"}')]),
    (CALLS_BEGIN + call("now", "{}") + CALLS_END, "", [("now", "{}")]),
    ("No tools needed: 2 + 2 = 4. ```json {} ``` is fine.", "No tools needed: 2 + 2 = 4. ```json {} ``` is fine.", []),
    # Pretty-printed arguments with inner newlines and a brace in a string.
    ("x" + CALLS_BEGIN + call("search", '{\n  "q": "a } b",\n  "n": 3\n}') + CALLS_END + "",
     "x", [("search", '{\n  "q": "a } b",\n  "n": 3\n}')]),
    # A call without the outer marker (some checkpoints skip it).
    ("ok " + call("f", '{"a": [1, 2]}'), "ok ", [("f", '{"a": [1, 2]}')]),
    # Cut off by max_tokens inside the arguments: what was written is kept.
    ("hi" + CALLS_BEGIN + f"{CALL_BEGIN}function{SEP}f\n```json\n" + '{"a": 1', "hi", [("f", '{"a": 1')]),
    # Cut off before the name line ended: the markup comes back as text, nothing lost.
    ("hi" + CALLS_BEGIN + f"{CALL_BEGIN}function{SEP}get_wea", "hi" + CALLS_BEGIN + f"{CALL_BEGIN}function{SEP}get_wea", []),
]


def stream_tools(text_chunks: list[str]):
    ids = (f"call_{i}" for i in itertools.count())
    parser = make_tool_call_parser("deepseekv3", tools=[], new_id=lambda: next(ids))
    content, deltas = "", []
    for chunk in text_chunks:
        d = parser.feed(chunk)
        content += d.content
        deltas += [x.to_openai() for x in d.tool_calls]
    d = parser.finish()
    return content + d.content, deltas + [x.to_openai() for x in d.tool_calls]


def assemble(deltas: list[dict], counted_ids: bool = True) -> list[tuple[str, str]]:
    """Build calls from OpenAI stream deltas the way a client does, checking their shape."""
    calls: list[dict] = []
    for d in deltas:
        if "id" in d:
            assert d["index"] == len(calls) and d["type"] == "function" and d["function"]["arguments"] == ""
            calls.append({"id": d["id"], "name": d["function"]["name"], "arguments": ""})
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            assert d["index"] == len(calls) - 1 and d["function"]["arguments"]
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
    ids = [c["id"] for c in calls]
    assert len(set(ids)) == len(ids)
    if counted_ids:
        assert ids == [f"call_{i}" for i in range(len(calls))]
    return [(c["name"], c["arguments"]) for c in calls]


@pytest.mark.parametrize("text,content,calls", TOOL_CASES)
def test_tool_calls_parse_and_every_split(text, content, calls):
    result = make_tool_call_parser("deepseekv3").parse(text)
    assert result.content == content
    assert [(c.name, c.arguments) for c in result.tool_calls] == calls
    for c in result.tool_calls:
        o = c.to_openai()
        assert o["type"] == "function" and o["id"].startswith("call_") and o["function"]["name"] == c.name
    for chunks in splits(text, seed=len(text)):
        got_content, deltas = stream_tools(chunks)
        assert got_content == content, chunks
        assert assemble(deltas) == calls, chunks


def test_complete_arguments_are_valid_json():
    text = TOOL_CASES[0][0]
    for c in make_tool_call_parser("deepseekv3").parse(text).tool_calls:
        assert isinstance(json.loads(c.arguments), dict)


def test_arguments_stream_before_the_call_ends():
    parser = make_tool_call_parser("deepseekv3")
    first = parser.feed(CALLS_BEGIN + f"{CALL_BEGIN}function{SEP}lookup\n```json\n" + '{"city": "Os')
    assert [d.name for d in first.tool_calls] == ["lookup", None]
    assert first.tool_calls[1].arguments == '{"city": "Os'
    more = parser.feed('lo"}\n``')                          # the fence might be closing: held
    assert [d.arguments for d in more.tool_calls] == ['lo"}']


def test_reasoning_then_tools_chain():
    text = "<think>\nNeed weather.\n</think>\n\n" + CALLS_BEGIN + call("get_weather", '{"city": "Oslo"}') + CALLS_END
    for chunks in splits(text):
        rp, tp = make_reasoning_parser("deepseek-r1"), make_tool_call_parser("deepseekv3")
        reasoning, content, calls = "", "", []
        for chunk in chunks + [None]:
            d = rp.feed(chunk) if chunk is not None else rp.finish()
            reasoning += d.reasoning_content
            t = tp.feed(d.content)
            content += t.content
            calls += t.tool_calls
        t = tp.finish()
        content += t.content
        calls += t.tool_calls
        assert reasoning == "Need weather." and content == ""
        assert assemble([c.to_openai() for c in calls], counted_ids=False) == [("get_weather", '{"city": "Oslo"}')]


def test_tool_parser_errors():
    with pytest.raises(ValueError, match="unknown tool-call parser 'hermes'"):
        make_tool_call_parser("hermes")


def test_chat_output_parser_stream_equals_message():
    from mlaserve.server.parsers.chat import ChatOutputParser

    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    text = ("<think>\nUser wants weather.\n</think>\n\nChecking." + CALLS_BEGIN
            + call("get_weather", '{"city": "Oslo"}') + CALLS_END)
    whole = ChatOutputParser("deepseek-r1", "deepseekv3", tools)
    msg = whole.message(text)
    assert msg["content"] == "Checking." and msg["reasoning_content"] == "User wants weather."
    assert [c["function"] for c in msg["tool_calls"]] == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    assert whole.finish_reason("stop") == "tool_calls" and whole.finish_reason("length") == "length"
    for chunks in splits(text):
        p = ChatOutputParser("deepseek-r1", "deepseekv3", tools)
        deltas = [p.delta(c, finished=False) for c in chunks] + [p.delta("", finished=True)]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
        assert "".join(d.get("content", "") for d in deltas) == msg["content"]
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert assemble(calls, counted_ids=False) == [("get_weather", '{"city": "Oslo"}')]
        assert p.finish_reason("stop") == "tool_calls"
    # tool_choice "none", or no tools in the request: the markup is left alone.
    for p in (ChatOutputParser(None, "deepseekv3", tools, tool_choice="none"), ChatOutputParser(None, "deepseekv3", None)):
        assert not p.active and p.message(text) == {"role": "assistant", "content": text}
    assert ChatOutputParser("glm45", None, None).message("plain") == {
        "role": "assistant", "content": "plain", "reasoning_content": None}
