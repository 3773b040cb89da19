"""``pythonic``: calls as a Python list of function calls (vLLM's ``PythonicToolParser``),
as Llama 3.2's and Llama 4's pythonic chat templates ask for::

    [get_weather(city="Paris", unit="c"), get_time(zone="CET")]

(Llama 4 may wrap it in ``<|python_start|>`` and ``<|python_end|>``).  The whole reply must
be the list; it is read by Python's parser, never run, and an argument must be a literal
(a string, a number, True, False, None, a list or a dict of them)."""

from __future__ import annotations

import ast
import json

from cbatch.entrypoints.openai.tool_parsers.abstract_tool_parser import (ExtractedToolCalls,
                                                                          ParsedToolCall,
                                                                          ToolParser,
                                                                          partial_suffix)

START, END = "<|python_start|>", "<|python_end|>"


class PythonicToolParser(ToolParser):
    """A reply that is ``[f(a=1), g(b="x")]``, whole; any other is content."""

    def extract(self, text: str) -> ExtractedToolCalls:
        body = text.strip().removeprefix(START).removesuffix(END).strip()
        if not (body.startswith("[") and body.endswith("]")):
            return ExtractedToolCalls(text)
        try:
            calls = ast.parse(body, mode="eval").body
            if not isinstance(calls, ast.List) or not calls.elts:
                return ExtractedToolCalls(text)
            parsed = [self._call(call) for call in calls.elts]
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return ExtractedToolCalls(text)
        return ExtractedToolCalls(None, parsed)

    @staticmethod
    def _call(call: ast.expr) -> ParsedToolCall:
        if (not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args
                or any(keyword.arg is None for keyword in call.keywords)):
            raise ValueError("not a call of a function by keywords")
        arguments = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
        return ParsedToolCall(call.func.id, json.dumps(arguments, ensure_ascii=False))

    def content_end(self, text: str) -> int:
        """While streaming: none of a reply that may be the list of calls, all of another."""
        body = text.lstrip()
        may_be_calls = (body.startswith(("[", START)) or not body
                        or partial_suffix(body, START) == len(body))
        return 0 if may_be_calls else len(text)
