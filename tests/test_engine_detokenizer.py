"""Incremental detokenization: split multi-byte characters, stop strings split across tokens."""

import random

import pytest

from engine_fake import ByteTokenizer, fake_greedy, make_engine, run_to_end
from mlaserve.engine.detokenizer import IncrementalDetokenizer
from mlaserve.engine.sampling_params import SamplingParams

ALPHABET = ["a", "b", " ", "S", "T", "O", "P", "é", "你", "好", "🎉", "\n"]


def complete_prefix(data: bytes) -> str:
    """The text of the longest prefix of `data` that ends on a character boundary."""
    for cut in range(len(data), -1, -1):
        try:
            return data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return ""


def expected_emitted(text: str, stops: list[str]) -> tuple[str, str | None]:
    """What may have left the detokenizer once `text` is decoded: cut at the first stop string,
    else everything but a tail that could still start a stop string."""
    hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    if hits:
        i, s = min(hits)
        return text[:i], s
    hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[:len(text) - hold], None


def test_multibyte_characters_split_over_byte_tokens():
    tok = ByteTokenizer()
    text = "héllo 你好 🎉 end"
    detok = IncrementalDetokenizer(tok, tok.encode_bytes("prompt: "))
    deltas = []
    data = text.encode()
    for k, b in enumerate(data):
        delta, stop = detok.add(b)
        assert stop is None and "\ufffd" not in delta
        deltas.append(delta)
        assert "".join(deltas) == complete_prefix(data[:k + 1])
    assert detok.flush() == ""
    assert "".join(deltas) == text
    assert deltas[data.index("你".encode())] == ""                # first byte of a 3-byte char: held


@pytest.mark.parametrize("seed", range(30))
def test_stop_strings_and_holdback_match_a_brute_force_reference(seed):
    rng = random.Random(seed)
    tok = ByteTokenizer()
    text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(5, 40)))
    stops = rng.sample(["STOP", "TO", "好🎉", "a a", "\nS", "éé", "PP"], rng.randint(1, 3))
    # tokens: single bytes mixed with multi-byte pieces where the text allows
    ids, data, pos = [], text.encode(), 0
    while pos < len(data):
        for piece_id, piece in enumerate(tok.pieces):
            if rng.random() < 0.7 and data.startswith(piece, pos) and piece_id + 256 not in tok.special_ids:
                ids.append(256 + piece_id)
                pos += len(piece)
                break
        else:
            ids.append(data[pos])
            pos += 1
    detok = IncrementalDetokenizer(tok, [1, 2, 3], stop_strings=stops)
    emitted, seen = "", b""
    for t in ids:
        delta, stop = detok.add(t)
        emitted += delta
        seen += tok.token_bytes(t)
        exp, exp_stop = expected_emitted(complete_prefix(seen), stops)
        assert emitted == exp, (text, stops)
        assert stop == exp_stop
        if stop is not None:
            break
    else:
        emitted += detok.flush()
        assert emitted == text and expected_emitted(text, stops)[1] is None


def test_invalid_bytes_are_not_held_forever_and_prompt_tail_is_safe():
    tok = ByteTokenizer()
    # the prompt ends inside a character: its bytes must not merge with the output's
    detok = IncrementalDetokenizer(tok, list("ab你".encode())[:-1])
    out = "".join(detok.add(t)[0] for t in "好x".encode())
    assert out == "好x"
    detok = IncrementalDetokenizer(tok, [97])
    out = "".join(detok.add(0xFF)[0] for _ in range(10)) + detok.flush()
    assert out.count("\ufffd") == 10


def test_special_tokens_skipped_or_kept():
    tok = ByteTokenizer()
    eos = 256 + 5
    for skip, want in ((True, "hi!"), (False, "hi<eos>!")):
        detok = IncrementalDetokenizer(tok, [104], skip_special_tokens=skip)
        out = "".join(detok.add(t)[0] for t in [104, 105, eos, 33]) + detok.flush()
        assert out == want


class PrintableTokenizer(ByteTokenizer):
    """Ids below 256 are printable ASCII, so that the fake model's text is valid UTF-8."""

    def token_bytes(self, t: int) -> bytes:
        return bytes([32 + t % 95]) if t < 256 else self.pieces[t - 256]


def test_engine_cuts_text_at_stop_string_and_drops_stop_token_text():
    tok = PrintableTokenizer()
    vocab = 256 + len(tok.pieces)
    prompt = [104, 101, 108, 108, 111]
    greedy = fake_greedy(prompt, 30, vocab_size=vocab, eos=None)
    full_text = tok.decode(greedy)
    stop = full_text[10:13]
    assert "\ufffd" not in stop and len(stop) == 3
    engine, _ = make_engine(vocab_size=vocab, tokenizer=tok, eos_token_ids=[vocab - 1])
    engine.add_request("s", prompt, SamplingParams(max_tokens=30, stop=stop, temperature=0, ignore_eos=True))
    engine.add_request("t", prompt, SamplingParams(max_tokens=30, stop_token_ids=[greedy[5]], temperature=0,
                                                   ignore_eos=True))
    engine.add_request("n", prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    res = run_to_end(engine)
    cut = full_text.find(stop)
    assert res["s"]["text"] == full_text[:cut]
    assert res["s"]["finish_reason"] == "stop" and res["s"]["stop_reason"] == stop
    first = greedy.index(greedy[5])
    assert res["t"]["token_ids"] == greedy[:first + 1]
    assert res["t"]["text"] == tok.decode(greedy[:first])          # the stop token's text is left out
    assert res["n"]["text"] == full_text and res["n"]["token_ids"] == greedy
    assert engine.leaked_pages() == []
