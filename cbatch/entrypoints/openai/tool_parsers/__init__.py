"""Tool calls in the model's output, as vLLM reads them (vLLM's ``tool_parsers/``; this
package reads output only: the tools' shapes and the schema of a forced call are
:mod:`~cbatch.entrypoints.openai.tools`).

- ``tool_choice="required"`` or a named function: structured output guarantees the call
  (:func:`~cbatch.entrypoints.openai.tools.tool_call_schema`), and :func:`forced_tool_calls`
  reads the calls back.
- ``tool_choice="auto"`` (``--enable-auto-tool-choice --tool-call-parser NAME``): the model
  decides, writing calls in its chat format; a parser of :data:`TOOL_PARSERS` finds them:
  ``hermes`` (Qwen2, Qwen2.5, Qwen3, Hermes), ``llama3_json`` (Llama 3.1, 3.2), ``mistral``
  (Mistral), ``pythonic`` (Llama 3.2's and Llama 4's pythonic templates).  Each module
  says its format.

Imports nothing but the standard library (the command line lists the parsers' names).
"""

from __future__ import annotations

import json

from cbatch.entrypoints.openai.tool_parsers.abstract_tool_parser import (ExtractedToolCalls,
                                                                          ParsedToolCall,
                                                                          ToolParser)
from cbatch.entrypoints.openai.tool_parsers.hermes_tool_parser import HermesToolParser
from cbatch.entrypoints.openai.tool_parsers.llama_tool_parser import Llama3JsonToolParser
from cbatch.entrypoints.openai.tool_parsers.mistral_tool_parser import MistralToolParser
from cbatch.entrypoints.openai.tool_parsers.pythonic_tool_parser import PythonicToolParser

__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "HermesToolParser", "Llama3JsonToolParser",
           "MistralToolParser", "ParsedToolCall", "PythonicToolParser", "ToolParser",
           "forced_tool_calls"]

# --tool-call-parser NAME -> its parser (vLLM's names)
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
}


def forced_tool_calls(text: str, function: str | None) -> list[ParsedToolCall]:
    """The calls in the output of a forced tool call: of ``function`` (a named tool choice;
    the output is its arguments object), or, with None (``"required"``), the list of calls
    the output is; ValueError if it is not complete (the output reached ``max_tokens``)."""
    if function is not None:
        json.loads(text)  # the whole object is there
        return [ParsedToolCall(function, text)]
    return [ParsedToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False))
            for c in json.loads(text)]
