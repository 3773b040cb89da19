"""Request and response schemas of the OpenAI API subset cbatch serves (pydantic models).

Fields follow OpenAI's names and defaults, with vLLM's extensions under vLLM's names
(``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``allowed_token_ids``, ``bad_words``, ...: what clients put in the openai
SDK's ``extra_body``).  The values are checked where the engine checks them, by
:class:`cbatch.SamplingParams` (:func:`cbatch.entrypoints.openai.serving_engine.sampling_params`
turns its refusals into 400s naming the field).  Fields cbatch does not know are accepted, as
vLLM accepts them, and named in a warning in the server's log (:func:`ignored_fields`).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cbatch.entrypoints.openai.limits import MAX_CHOICES, check_length
from cbatch.entrypoints.openai.response_format import ConstraintFields
from cbatch.entrypoints.openai.tools import (ChatTool, DeltaToolCall, NamedToolChoice, ToolCall,
                                             tool_call_schema)
from cbatch.sampling_params import StructuredOutputsParams


class OpenAIBaseModel(BaseModel):
    """A request body: unknown fields are kept aside (``model_extra``), not refused."""

    model_config = ConfigDict(extra="allow")


def ignored_fields(req: BaseModel) -> list[str]:
    """The top-level fields of ``req`` that cbatch does not know (the server logs them)."""
    return sorted(req.model_extra or ())


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (its choice's so far)


class _SamplingFields(ConstraintFields, OpenAIBaseModel):
    """What completions and chat completions share.  None means the default: OpenAI's
    (temperature 1; 16 tokens for completions, the rest of the context for chat) or
    :class:`cbatch.SamplingParams`' (every other field)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 or -1: off
    min_p: float | None = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    # completions: n of best_of candidates; chat: == n only
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # {"token id": bias}
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>"
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # OpenAI's end-user id: accepted, not used

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    @model_validator(mode="after")
    def _lists_within_limits(self):
        for name in ("stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words"):
            check_length(name, getattr(self, name))
        if isinstance(self.stop, list):
            check_length("stop", self.stop)
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _completion_supported(self):
        if self.suffix:
            raise ValueError("suffix is not supported by cbatch")
        return self


class ContentPart(OpenAIBaseModel):
    """One part of a message's content: cbatch serves text models, so ``{"type": "text",
    "text": ...}`` only."""

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type != "text" or self.text is None:
            raise ValueError(f"content parts of type {self.type!r} are not supported: cbatch "
                             "serves text models ({\"type\": \"text\", \"text\": ...} only)")
        return self


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message's answer to one

    def for_template(self) -> dict:
        """The message as chat templates read it (as vLLM hands it to them): its content one
        string (text parts joined by newlines, as vLLM joins them; None for an assistant's
        tool calls alone), the arguments of its tool calls as objects, not JSON text, other
        unset fields left out."""
        message = self.model_dump(exclude_none=True)
        message["content"] = ("\n".join(part.text for part in self.content)
                              if isinstance(self.content, list) else self.content)
        for call in message.get("tool_calls", []):
            try:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
            except ValueError:  # not JSON: the template gets the text
                pass
        return message


class _ChatTemplateFields(OpenAIBaseModel):
    """What renders messages through the chat template (chat completions and /tokenize)."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template
    tools: list[ChatTool] | None = None  # (/tokenize takes them too, as vLLM's)

    @model_validator(mode="after")
    def _messages_within_limits(self):
        check_length("messages", self.messages)
        return self


class ChatCompletionRequest(_SamplingFields, _ChatTemplateFields):
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens (wins)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # tool calls (vLLM's rules): tool_choice defaults to "auto" with tools, else "none"
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

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

    @property
    def forced_function(self) -> str | None:
        """The function a named ``tool_choice`` forces, else None."""
        return (self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice)
                else None)

    def constraint(self) -> StructuredOutputsParams | None:
        """A forced tool call's JSON schema (:func:`~cbatch.entrypoints.openai.tools.
        tool_call_schema`), else the request's ``response_format``/``structured_outputs``."""
        if not self.forces_tool_call:
            return super().constraint()
        if self.has_constraint:
            raise ValueError("a forced tool call (tool_choice required or a function) is "
                             "structured output already: drop response_format and "
                             "structured_outputs (and guided_*)")
        return StructuredOutputsParams(json=tool_call_schema(
            self.tools, self.tool_choice, self.parallel_tool_calls))

    def constraint_field(self) -> str | None:
        """A forced call's constraint is the tools' ``parameters`` schemas: the named tool's
        (or the only tool's), else ``tools`` (the chat route then finds the tool at fault)."""
        if not self.forces_tool_call:
            return super().constraint_field()
        names = [t.function.name for t in self.tools]
        if isinstance(self.tool_choice, NamedToolChoice):
            return f"tools[{names.index(self.tool_choice.function.name)}].function.parameters"
        return "tools[0].function.parameters" if len(names) == 1 else "tools"


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's entry of ``prompt_logprobs``: one token's log-probability at one prompt
    position; ``rank`` (1 = the most likely) where the token is among the k asked for."""

    logprob: float
    rank: int | None = None
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    # prompt_logprobs=k: per prompt token ({"token id": entry}), None for the first
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


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
    reasoning_content: str | None = None  # vLLM's, with --reasoning-parser
    tool_calls: list[ToolCall] | list[DeltaToolCall] | None = None  # message | stream chunk


class ChatTopLogprob(BaseModel):
    """OpenAI's logprob of one token: its text, its log-probability, its UTF-8 bytes (a token
    that is part of a character has them all the same; see ``cbatch.tokenizer.token_text``)."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(ChatTopLogprob):
    """A generated token and the ``top_logprobs`` most likely tokens in its place."""

    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatDelta | None = None  # a whole response
    delta: ChatDelta | None = None  # a stream chunk
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


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


class TokenizeCompletionRequest(OpenAIBaseModel):
    """``POST /tokenize`` with a prompt (vLLM's)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # e.g. a Llama tokenizer's BOS
    return_token_strs: bool = False


class TokenizeChatRequest(_ChatTemplateFields):
    """``POST /tokenize`` with messages, rendered by the chat template (vLLM's)."""

    model: str | None = None
    add_special_tokens: bool = False  # the template writes its own
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
