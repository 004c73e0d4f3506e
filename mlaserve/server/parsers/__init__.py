"""Output parsers for the chat route: reasoning (`<think>` blocks) and tool calls.

Pure text in, text and dataclasses out; nothing here imports FastAPI, so the parsers are
unit-tested alone and reused by any front end. One parser instance per generated sequence.

    from mlaserve.server.parsers import make_reasoning_parser, make_tool_call_parser
    rp = make_reasoning_parser("deepseek-r1")        # or "glm45"
    d = rp.feed(delta_text)                          # ReasoningDelta(reasoning_content, content)
    tp = make_tool_call_parser("deepseekv3", tools)  # fed the `content` the reasoning parser lets through
    t = tp.feed(d.content)                           # ToolDelta(content, tool_calls=[ToolCallDelta])
    ... rp.finish(), tp.feed(...), tp.finish() at the end of the stream
"""

from mlaserve.server.parsers.reasoning import REASONING_FORMATS, ReasoningDelta, ReasoningParser
from mlaserve.server.parsers.tool_calls import (
    TOOL_CALL_PARSERS,
    DeepSeekV3ToolParser,
    ToolCall,
    ToolCallDelta,
    ToolDelta,
    ToolParseResult,
    make_tool_call_parser,
)

REASONING_PARSER_NAMES = tuple(sorted(REASONING_FORMATS))
TOOL_CALL_PARSER_NAMES = tuple(sorted(TOOL_CALL_PARSERS))


def make_reasoning_parser(name: str) -> ReasoningParser:
    return ReasoningParser(name)


__all__ = [
    "REASONING_PARSER_NAMES", "TOOL_CALL_PARSER_NAMES", "ReasoningDelta", "ReasoningParser", "DeepSeekV3ToolParser",
    "ToolCall", "ToolCallDelta", "ToolDelta", "ToolParseResult", "make_reasoning_parser", "make_tool_call_parser",
]
