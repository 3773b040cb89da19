"""``POST /v1/responses`` (OpenAI's Responses API) for text models, served as a chat
completion: the request becomes a chat request (:meth:`ResponsesRequest.to_chat`), rendered,
sampled, and read back (reasoning, tool calls) by the chat endpoint's own code, and its reply
becomes output items: a ``reasoning`` item (with ``--reasoning-parser``), a ``message`` with
one ``output_text``, ``function_call`` items.  ``text.format`` is ``response_format``, so a
JSON schema is enforced by the same grammar (a refused one is named ``text.format.schema``,
a tool's ``tools[i].parameters``).  With ``--reasoning-parser``, ``usage`` counts the
reasoning's tokens in ``output_tokens_details.reasoning_tokens``.

Streamed, it is OpenAI's event sequence (``event:`` and ``data:`` lines): response.created,
response.in_progress, then per item output_item.added, content_part.added, its deltas
(output_text / reasoning_text / function_call_arguments), their .done, content_part.done,
output_item.done, and last response.completed (response.incomplete when it reached
``max_output_tokens``)."""

from __future__ import annotations

import json
import re
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from cbatch.entrypoints.openai.protocol import ChatCompletionRequest, ChatDelta
from cbatch.entrypoints.openai.protocol_responses import (ResponsesRequest, ResponsesResponse,
                                                          ResponseUsage, item_id)
from cbatch.entrypoints.openai.serving_chat import OpenAIServingChat
from cbatch.entrypoints.openai.serving_engine import (OpenAIError, OpenAIServing, results,
                                                      unless_disconnected)
from cbatch.outputs import RequestOutput


def _usage(out: RequestOutput, reasoning) -> ResponseUsage:
    """``reasoning``: the reply's reasoning parser (None: it has no reasoning)."""
    prompt, output = len(out.prompt_token_ids), len(out.token_ids)
    thought = 0 if reasoning is None else reasoning.num_reasoning_tokens(out.token_ids)
    return ResponseUsage(input_tokens=prompt, output_tokens=output,
                         total_tokens=prompt + output,
                         output_tokens_details={"reasoning_tokens": thought})


def _finish(response: ResponsesResponse, out: RequestOutput, reasoning) -> ResponsesResponse:
    """``response`` once ``out`` is finished: its status and usage."""
    cut = out.finish_reason == "length"
    return response.model_copy(update=dict(
        status="incomplete" if cut else "completed", usage=_usage(out, reasoning),
        incomplete_details={"reason": "max_output_tokens"} if cut else None))


# chat's names of the fields a Responses request is served with -> the Responses API's own
_RESPONSES_NAMES = [
    (re.compile(r"response_format\.json_schema\.schema\b"), "text.format.schema"),
    (re.compile(r"response_format\b"), "text.format"),
    (re.compile(r"(max_completion_tokens|max_tokens)\b"), "max_output_tokens"),
    (re.compile(r"messages\b"), "input"),
    (re.compile(r"tools(?:\.(\d+)|\[(\d+)\])\.function\b"), r"tools[\1\2]"),
]
_LEADING_FIELD = re.compile(r"[A-Za-z_]\w*(?:\.\w+|\[\d+\])*")


def _renamed(field: str) -> str:
    """A chat request's field as the Responses request it came from names it."""
    for pattern, name in _RESPONSES_NAMES:
        if pattern.match(field):
            return pattern.sub(name, field, count=1)
    return field


