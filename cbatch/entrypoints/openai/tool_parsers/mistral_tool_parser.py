"""``mistral``: Mistral's format (vLLM's ``MistralToolParser``), after its ``[TOOL_CALLS]``
token, as Mistral's chat templates write calls: a JSON list (Mistral 7B Instruct v0.3, and
every tokenizer before v11)::

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]

or one marker per call (v11 and later: Mistral Small 3.x, Devstral)::

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}

``[TOOL_CALLS]`` is a special token, so a reply keeps its special tokens to be read, and a
call's id is 9 letters and digits, which Mistral's templates require of the history."""

from __future__ import annotations

import json

from cbatch.entrypoints.openai.tool_parsers.abstract_tool_parser import (ExtractedToolCalls,
                                                                          ParsedToolCall,
                                                                          ToolParser,
                                                                          content_before,
                                                                          mistral_call_id)

BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser(ToolParser):
    """The calls after ``[TOOL_CALLS]``; the text before it is the reply's content."""

    starts = (BOT,)
    keeps_special_tokens = True
    _decoder = json.JSONDecoder()

    def extract(self, text: str) -> ExtractedToolCalls:
        if BOT not in text:
            return ExtractedToolCalls(text)
        pieces = [p.strip() for p in text.split(BOT)[1:]]
        try:
            if len(pieces) == 1 and pieces[0].startswith("["):  # [{"name", "arguments"}]
                listed = self._decoder.raw_decode(pieces[0])[0]
                calls = [(c["name"], c["arguments"]) for c in listed]
            else:  # name[ARGS]{...} (or name{...}), one per marker
                calls = [self._named(piece) for piece in pieces]
        except (ValueError, KeyError, TypeError, IndexError):
            return ExtractedToolCalls(text)
        if not calls or any(not isinstance(name, str) or not name
                            or not isinstance(arguments, dict) for name, arguments in calls):
            return ExtractedToolCalls(text)
        return ExtractedToolCalls(content_before(text, text.index(BOT)), [
            ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False), mistral_call_id())
            for name, arguments in calls])

    def _named(self, piece: str) -> tuple[str, object]:
        name, marker, arguments = piece.partition(ARGS)
        if not marker:
            name, brace, rest = piece.partition("{")
            arguments = brace + rest
        return name.strip(), self._decoder.raw_decode(arguments.strip())[0]
