"""OpenAI's Responses API (``POST /v1/responses``) for text models: the request, the chat
request it is served as (:meth:`ResponsesRequest.to_chat`), and the response's shapes (its
output items, usage, and the ``response.*`` stream events are built in
:mod:`~cbatch.entrypoints.openai.serving_responses`).

The server keeps nothing between requests: ``previous_response_id`` is refused (send the
conversation in ``input``), and a response reports ``store: false`` whatever was asked."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from cbatch.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIBaseModel


class ResponsesRequest(OpenAIBaseModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None  # a system message before the input
    max_output_tokens: int | None = None  # None: the rest of the context, as chat
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None  # (vLLM's)
    tools: list[dict[str, Any]] | None = None  # {"type": "function", "name", "parameters"}
    tool_choice: str | dict[str, Any] | None = None  # none, auto, required, a function
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None  # {"format": {"type": text|json_object|json_schema}}
    stream: bool = False
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None  # (effort: the template decides, not the server)
    include: list[str] | None = None

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request this is served as (whose checks bound it: input items become at
        most as many messages as chat takes); ValueError naming the field it cannot take."""
        if self.previous_response_id is not None:
            raise ValueError("previous_response_id: this server keeps no responses (it is "
                             "stateless): send the whole conversation in input")
        messages = [] if self.instructions is None else [
            {"role": "system", "content": self.instructions}]
        messages += _messages(self.input)
        tools = [_chat_tool(t, i) for i, t in enumerate(self.tools or [])]
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise ValueError('tool_choice must be "none", "auto", "required" or '
                                 '{"type": "function", "name": ...}')
            choice = {"type": "function", "function": {"name": choice["name"]}}
        fields = dict(messages=messages, tools=tools or None, tool_choice=choice,
                      parallel_tool_calls=self.parallel_tool_calls,
                      max_completion_tokens=self.max_output_tokens,
                      temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                      response_format=_response_format(self.text), stream=self.stream)
        try:
            return ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(str(p) for p in error["loc"])
            message = error["msg"].removeprefix("Value error, ")
            raise ValueError(f"{where}: {message}" if where else message) from None


def _text(content, where: str) -> str:
    """A message's content: a string, or its text parts (input_text, output_text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of text parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(
                part.get("text"), str):
            raise ValueError(f"{where}.content: parts of type {kind!r} are not supported: "
                             "cbatch serves text models (input_text and output_text only)")
        texts.append(part["text"])
    return "\n".join(texts)


def _messages(input: str | list[dict]) -> list[dict]:
    """``input`` as chat messages: message items as they are, ``function_call`` items as an
    assistant's tool calls (consecutive ones in one message), ``function_call_output`` items
    as tool messages; earlier ``reasoning`` items are left out (templates drop them)."""
    if isinstance(input, str):
        return [{"role": "user", "content": input}]
    messages = []
    for i, item in enumerate(input):
        where, kind = f"input.{i}", item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ValueError(f"{where}.role must be user, assistant, system or developer, "
                                 f"got {role!r}")
            # (OpenAI's developer messages are what chat templates call system messages)
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise ValueError(f"{where}: a function_call item needs call_id, name and "
                                 "arguments (strings)")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or output is None:
                raise ValueError(f"{where}: a function_call_output item needs call_id and "
                                 "output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(output, where)})
        elif kind != "reasoning":
            raise ValueError(f"{where}: input items of type {kind!r} are not supported "
                             "(message, function_call, function_call_output)")
    if not messages:
        raise ValueError("input has no messages")
    return messages


def _chat_tool(tool: dict, index: int) -> dict:
    """A Responses function tool (flat: name, parameters) as chat's (under "function")."""
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise ValueError(f"tools[{index}]: only function tools are supported (type "
                         f"\"function\" with a name, a string), got type {tool.get('type')!r} "
                         f"named {tool.get('name')!r:.80}")
    return {"type": "function", "function": {
        k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}}


def _response_format(text: dict | None) -> dict | None:
    """``text.format`` as chat's ``response_format``; ValueError naming ``text.format`` (or
    the part of it) when it is not one."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ValueError(f"text.format must be an object, {{\"type\": \"text\"}}, "
                         f"{{\"type\": \"json_object\"}} or {{\"type\": \"json_schema\", "
                         f"\"schema\": {{...}}}}, got {fmt!r:.80}")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise ValueError(f"text.format.type must be text, json_object or json_schema, got "
                         f"{kind!r:.80}")
    if not isinstance(fmt.get("schema"), dict):
        raise ValueError('text.format.schema must be a JSON schema (an object) for type '
                         f'"json_schema", got {fmt.get("schema")!r:.80}')
    return {"type": "json_schema", "json_schema": {
        k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}}


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict = Field(default_factory=lambda: {"cached_tokens": 0})
    # reasoning_tokens: the reply's thinking (with --reasoning-parser), counted in output_tokens
    output_tokens_details: dict = Field(default_factory=lambda: {"reasoning_tokens": 0})


class ResponsesResponse(BaseModel):
    """A response object, as the openai SDK's ``Response`` reads it."""

    id: str = Field(default_factory=lambda: item_id("resp"))
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    model: str
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    output: list[dict] = Field(default_factory=list)
    error: dict | None = None
    incomplete_details: dict | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict | None = None
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    reasoning: dict | None = None
    store: bool = False
    temperature: float | None = None
    top_p: float | None = None
    text: dict = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict = "auto"
    tools: list[dict] = Field(default_factory=list)
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None

    @classmethod
    def of(cls, req: ResponsesRequest, model: str) -> ResponsesResponse:
        """An in-progress response to ``req``, echoing its settings as OpenAI does."""
        return cls(model=model, instructions=req.instructions,
                   max_output_tokens=req.max_output_tokens, metadata=req.metadata,
                   parallel_tool_calls=req.parallel_tool_calls, reasoning=req.reasoning,
                   temperature=req.temperature, top_p=req.top_p,
                   text=req.text or {"format": {"type": "text"}},
                   tool_choice=req.tool_choice or ("auto" if req.tools else "none"),
                   tools=req.tools or [], user=req.user)
