"""The tools of chat completions, in OpenAI's shapes: the request's function definitions and
``tool_choice``, the reply's calls (whole, and as stream deltas), and the JSON schema a forced
call's output follows (:func:`tool_call_schema`), which structured output enforces."""

from __future__ import annotations

import uuid
from typing import Literal

from pydantic import BaseModel, Field


class FunctionDefinition(BaseModel):
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice={"type": "function", "function": {"name": ...}}``: call this one."""

    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of a tool call in a stream chunk: the first names it (id, name), the next
    ones add to its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


def tool_parameters(tool: ChatTool) -> dict:
    # a function without parameters takes an empty object
    return tool.function.parameters or {"type": "object", "properties": {}}


def tool_call_schema(tools: list[ChatTool], tool_choice: str | NamedToolChoice,
                     parallel_tool_calls: bool = True) -> dict:
    """The JSON schema of a forced tool call's output: the named function's arguments
    object; for ``"required"``, an array of ``{"name": <a tool's name>, "arguments": <its
    arguments object>}`` with at least one item (exactly one when ``parallel_tool_calls`` is
    false)."""
    if not isinstance(tool_choice, str):
        tool = next(t for t in tools if t.function.name == tool_choice.function.name)
        return tool_parameters(tool)
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t.function.name]},
                             "arguments": tool_parameters(t)},
              "required": ["name", "arguments"]} for t in tools]
    array = {"type": "array", "minItems": 1,
             "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel_tool_calls:
        array["maxItems"] = 1
    return array
