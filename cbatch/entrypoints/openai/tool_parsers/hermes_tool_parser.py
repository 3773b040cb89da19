"""``hermes``: Hermes 2 Pro's format, which the Qwen2, Qwen2.5 and Qwen3 chat templates
teach::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

import json
import re

from cbatch.entrypoints.openai.tool_parsers.abstract_tool_parser import (ExtractedToolCalls,
                                                                          ParsedToolCall,
                                                                          ToolParser,
                                                                          content_before)


class HermesToolParser(ToolParser):
    """Calls written as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; the
    text before the first call is the reply's content."""

    start, end = "<tool_call>", "</tool_call>"
    starts = (start,)
    _call = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)

    def extract(self, text: str) -> ExtractedToolCalls:
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
        return ExtractedToolCalls(content_before(text, text.index(self.start)), calls)
