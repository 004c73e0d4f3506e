"""Incremental detokenization with stop strings, for streaming.

Text leaves in deltas that are final: never half of a multi-byte character (a decoded tail
ending in U+FFFD is held until the next tokens complete it), never a stop string (the text
is cut before it), and never text that could still become the start of a stop string.
"""

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded in front of the output, so that tokenizers which render a token
# differently at the start of a text (SentencePiece's leading space) see it in context.
CONTEXT_TOKENS = 5
# UTF-8 characters span at most 4 bytes; byte-fallback tokenizers spend up to one token per
# byte. A tail still undecodable after this many tokens is invalid bytes, not a split char.
MAX_HELD_TOKENS = 6


class IncrementalDetokenizer:
    """Feed generated token ids one at a time; get back final text deltas.

    `tokenizer` needs `decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=...)`.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop_strings: list[str] | None = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop_strings = list(stop_strings or [])
        self._max_stop = max((len(s) for s in self.stop_strings), default=0)
        context = list(prompt_token_ids[-CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []     # the prompt ends inside a character: its bytes would merge with ours
        self._ids = context
        self._prefix_offset = 0            # window start: context for the tokens after read_offset
        self._read_offset = len(context)   # tokens before it have been turned into text
        self.text = ""                     # all decoded output text (cut before a stop string)
        self._emitted = 0                  # chars of self.text already handed out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _new_text(self, final: bool) -> str:
        """Text of the tokens after read_offset, or "" while it ends in a split character."""
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        held = len(self._ids) - self._read_offset
        if not final and full.endswith(REPLACEMENT_CHAR) and held < MAX_HELD_TOKENS:
            return ""
        if len(full) <= len(prefix):     # e.g. a skipped special token: nothing visible yet
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix):]

    def add(self, token_id: int) -> tuple[str, str | None]:
        """Append one generated token -> (final text delta, the stop string it completed or None).

        After a stop string is returned, the request is over: do not add more tokens.
        """
        self._ids.append(token_id)
        return self._push(self._new_text(final=False))

    def flush(self) -> str:
        """At the end of a request not stopped by a stop string: everything still held."""
        delta, stop = self._push(self._new_text(final=True), final=True)
        return delta

    def _push(self, new: str, final: bool = False) -> tuple[str, str | None]:
        old_len = len(self.text)
        self.text += new
        if self.stop_strings and new:
            # Only matches that end in the new text are new; they may start in the old text.
            start = max(0, old_len - self._max_stop + 1)
            hits = [(i, s) for s in self.stop_strings if (i := self.text.find(s, start)) >= 0]
            if hits:
                at, stop = min(hits)
                self.text = self.text[:at]
                return self._emit(len(self.text)), stop
        safe = len(self.text) if final else len(self.text) - held_suffix_len(self.text, self.stop_strings)
        return self._emit(safe), None

    def _emit(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        delta = self.text[self._emitted:upto]
        self._emitted = upto
        return delta


def held_suffix_len(text: str, markers) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers`.

    A streaming consumer holds that tail back: the next delta may complete the marker (a stop
    string, `"...<thi"` + `"nk>"`), and text once emitted cannot be taken back.
    """
    best = 0
    for marker in markers:
        for n in range(min(len(text), len(marker) - 1), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best
