"""Request and response schemas of the OpenAI API subset cbatch serves (pydantic models).

Fields follow OpenAI's names and defaults; ``top_k``, ``ignore_eos`` and ``stop_token_ids``
are the usual extensions (vLLM has them too).  Unknown fields are refused, so a misspelt
parameter is a 400 that names it instead of being silently ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cbatch.sampling_params import StructuredOutputsParams


class OpenAIError(Exception):
    """An error returned in OpenAI's format: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (status, message, type,
                                                                       param, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


# -------------------------------------------------------------- structured outputs, tools

class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``."""

    model_config = ConfigDict(populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict | None = Field(default=None, alias="schema")  # ("schema" is BaseModel's)
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON
    object) or ``json_schema`` (a JSON value its schema validates)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _has_schema(self):
        if self.type == "json_schema" and (self.json_schema is None
                                           or self.json_schema.json_schema is None):
            raise ValueError('response_format of type "json_schema" needs '
                             "json_schema.schema (the JSON schema)")
        return self


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
    id: str = Field(default_factory=lambda: _id("chatcmpl-tool"))
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


def structured_outputs_of(response_format: ResponseFormat | None,
                          structured_outputs: dict | None) -> StructuredOutputsParams | None:
    """The constraint of a request: OpenAI's ``response_format`` or vLLM's
    ``structured_outputs`` (one of them), None for none; ValueError naming the field."""
    if response_format is not None and structured_outputs is not None:
        raise ValueError("give either response_format or structured_outputs, not both")
    if structured_outputs is not None:
        try:
            return StructuredOutputsParams(**structured_outputs)
        except TypeError as exc:  # an unknown key
            raise ValueError(f"structured_outputs takes json, json_object, regex, choice or "
                             f"grammar ({exc})") from None
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    return StructuredOutputsParams(json=response_format.json_schema.json_schema)


class _SamplingFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # 0 or -1: off
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=32)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None  # structured outputs, OpenAI's way
    structured_outputs: dict | None = None  # and vLLM's (json, regex, choice, grammar, ...)

    @model_validator(mode="after")
    def _supported(self):
        if self.presence_penalty or self.frequency_penalty or self.logit_bias:
            raise ValueError("presence_penalty, frequency_penalty and logit_bias are not "
                             "supported by cbatch")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def constraint(self) -> StructuredOutputsParams | None:
        """What the output must follow (``response_format`` or ``structured_outputs``)."""
        return structured_outputs_of(self.response_format, self.structured_outputs)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _completion_supported(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported by cbatch")
        if self.suffix:
            raise ValueError("suffix is not supported by cbatch")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs needs prompt logprobs, which cbatch does "
                             "not compute")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None  # None: an assistant message of tool calls alone
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's answer: to which call
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # tool calls (vLLM's rules): tool_choice defaults to "auto" with tools, else "none"
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _tool_choice(self):
        if self.tool_choice is None:
            self.tool_choice = "auto" if self.tools else "none"
        names = [t.function.name for t in self.tools or []]
        if isinstance(self.tool_choice, NamedToolChoice):
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names the function "
                                 f"{self.tool_choice.function.name!r}, which is not among "
                                 f"the tools ({', '.join(names) or 'none given'})")
        elif self.tool_choice == "required" and not names:
            raise ValueError('tool_choice "required" needs tools')
        return self

    @property
    def forces_tool_call(self) -> bool:
        """Whether structured output makes the reply a tool call (``required``, or a named
        function)."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def constraint(self) -> StructuredOutputsParams | None:
        """A forced tool call's JSON schema (:func:`~cbatch.entrypoints.openai.tool_parsers.
        tool_call_schema`), else the request's ``response_format``/``structured_outputs``."""
        if not self.forces_tool_call:
            return super().constraint()
        if self.response_format is not None or self.structured_outputs is not None:
            raise ValueError("a forced tool call (tool_choice required or a function) is "
                             "structured output already: drop response_format and "
                             "structured_outputs")
        from cbatch.entrypoints.openai.tool_parsers import tool_call_schema

        return StructuredOutputsParams(json=tool_call_schema(
            self.tools, self.tool_choice, self.parallel_tool_calls))


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("cmpl"))
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] | list[DeltaToolCall] | None = None  # message | stream chunk


class ChatChoice(BaseModel):
    index: int
    message: ChatDelta | None = None  # a whole response
    delta: ChatDelta | None = None  # a stream chunk
    logprobs: None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("chatcmpl"))
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "cbatch"
    max_model_len: int


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
