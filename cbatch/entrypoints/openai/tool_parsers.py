"""Tool calls in the model's output, as vLLM reads them (this module reads output only; the
tools' shapes and the schema of a forced call are :mod:`~cbatch.entrypoints.openai.tools`).

- ``tool_choice="required"`` or a named function: structured output guarantees the call
  (:func:`~cbatch.entrypoints.openai.tools.tool_call_schema`), and :func:`forced_tool_calls`
  reads the calls back.
- ``tool_choice="auto"`` (``--enable-auto-tool-choice --tool-call-parser NAME``): the model
  decides, writing calls in its chat format; a parser of :data:`TOOL_PARSERS` finds them.
  ``hermes`` (:class:`HermesToolParser`) reads Hermes 2 Pro's format, which the Qwen2, Qwen2.5
  and Qwen3 chat templates teach::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # the arguments object as JSON text


@dataclass
class ExtractedToolCalls:
    """A reply split into its text (None when there is none) and its tool calls."""

    content: str | None
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


def forced_tool_calls(text: str, function: str | None) -> list[ParsedToolCall]:
    """The calls in the output of a forced tool call: of ``function`` (a named tool choice;
    the output is its arguments object), or, with None (``"required"``), the list of calls
    the output is; ValueError if it is not complete (the output reached ``max_tokens``)."""
    if function is not None:
        json.loads(text)  # the whole object is there
        return [ParsedToolCall(function, text)]
    return [ParsedToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False))
            for c in json.loads(text)]


class HermesToolParser:
    """Calls written as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; the
    text before the first call is the reply's content.  A call whose JSON does not parse
    leaves the whole reply as content, as vLLM's parser does."""

    start, end = "<tool_call>", "</tool_call>"
    _call = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)

    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls of a finished reply."""
        if self.start not in text:
            return ExtractedToolCalls(text)
        calls = []
        try:
            for closed, unclosed in self._call.findall(text):
                call = json.loads(closed or unclosed)
                name, arguments = call["name"], call.get("arguments", {})
                if not isinstance(name, str) or not isinstance(arguments, dict):
                    raise ValueError("not a call")
                calls.append(ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False)))
        except (ValueError, KeyError, TypeError):  # (json.JSONDecodeError is a ValueError)
            return ExtractedToolCalls(text)
        content = text[:text.index(self.start)].strip()
        return ExtractedToolCalls(content or None, calls)

    def content_end(self, text: str) -> int:
        """While streaming: how much of the reply so far is surely content (it stops where a
        call starts, or may start: a prefix of ``<tool_call>`` at the end is held back)."""
        at = text.find(self.start)
        if at >= 0:
            return at
        for n in range(min(len(self.start) - 1, len(text)), 0, -1):
            if self.start.startswith(text[-n:]):
                return len(text) - n
        return len(text)


# --tool-call-parser NAME -> its parser
TOOL_PARSERS = {"hermes": HermesToolParser}
