"""Logprobs in the shapes OpenAI's APIs return them, and the token strings they name.

Completions (legacy) `logprobs`:
    {"tokens": [str], "token_logprobs": [float], "top_logprobs": [{str: float}], "text_offset": [int]}
Chat `logprobs`:
    {"content": [{"token": str, "logprob": float, "bytes": [int],
                  "top_logprobs": [{"token", "logprob", "bytes"}]}], "refusal": None}
"""

import math

# JSON has no -inf; OpenAI-compatible servers send a large negative number instead.
_MIN_LOGPROB = -9999.0


def _finite(x: float) -> float:
    return x if math.isfinite(x) else _MIN_LOGPROB


class TokenTexts:
    """The bytes and display string of each token id, cached.

    Byte-level BPE tokens (DeepSeek's, the built-in model's) spell their bytes in the GPT-2 byte
    alphabet; others (SentencePiece, added/special tokens) are decoded alone. A token holding part
    of a multi-byte character shows U+FFFD in its string; its `bytes` are exact.
    """

    def __init__(self, tokenizer):
        from mlaserve.models.builtin import byte_alphabet

        self._tokenizer = tokenizer
        self._byte_of = {ch: b for b, ch in byte_alphabet().items()}
        self._cache: dict[int, bytes] = {}

    def bytes(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is None:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and piece and all(ch in self._byte_of for ch in piece):
                cached = bytes(self._byte_of[ch] for ch in piece)
            else:
                cached = self._tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
            self._cache[token_id] = cached
        return cached

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")


class CompletionLogprobs:
    """Accumulates one choice's legacy completions logprobs across outputs."""

    def __init__(self, texts: TokenTexts):
        self._texts = texts
        self._offset = 0

    def chunk(self, token_ids: list[int], logprobs: list[float], top: list[dict[int, float]]) -> dict:
        """The logprobs object for these tokens (a stream chunk's, or appended to by `extend`)."""
        tokens = [self._texts.text(t) for t in token_ids]
        offsets = []
        for tok in tokens:
            offsets.append(self._offset)
            self._offset += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(lp) for lp in logprobs],
            "top_logprobs": [{self._texts.text(t): _finite(lp) for t, lp in entry.items()} for entry in top],
            "text_offset": offsets,
        }

    @staticmethod
    def extend(total: dict | None, part: dict) -> dict:
        if total is None:
            return {k: list(v) for k, v in part.items()}
        for k, v in part.items():
            total[k].extend(v)
        return total


def chat_logprobs_content(texts: TokenTexts, token_ids: list[int], logprobs: list[float],
                          top: list[dict[int, float]]) -> list[dict]:
    """The `content` entries of chat logprobs for these tokens."""
    def entry(t: int, lp: float) -> dict:
        return {"token": texts.text(t), "logprob": _finite(lp), "bytes": list(texts.bytes(t))}

    out = []
    for i, (t, lp) in enumerate(zip(token_ids, logprobs)):
        e = entry(t, lp)
        e["top_logprobs"] = [entry(tt, tlp) for tt, tlp in (top[i].items() if i < len(top) else ())]
        out.append(e)
    return out


def sglang_logprobs(texts: TokenTexts | None, token_ids: list[int], logprobs: list[float | None]) -> list[list]:
    """SGLang's `[[logprob, token_id, text or None], ...]`."""
    return [[None if lp is None else _finite(lp), t, texts.text(t) if texts else None]
            for t, lp in zip(token_ids, logprobs)]