def responses_error(exc: OpenAIError, constraint_field: str | None = None) -> OpenAIError:
    """``exc``, an error of the chat request a Responses request is served as, naming the
    Responses request's own fields: the field its message begins with, and its ``param``
    (that field when it had none).  ``constraint_field``: the Responses name of the
    request's constraint, for an output that could not follow it (the engine names it
    ``structured_outputs.<kind>``)."""
    message = exc.message
    if constraint_field is not None:
        message = re.sub(r"structured_outputs\.\w+", constraint_field, message)
    lead = _LEADING_FIELD.match(message)
    if lead is not None:
        message = _renamed(lead.group()) + message[lead.end():]
    param = _renamed(exc.param) if exc.param is not None else None
    if param is None and lead is not None and re.match(r"\w+", message).group() in (
            ResponsesRequest.model_fields):
        param = _LEADING_FIELD.match(message).group()
    if param is None and constraint_field is not None and constraint_field in message:
        param = constraint_field
    return OpenAIError(exc.status, message, exc.type, param, exc.code)


def _responses_field(chat_field: str | None, tool: bool) -> str:
    """The Responses request's name of the field that holds a constraint named
    ``chat_field`` in the chat request it is served as: ``text.format`` (json_object),
    ``text.format.schema``, or a flat tool's ``tools[i].parameters``."""
    if tool:
        return chat_field.replace(".function.parameters", ".parameters")
    return "text.format" if chat_field is None else "text.format.schema"


class _Items:
    """The output items of a reply as its chat deltas come (reasoning, content, tool calls),
    and the stream events that build them: an item is opened by its first delta and closed
    when a delta of another item comes, or at the end."""

    def __init__(self):
        self.output: list[dict] = []  # the items, closed ones whole
        self.open: dict | None = None  # the item deltas are added to now
        self.calls: dict[int, dict] = {}  # a chat delta's call index -> its item
        self.sequence = 0

    def event(self, kind: str, **fields) -> str:
        fields = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(fields, ensure_ascii=False)}\n\n"

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1}

    def _begin(self, item: dict, part: dict | None) -> list[str]:
        events = self.close()
        self.output.append(item)
        self.open = item
        events.append(self.event("response.output_item.added",
                                 output_index=len(self.output) - 1, item=item))
        if part is not None:
            item["content"].append(part)
            events.append(self.event("response.content_part.added", content_index=0,
                                     part=dict(part), **self._where()))
        return events

    def add(self, delta: ChatDelta) -> list[str]:
        events = []
        if delta.reasoning_content:
            if self.open is None or self.open["type"] != "reasoning":
                events += self._begin({"id": item_id("rs"), "type": "reasoning",
                                       "summary": [], "content": [],
                                       "status": "in_progress"},
                                      {"type": "reasoning_text", "text": ""})
            self.open["content"][0]["text"] += delta.reasoning_content
            events.append(self.event("response.reasoning_text.delta", content_index=0,
                                     delta=delta.reasoning_content, **self._where()))
        if delta.content:
            if self.open is None or self.open["type"] != "message":
                events += self._begin(*self._message())
            self.open["content"][0]["text"] += delta.content
            events.append(self.event("response.output_text.delta", content_index=0,
                                     delta=delta.content, logprobs=[], **self._where()))
        for call in delta.tool_calls or []:
            if call.id is not None:  # a call's first piece names it
                self.calls[call.index] = {
                    "id": item_id("fc"), "type": "function_call", "call_id": call.id,
                    "name": call.function.name, "arguments": "", "status": "in_progress"}
                events += self._begin(self.calls[call.index], None)
            item, piece = self.calls[call.index], call.function.arguments or ""
            if piece:
                item["arguments"] += piece
                events.append(self.event("response.function_call_arguments.delta",
                                         delta=piece, **self._where()))
        return events

    def close(self) -> list[str]:
        """The events that finish the open item."""
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": self.output.index(item)}
        item["status"] = "completed"
        if item["type"] == "function_call":
            events = [self.event("response.function_call_arguments.done",
                                 arguments=item["arguments"], **where)]
        else:
            part = item["content"][0]
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            events = [self.event(f"response.{kind}.done", content_index=0, text=part["text"],
                                 **({"logprobs": []} if kind == "output_text" else {}),
                                 **where),
                      self.event("response.content_part.done", content_index=0, part=part,
                                 **where)]
        return events + [self.event("response.output_item.done", output_index=where[
            "output_index"], item=item)]


    def empty_message(self) -> list[str]:
        """The events of an empty message (a reply with no text and no calls has one)."""
        return self._begin(*self._message()) + self.close()

    @staticmethod
    def _message() -> tuple[dict, dict]:
        return ({"id": item_id("msg"), "type": "message", "role": "assistant", "content": [],
                 "status": "in_progress"},
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []})


