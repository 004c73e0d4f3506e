"""Tool-call parsers: turn a model's tool-call markup into OpenAI `tool_calls`.

`--tool-call-parser deepseekv3` reads DeepSeek-V3's format (the markers are single tokens
written with U+FF5C `｜` and U+2581 `▁`; the detokenizer must keep special tokens):

    TEXT<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    ARGS
    ```<｜tool▁call▁end｜>\\n<｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

TEXT before the calls stays `content`; each call becomes `{"id", "type": "function",
"function": {"name", "arguments"}}` with ARGS as written (a JSON string, surrounding
whitespace removed). Streaming: `feed(delta)` returns content and OpenAI-shaped tool-call
deltas — the first delta of call i carries index, id, type and name with empty arguments,
later ones only `{"index": i, "function": {"arguments": piece}}`. `parse(text)` runs the
same machine, so streamed pieces always add up to the non-streamed result.

An output cut off inside a call (max_tokens) keeps what it has: a call whose name line is
incomplete is returned as content text, arguments already begun are returned as they stand.
"""

import uuid
from dataclasses import dataclass, field
from typing import Callable

from mlaserve.engine.detokenizer import held_suffix_len

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
ARGS_OPEN = "```json\n"
ARGS_CLOSE = "\n```"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallDelta:
    """One piece of one call in a stream: `name`/`id` only on the call's first delta."""
    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict:
        if self.name is not None:
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, "function": {"arguments": self.arguments}}


@dataclass
class ToolDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class ToolParseResult:
    content: str
    tool_calls: list[ToolCall]


def _new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# States of the machine: where in the markup the unconsumed text starts.
_TEXT, _BETWEEN, _HEADER, _ARGS_OPEN, _ARGS, _CALL_END = "text", "between", "header", "args_open", "args", "call_end"


class DeepSeekV3ToolParser:
    """Stateful parser; one instance per generated sequence."""

    def __init__(self, tools: list[dict] | None = None, new_id: Callable[[], str] = _new_call_id):
        self.tools = tools or []
        self._new_id = new_id
        self._state = _TEXT
        self._buf = ""
        self._calls: list[ToolCall] = []
        self._args_started = False
        self._pending_ws = ""       # whitespace inside the arguments, held until more JSON follows it
        self._markup = ""           # markers consumed since the last call was opened: content again if no call follows
        self._finished = False

    def parse(self, text: str) -> ToolParseResult:
        """Whole-output parse (non-streaming responses)."""
        out = self.feed(text)
        tail = self.finish()
        return ToolParseResult(content=out.content + tail.content, tool_calls=list(self._calls))

    def feed(self, delta: str) -> ToolDelta:
        if self._finished:
            raise RuntimeError("DeepSeekV3ToolParser.feed after finish")
        self._buf += delta
        out = ToolDelta()
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        if not self._finished:
            while self._step(out, final=True):
                pass
            self._finished = True
        return out

    @property
    def tool_calls(self) -> list[ToolCall]:
        return list(self._calls)

    def _step(self, out: ToolDelta, final: bool) -> bool:
        """Consume what the current state can; True if the state changed and another step may help."""
        buf = self._buf
        if self._state == _TEXT:
            # Some checkpoints skip the outer marker and open a call directly.
            hits = [(i, m) for m in (CALLS_BEGIN, CALL_BEGIN) if (i := buf.find(m)) >= 0]
            if not hits:
                keep = 0 if final else held_suffix_len(buf, (CALLS_BEGIN, CALL_BEGIN))
                out.content += buf[: len(buf) - keep]
                self._buf = buf[len(buf) - keep:]
                return False
            i, marker = min(hits)
            out.content += buf[:i]
            if marker == CALLS_BEGIN:
                self._markup, self._buf = CALLS_BEGIN, buf[i + len(CALLS_BEGIN):]
            else:
                self._markup, self._buf = "", buf[i:]
            self._state = _BETWEEN
            return True
        if self._state == _BETWEEN:
            head = buf.lstrip()
            if head.startswith(CALL_BEGIN):
                self._markup += buf[: len(buf) - len(head)] + CALL_BEGIN
                self._buf = head[len(CALL_BEGIN):]
                self._state = _HEADER
                return True
            if head.startswith(CALLS_END):
                self._buf, self._markup = head[len(CALLS_END):], ""
                self._state = _TEXT
                return True
            if not final and (CALL_BEGIN.startswith(head) or CALLS_END.startswith(head)):
                return False
            # Not markup we know: give it back as text rather than lose it.
            out.content += self._markup
            self._markup = ""
            self._state = _TEXT
            return True
        if self._state == _HEADER:
            sep = buf.find(SEP)
            newline = buf.find("\n", sep + len(SEP)) if sep >= 0 else -1
            if newline < 0:
                if final:
                    out.content += self._markup + buf
                    self._buf, self._markup = "", ""
                return False
            call = ToolCall(id=self._new_id(), name=buf[sep + len(SEP): newline].strip())
            self._calls.append(call)
            out.tool_calls.append(ToolCallDelta(index=len(self._calls) - 1, id=call.id, name=call.name))
            self._buf, self._markup = buf[newline + 1:], ""
            self._state, self._args_started, self._pending_ws = _ARGS_OPEN, False, ""
            return True
        if self._state == _ARGS_OPEN:
            if buf.startswith(ARGS_OPEN):
                self._buf = buf[len(ARGS_OPEN):]
                self._state = _ARGS
                return True
            if not final and ARGS_OPEN.startswith(buf):
                return False
            self._state = _ARGS          # no fence: arguments run to the closing marker
            return True
        if self._state == _ARGS:
            close_at = [i for m in (ARGS_CLOSE, CALL_END) if (i := buf.find(m)) >= 0]
            end = min(close_at) if close_at else len(buf)
            keep = 0 if (close_at or final) else held_suffix_len(buf, (ARGS_CLOSE, CALL_END))
            piece = buf[: end - keep]
            self._buf = buf[end - keep:]
            self._emit_args(out, piece, closing=bool(close_at) or final)
            if not close_at:
                return False
            self._state = _CALL_END
            return True
        if self._state == _CALL_END:
            if buf.startswith(ARGS_CLOSE):
                buf = buf[len(ARGS_CLOSE):]
            head = buf.lstrip()
            if head.startswith(CALL_END):
                self._buf = head[len(CALL_END):]
                self._state = _BETWEEN
                return True
            self._buf = buf
            if not final and CALL_END.startswith(head):
                return False
            self._state = _BETWEEN
            return True
        raise AssertionError(f"unknown state {self._state}")

    def _emit_args(self, out: ToolDelta, piece: str, closing: bool) -> None:
        """Append argument text, without the whitespace around the JSON (held until it is inner)."""
        call = self._calls[-1]
        if not self._args_started:
            piece = piece.lstrip()
            if not piece:
                return
            self._args_started = True
        # Trailing whitespace might be followed by more JSON or by the end: hold it until we know.
        text = self._pending_ws + piece
        body = text.rstrip()
        self._pending_ws = "" if closing else text[len(body):]
        if body:
            call.arguments += body
            out.tool_calls.append(ToolCallDelta(index=len(self._calls) - 1, arguments=body))


TOOL_CALL_PARSERS = {"deepseekv3": DeepSeekV3ToolParser}


def make_tool_call_parser(name: str, tools: list[dict] | None = None, **kwargs) -> DeepSeekV3ToolParser:
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose from {sorted(TOOL_CALL_PARSERS)}")
    return TOOL_CALL_PARSERS[name](tools=tools, **kwargs)
