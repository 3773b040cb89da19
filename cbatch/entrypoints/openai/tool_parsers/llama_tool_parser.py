"""``llama3_json``: Llama 3.1's and 3.2's JSON format (vLLM's ``Llama3JsonToolParser``), as
their chat templates write a call::

    {"name": "get_weather", "parameters": {"city": "Paris"}}

perhaps after ``<|python_tag|>``, several of them separated by ``; ``; ``arguments`` may
stand for ``parameters``."""

from __future__ import annotations

import json

from cbatch.entrypoints.openai.tool_parsers.abstract_tool_parser import (ExtractedToolCalls,
                                                                          ParsedToolCall,
                                                                          ToolParser,
                                                                          content_before)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """Every JSON object of the reply (from each ``{`` not inside an earlier one) is a call
    with a ``name`` and ``parameters`` (or ``arguments``); the text before the first is the
    reply's content.  A brace that does not begin such an object leaves the whole reply as
    content."""

    starts = (PYTHON_TAG, "{")
    _decoder = json.JSONDecoder()

    def extract(self, text: str) -> ExtractedToolCalls:
        calls, first, end = [], None, -1
        at = text.find("{")
        while at >= 0:
            try:
                call, end = self._decoder.raw_decode(text, at)
                name = call["name"]
                arguments = call["arguments"] if "arguments" in call else call["parameters"]
            except (ValueError, KeyError, TypeError):  # not JSON, not a call
                return ExtractedToolCalls(text)
            if not isinstance(name, str) or not isinstance(arguments, dict):
                return ExtractedToolCalls(text)
            calls.append(ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False)))
            first = at if first is None else first
            at = text.find("{", end)
        if not calls:
            return ExtractedToolCalls(text)
        return ExtractedToolCalls(content_before(text, first, PYTHON_TAG), calls)