def output_items(message: ChatDelta) -> list[dict]:
    """A whole reply (chat's message) as output items."""
    items = _Items()
    items.add(ChatDelta(reasoning_content=message.reasoning_content,
                        content=message.content))
    items.close()
    if not message.content and not message.tool_calls:
        items.empty_message()
    items.output += [{"id": item_id("fc"), "type": "function_call", "call_id": call.id,
                      "name": call.function.name, "arguments": call.function.arguments,
                      "status": "completed"} for call in message.tool_calls or []]
    return items.output


class OpenAIServingResponses(OpenAIServing):
    def __init__(self, chat: OpenAIServingChat):
        super().__init__(chat.engine, chat.model_name)
        self.chat = chat  # renders, samples and reads replies back

    async def create(self, req: ResponsesRequest, raw_request: Request):
        try:
            chat_req = req.to_chat()
        except ValueError as exc:
            raise responses_error(OpenAIError(400, str(exc))) from None
        field = _responses_field(chat_req.constraint_field(), chat_req.forces_tool_call)
        try:
            return await self._create(req, chat_req, field, raw_request)
        except OpenAIError as exc:
            raise responses_error(exc, field) from None

    async def _create(self, req: ResponsesRequest, chat_req: ChatCompletionRequest,
                      field: str, raw_request: Request):
        prompt, params, reasoning = await self.chat.prepare(chat_req)
        try:
            streams = await self.open([prompt], params, 1, req.stream, raw_request, field)
        except OpenAIError as exc:
            if exc.param != "tools":
                raise
            exc = await self.chat.name_broken_tool(chat_req, exc)  # the one at fault
            field = _responses_field(exc.param, True)
            raise OpenAIError(400, exc.message.replace(exc.param, field), param=field) from None
        response = ResponsesResponse.of(req, self.model_of(req))
        if req.stream:
            return StreamingResponse(self._stream(chat_req, streams, response, reasoning,
                                                  field), media_type="text/event-stream")
        final = await unless_disconnected(raw_request, self._final(streams))
        if final is None:
            return None
        message, _ = self.chat.reply(chat_req, final, reasoning)
        response = _finish(response, final, reasoning).model_copy(
            update={"output": output_items(message)})
        return JSONResponse(response.model_dump())

    @staticmethod
    async def _final(streams) -> RequestOutput:
        async for _, out in results(streams):
            if out.finished:
                return out

    async def _stream(self, chat_req: ChatCompletionRequest, streams,
                      response: ResponsesResponse, reasoning, field: str
                      ) -> AsyncIterator[str]:
        items = _Items()
        snapshot = response.model_dump()
        yield items.event("response.created", response=snapshot)
        yield items.event("response.in_progress", response=snapshot)
        choice = self.chat.choice_stream(chat_req, reasoning)
        try:
            async for _, out in results(streams):
                for delta in choice.deltas(out):
                    for event in items.add(delta):
                        yield event
                if out.finished:
                    for event in items.close():
                        yield event
                    if not any(item["type"] != "reasoning" for item in items.output):
                        for event in items.empty_message():
                            yield event
                    done = _finish(response, out, reasoning).model_copy(
                        update={"output": items.output})
                    kind = "completed" if done.status == "completed" else "incomplete"
                    yield items.event(f"response.{kind}", response=done.model_dump())
        except OpenAIError as exc:  # the status line is sent already
            exc = responses_error(exc, field)
            yield items.event("error", code=exc.code or exc.type, message=exc.message,
                              param=exc.param)
