"""Reasoning parsers: split a model's `<think>…</think>` block from its answer.

`--reasoning-parser deepseek-r1`: DeepSeek-R1's chat template ends the prompt with `<think>\\n`,
so the output usually starts inside the reasoning and only `</think>` appears. Text before
`</think>` is reasoning whether or not the opening tag was generated; an output that never
closes the block is all reasoning.

`--reasoning-parser glm45`: GLM-4.5/GLM-5 generate the opening `<think>` themselves (or get
`<think></think>` from the template when thinking is off). Reasoning only when the output
starts with `<think>`; otherwise everything is content.

Both run one state machine fed text deltas, so `parse(text)` and the concatenation of
`feed(chunk)` results over any split of `text` are identical: nothing emitted twice, nothing
lost. Whitespace around the reasoning and before the answer is dropped (the templates put
newlines there: `<think>\n…\n</think>\n\n`); everything else is kept verbatim.
"""

from dataclasses import dataclass

from mlaserve.engine.detokenizer import held_suffix_len

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass
class ReasoningDelta:
    """What one `feed` (or `finish`) adds to each of the two fields."""
    reasoning_content: str = ""
    content: str = ""


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    starts_in_reasoning: bool   # True: text before the closing tag is reasoning even without the opening tag


REASONING_FORMATS = {
    "deepseek-r1": ReasoningFormat("deepseek-r1", starts_in_reasoning=True),
    "glm45": ReasoningFormat("glm45", starts_in_reasoning=False),
}

_START, _REASONING, _CONTENT = "start", "reasoning", "content"


class ReasoningParser:
    """Stateful splitter; one instance per generated sequence (per choice when n > 1)."""

    def __init__(self, name: str):
        if name not in REASONING_FORMATS:
            raise ValueError(f"unknown reasoning parser {name!r}; choose from {sorted(REASONING_FORMATS)}")
        self.format = REASONING_FORMATS[name]
        self._state = _START
        self._buf = ""              # text received but not yet emitted
        self._skip_ws = False       # drop leading whitespace of the current field
        self._held_ws = ""          # reasoning's trailing whitespace: emitted only if more reasoning follows
        self._finished = False

    def parse(self, text: str) -> ReasoningDelta:
        """Whole-output parse (non-streaming responses)."""
        out = self.feed(text)
        tail = self.finish()
        return ReasoningDelta(out.reasoning_content + tail.reasoning_content, out.content + tail.content)

    def feed(self, delta: str) -> ReasoningDelta:
        if self._finished:
            raise RuntimeError("ReasoningParser.feed after finish")
        self._buf += delta
        out = ReasoningDelta()
        self._advance(out, final=False)
        return out

    def finish(self) -> ReasoningDelta:
        """End of the stream: release whatever was held back waiting for a tag."""
        out = ReasoningDelta()
        if not self._finished:
            self._advance(out, final=True)
            self._finished = True
        return out

    def _advance(self, out: ReasoningDelta, final: bool) -> None:
        while True:
            if self._state == _START:
                if not self._decide_start(final):
                    return
            elif self._state == _REASONING:
                end = self._buf.find(THINK_END)
                if end < 0:
                    keep = 0 if final else held_suffix_len(self._buf, (THINK_END,))
                    self._emit(out, "reasoning", self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return
                self._emit(out, "reasoning", self._buf[:end])
                self._buf = self._buf[end + len(THINK_END):]
                self._state, self._skip_ws, self._held_ws = _CONTENT, True, ""
            else:
                self._emit(out, "content", self._buf)
                self._buf = ""
                return

    def _decide_start(self, final: bool) -> bool:
        """Whether the output opens with `<think>` (leading whitespace allowed). False = need more text."""
        head = self._buf.lstrip()
        if head.startswith(THINK_START):
            self._buf = head[len(THINK_START):]
            self._state, self._skip_ws = _REASONING, True
            return True
        if not final and THINK_START.startswith(head):
            return False                       # empty, or a prefix of the tag: wait
        if self.format.starts_in_reasoning:
            self._state, self._skip_ws = _REASONING, True
        else:
            self._state, self._skip_ws = _CONTENT, False
        return True

    def _emit(self, out: ReasoningDelta, field: str, text: str) -> None:
        if self._skip_ws:
            stripped = text.lstrip()
            if stripped:
                self._skip_ws = False
            text = stripped
        if field == "reasoning":
            text = self._held_ws + text
            body = text.rstrip()
            self._held_ws = text[len(body):]
            out.reasoning_content += body
        else:
            out.content += text
