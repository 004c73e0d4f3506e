"""The chat route's use of the parsers: one `ChatOutputParser` per choice turns generated text into
an OpenAI assistant message (non-streaming) or message deltas (streaming).

Text goes through the reasoning parser first (when the server has `--reasoning-parser`), and the
answer part through the tool-call parser (when the server has `--tool-call-parser`, the request
brings `tools` and `tool_choice` is not "none"). Fields: `content`, `reasoning_content`
(DeepSeek's API name for it), `tool_calls`. A choice that called tools and stopped normally
finishes with "tool_calls", as OpenAI's do.
"""

from mlaserve.server.parsers.reasoning import ReasoningParser
from mlaserve.server.parsers.tool_calls import make_tool_call_parser


class ChatOutputParser:
    def __init__(self, reasoning_parser: str | None, tool_call_parser: str | None, tools: list[dict] | None,
                 tool_choice=None):
        self.reasoning = ReasoningParser(reasoning_parser) if reasoning_parser else None
        use_tools = bool(tool_call_parser and tools and tool_choice != "none")
        self.tools = make_tool_call_parser(tool_call_parser, tools) if use_tools else None
        self.num_tool_calls = 0

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    @property
    def needs_special_tokens(self) -> bool:
        """Tool-call markers are special tokens in DeepSeek's tokenizers: the text must keep them."""
        return self.tools is not None

    def delta(self, text: str, finished: bool) -> dict:
        """The delta fields for one piece of streamed text (all that is left, when `finished`)."""
        reasoning, content = "", text
        if self.reasoning is not None:
            r = self.reasoning.feed(text)
            reasoning, content = r.reasoning_content, r.content
            if finished:
                tail = self.reasoning.finish()
                reasoning, content = reasoning + tail.reasoning_content, content + tail.content
        calls = []
        if self.tools is not None:
            t = self.tools.feed(content)
            content, calls = t.content, t.tool_calls
            if finished:
                tail = self.tools.finish()
                content, calls = content + tail.content, calls + tail.tool_calls
        self.num_tool_calls += sum(c.name is not None for c in calls)
        out = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = [c.to_openai() for c in calls]
        return out

    def message(self, text: str) -> dict:
        """The whole answer as an assistant message."""
        d = self.delta(text, finished=True)
        calls = self.tools.tool_calls if self.tools is not None else []
        msg = {"role": "assistant", "content": d.get("content") or (None if calls else "")}
        if self.reasoning is not None:
            msg["reasoning_content"] = d.get("reasoning_content") or None
        if calls:
            msg["tool_calls"] = [c.to_openai() for c in calls]
        return msg

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.num_tool_calls else reason
