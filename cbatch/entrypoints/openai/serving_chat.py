"""``POST /v1/chat/completions``: the model's chat template turns messages into a prompt, which
is then generated like a completion.  A model without one (plain GPT-2, a random model, a
base checkpoint) gets a 400 that names it and says how to give it one (``--chat-template``).

Tool calls (:mod:`~cbatch.entrypoints.openai.tool_parsers`): the template gets the tools
(``tools=``) and the history's calls and answers; a forced call (``tool_choice`` required or a
function) is structured output, and ``auto`` finds the calls the model wrote with the server's
``--tool-call-parser``.  Either way the reply's calls come back as ``message.tool_calls``
(``finish_reason`` "tool_calls"), or, streamed, as OpenAI's tool-call deltas.  With
``--reasoning-parser`` (:mod:`~cbatch.entrypoints.openai.reasoning_parsers`), a reply's
``<think>`` block is its ``reasoning_content`` and the calls are looked for after it; a
constrained reply (structured output, a forced call) thinks first, its grammar applying
once ``</think>`` is written, unless the prompt closed the block.

A request without ``max_tokens`` (or ``max_completion_tokens``) may use the rest of the
context, as in vLLM and OpenAI."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from cbatch.core.async_engine import AsyncEngine
from cbatch.core.structured_output import Refused
from cbatch.entrypoints.openai.chat_content import render_with_spans
from cbatch.entrypoints.openai.chat_utils import compile_chat_template
from cbatch.entrypoints.openai.protocol import (ChatChoice, ChatCompletionRequest,
                                                ChatCompletionResponse, ChatDelta, ChatLogprobs,
                                                ChatLogprobToken, ChatTopLogprob,
                                                _ChatTemplateFields, _id)
from cbatch.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from cbatch.entrypoints.openai.serving_engine import (OpenAIError, OpenAIServing,
                                                      chunk_usage, clamp, logprob_token,
                                                      prompt_logprobs, results,
                                                      sampling_params, sse, sse_or_error,
                                                      unless_disconnected, usage)
from cbatch.entrypoints.openai.tools import (DeltaFunctionCall, DeltaToolCall, FunctionCall,
                                             NamedToolChoice, ToolCall, tool_parameters)
from cbatch.entrypoints.openai.tool_parsers import (TOOL_PARSERS, ParsedToolCall,
                                                    forced_tool_calls)
from cbatch.outputs import RequestOutput
from cbatch.sampling_params import SamplingParams, StructuredOutputsParams
from cbatch.tokenizer import check_text_fits


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine: AsyncEngine, model_name: str, chat_template: str | None,
                 special_tokens: dict[str, str] | None = None, architecture: str | None = None,
                 tool_call_parser: str | None = None, special_tokens_in_content: bool = True,
                 reasoning_parser: str | None = None):
        super().__init__(engine, model_name)
        # tool_choice "auto" (--enable-auto-tool-choice --tool-call-parser NAME): None = off
        self.tool_parser = None if tool_call_parser is None else TOOL_PARSERS[tool_call_parser]()
        # --reasoning-parser NAME: <think>...</think> is reasoning_content; None = off
        self.reasoning_parser = (None if reasoning_parser is None else REASONING_PARSERS[
            reasoning_parser](getattr(engine, "tokenizer", None)))
        # False: contents are encoded as plain text (--no-special-tokens-in-content)
        self.special_tokens_in_content = special_tokens_in_content
        self.architecture = architecture  # the model's class, for the no-template error
        self.special_tokens = {"bos_token": "", "eos_token": "", **(special_tokens or {})}
        self._template = None if chat_template is None else compile_chat_template(chat_template)

    def render(self, req: _ChatTemplateFields, messages: list[dict] | None = None) -> str:
        """The prompt text of ``req.messages`` (a chat completion's, or /tokenize's);
        ``messages``: these message dicts (:meth:`ChatMessage.for_template`'s) instead."""
        if self._template is None:
            arch = f" ({self.architecture})" if self.architecture else ""
            raise OpenAIError(400, f"model {self.model_name!r}{arch} has no chat template: "
                                   "its checkpoint ships none, and the server was started "
                                   "without one; give it one with `cbatch serve ... "
                                   "--chat-template FILE` (a Jinja template), or use "
                                   "/v1/completions", param="messages")
        from jinja2 import TemplateError

        try:
            if messages is None:
                messages = [m.for_template() for m in req.messages]
            tools = req.tools  # (a chat completion's, or /tokenize's)
            return self._template.render(**{
                **self.special_tokens, **(req.chat_template_kwargs or {}),
                "messages": messages,
                "tools": [t.model_dump(exclude_none=True) for t in tools] if tools else None,
                "add_generation_prompt": req.add_generation_prompt})
        except TemplateError as exc:  # the messages do not fit the template: the caller's
            raise OpenAIError(400, f"the model's chat template refused these messages: {exc}",
                              param="messages") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            # the template's own code tripped on what the messages hold (it concatenates a
            # message's "content": null, say): still the caller's to change
            raise OpenAIError(400, f"the model's chat template could not render these "
                                   f"messages ({type(exc).__name__}: {exc})",
                              param="messages") from None

    def _auto_tools(self, req: ChatCompletionRequest) -> bool:
        """Whether the reply is searched for the calls the model chose to make."""
        return bool(req.tools) and req.tool_choice == "auto" and self.tool_parser is not None

    async def prepare(self, req: ChatCompletionRequest):
        """A chat request's prompt ids, its choices' params, and how its replies are read for
        their reasoning (:meth:`reasoning_of`): chat's and the Responses API's."""
        if req.tools and req.tool_choice == "auto" and self.tool_parser is None:
            raise OpenAIError(400, '"auto" tool choice requires the server to run with '
                                   "--enable-auto-tool-choice and --tool-call-parser (or ask "
                                   'for tool_choice "required", "none" or a function)',
                              param="tool_choice")
        prompt = await self.prompt_ids(req)
        max_tokens = (req.max_completion_tokens if req.max_completion_tokens is not None
                      else req.max_tokens)
        if max_tokens is None:  # chat's default, vLLM's and OpenAI's: the rest of the context
            max_tokens = max(self.engine.max_model_len - len(prompt), 1)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling_params(req, logprobs, max_tokens=max_tokens)
        if self._auto_tools(req) and self.tool_parser.keeps_special_tokens:
            # (its calls begin with a special token: mistral's [TOOL_CALLS], as vLLM keeps it)
            params = dataclasses.replace(params, skip_special_tokens=False)
        return prompt, params, self.reasoning_of(prompt, params)

    def reasoning_of(self, prompt: list[int], params: SamplingParams):
        """The reasoning parser of the replies to ``prompt`` (None: they are all content: no
        parser, or the prompt's last think tag closes the block).  A constraint then waits
        for the reasoning's end (``params.structured_outputs.reasoning_end``), and its reply
        is reasoning up to it (vLLM's rule)."""
        parser = self.reasoning_parser
        if parser is None or parser.prompt_ends_reasoning(prompt):
            return None
        if params.structured_outputs is None:
            return parser
        params.structured_outputs.reasoning_end = list(parser.end_ids)
        return parser.gated()

    async def create(self, req: ChatCompletionRequest, raw_request: Request):
        prompt, params, reasoning = await self.prepare(req)
        try:
            streams = await self.open([prompt], params, req.n, req.stream, raw_request,
                                      req.constraint_field())
        except OpenAIError as exc:
            if exc.param == "tools":  # the tools' schemas together: find the one at fault
                raise await self.name_broken_tool(req, exc) from None
            raise
        if req.stream:
            return StreamingResponse(sse_or_error(self._stream(req, streams, len(prompt),
                                                               reasoning)),
                                     media_type="text/event-stream")
        response = await unless_disconnected(raw_request, self._full(req, streams, reasoning))
        return JSONResponse(response.model_dump()) if response is not None else None

    async def name_broken_tool(self, req: ChatCompletionRequest, error: OpenAIError
                                ) -> OpenAIError:
        """``error`` (the forced call's schema, every tool's parameters in one, is refused)
        naming the first tool whose parameters schema does not parse, when one does not."""
        schemas = [StructuredOutputsParams(json=tool_parameters(t)) for t in req.tools]
        try:
            await asyncio.wrap_future(self.engine.first_invalid(schemas))
        except Refused as exc:
            field = f"tools[{exc.index}].function.parameters"
            return OpenAIError(400, f"{field} {exc.problem}", param=field)
        return error

    def _logprobs(self, req: ChatCompletionRequest, out: RequestOutput, start: int
                  ) -> ChatLogprobs | None:
        """OpenAI's logprobs of ``out``'s tokens from ``start`` on (None unless asked): each
        token, and the ``top_logprobs`` most likely in its place, most likely first."""
        if not req.logprobs:
            return None
        tokenizer, k, as_ids = (self.engine.tokenizer, req.top_logprobs or 0,
                                req.return_tokens_as_token_ids)

        def entry(token: int, logprob: float) -> dict:
            text, raw = logprob_token(tokenizer, token, as_ids)
            return {"token": text, "logprob": clamp(logprob), "bytes": list(raw)}

        # each dict: the k most likely, most likely first, then the sampled token if it is
        # not among them
        return ChatLogprobs(content=[ChatLogprobToken(
            **entry(token, alternatives[token]),
            top_logprobs=[ChatTopLogprob(**entry(t, lp))
                          for t, lp in itertools.islice(alternatives.items(), k)])
            for token, alternatives in zip(out.token_ids[start:], out.logprobs[start:])])

    async def prompt_ids(self, req: _ChatTemplateFields, add_special_tokens: bool = False
                         ) -> list[int]:
        """The rendered template's token ids (a chat completion's, or /tokenize's).  The
        template wrote the special tokens it wants: encoded without adding more (unless
        asked), in a worker thread (as the engine does for a string prompt: the loop serves
        on meanwhile); without special tokens in content, the messages' contents are encoded
        as plain text (:mod:`chat_content`)."""
        tokenizer = self.engine.tokenizer
        if self.special_tokens_in_content:
            text = self.render(req)
            encode = functools.partial(tokenizer.encode, text,
                                       add_special_tokens=add_special_tokens)
        else:
            text, spans = render_with_spans(functools.partial(self.render, req),
                                            [m.for_template() for m in req.messages])
            encode = functools.partial(tokenizer.encode_literal_spans, text, spans)
        try:
            check_text_fits(text, tokenizer, self.engine.max_model_len,
                            "the rendered messages")
            return await asyncio.to_thread(encode)
        except ValueError as exc:  # too long, or text the tokenizer cannot take
            raise OpenAIError(400, f"messages: {exc}", param="messages") from None

    async def _full(self, req: ChatCompletionRequest, streams, reasoning
                    ) -> ChatCompletionResponse:
        finals: dict[int, RequestOutput] = {}
        async for i, out in results(streams):
            if out.finished:
                finals[i] = out
        choices = [ChatChoice(index=i, message=message, finish_reason=reason,
                              logprobs=self._logprobs(req, out, 0),
                              prompt_logprobs=prompt_logprobs(out, req.prompt_logprobs,
                                                              self.engine.tokenizer))
                   for i, out in sorted(finals.items())
                   for message, reason in [self.reply(req, out, reasoning)]]
        return ChatCompletionResponse(model=self.model_of(req), choices=choices,
                                      usage=usage(finals, req.n))

    def choice_stream(self, req: ChatCompletionRequest, reasoning=None) -> _ChoiceStream:
        """What one choice of ``req`` streams, as its output grows (``reasoning``: its
        :meth:`reasoning_of`)."""
        return _ChoiceStream(req, self.tool_parser if self._auto_tools(req) else None,
                             reasoning)

    async def _stream(self, req: ChatCompletionRequest, streams, num_prompt_tokens: int,
                      reasoning) -> AsyncIterator[str]:
        head = ChatCompletionResponse(model=self.model_of(req), choices=[],
                                      object="chat.completion.chunk")
        usage_of = ((lambda out: chunk_usage(num_prompt_tokens, out)) if req.continuous_usage
                    else lambda out: None)
        for i in range(len(streams)):  # OpenAI's first chunk of a choice names the role
            delta = ChatDelta(role="assistant", content="")
            yield sse(head.model_copy(update={"choices": [ChatChoice(index=i, delta=delta)],
                                              "usage": usage_of(None)}))
        choice_streams = [self.choice_stream(req, reasoning) for _ in streams]
        num_sent = [0] * len(streams)  # tokens whose logprobs went out
        finals: dict[int, RequestOutput] = {}
        async for i, out in results(streams):
            deltas = choice_streams[i].deltas(out)
            if out.finished:
                finals[i] = out
                deltas = deltas or [ChatDelta(content="")]
            if not deltas:
                continue  # (its tokens' logprobs go with the next chunk)
            logprobs = self._logprobs(req, out, num_sent[i])  # with the first delta
            num_sent[i] = len(out.token_ids)
            for k, delta in enumerate(deltas):
                last = out.finished and k == len(deltas) - 1
                choice = ChatChoice(index=i, delta=delta, logprobs=None if k else logprobs,
                                    finish_reason=(choice_streams[i].finish_reason(out)
                                                   if last else None))
                yield sse(head.model_copy(update={"choices": [choice],
                                                  "usage": usage_of(out)}))
        if req.include_usage:
            yield sse(head.model_copy(update={"usage": usage(finals, req.n)}))
        yield "data: [DONE]\n\n"

    def reply(self, req: ChatCompletionRequest, out: RequestOutput, parser=None
              ) -> tuple[ChatDelta, str | None]:
        """A finished output as the assistant's message, and its finish_reason ("tool_calls"
        when it holds calls): its reasoning first (``parser``: its :meth:`reasoning_of`),
        then the calls in the rest (none in a reply cut off while it reasoned)."""
        reasoning, content, calls = None, out.text, []
        if parser is not None:
            reasoning, content = parser.split(out.text)
            content = content or (None if reasoning is not None else content)
        if req.forces_tool_call and content is not None:
            try:
                content, calls = None, forced_tool_calls(content, req.forced_function)
            except ValueError:  # cut off by max_tokens: the text as it is
                pass
        elif self._auto_tools(req) and content:
            extracted = self.tool_parser.extract(content)
            content, calls = extracted.content, extracted.tool_calls
            calls = calls if req.parallel_tool_calls else calls[:1]
        message = ChatDelta(role="assistant", content=content, reasoning_content=reasoning)
        if not calls:
            return message, out.finish_reason
        message.tool_calls = [ToolCall(**({"id": c.id} if c.id else {}), function=FunctionCall(
            name=c.name, arguments=c.arguments)) for c in calls]
        return message, "tool_calls" if out.finish_reason == "stop" else out.finish_reason


def _call_deltas(calls: list[ParsedToolCall]) -> ChatDelta:
    return ChatDelta(tool_calls=[DeltaToolCall(
        index=k, id=c.id or _id("chatcmpl-tool"), type="function",
        function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
        for k, c in enumerate(calls)])


class _ChoiceStream:
    """What one choice of a chat stream sends as its output grows: its text as content
    deltas; a named function's arguments as argument deltas of one call; the calls of
    "required" once the output is complete; with ``parser`` (tool_choice "auto"), the content
    up to where a call starts, then the calls once the output is complete.  With
    ``reasoning`` (a reasoning parser), the thinking first, as ``reasoning_content`` deltas,
    and all that of what follows it."""

    def __init__(self, req: ChatCompletionRequest, parser, reasoning=None):
        self.req, self.parser, self.reasoning = req, parser, reasoning
        self.sent = 0  # characters of the output's text sent (or, for a call, consumed)
        self.reasoning_sent = 0  # characters of its reasoning sent
        self.has_calls = False

    def deltas(self, out: RequestOutput) -> list[ChatDelta]:
        if self.reasoning is None:
            return self._deltas(out.text, out.finished)
        reasoning, content = self.reasoning.split(out.text, out.finished)
        piece = (reasoning or "")[self.reasoning_sent:]
        self.reasoning_sent += len(piece)
        deltas = [ChatDelta(reasoning_content=piece)] if piece else []
        return deltas + (self._deltas(content, out.finished) if content or out.finished
                         else [])

    def _deltas(self, text: str, finished: bool) -> list[ChatDelta]:
        choice = self.req.tool_choice
        if isinstance(choice, NamedToolChoice):
            piece, first = text[self.sent:], self.sent == 0 and not self.has_calls
            if first and not piece:  # (no call before its arguments begin)
                return []
            self.sent, self.has_calls = len(text), True
            if first:
                return [_call_deltas([ParsedToolCall(choice.function.name, piece)])]
            return [ChatDelta(tool_calls=[DeltaToolCall(
                index=0, function=DeltaFunctionCall(arguments=piece))])] if piece else []
        if choice == "required":
            if not finished or not text:
                return []
            try:
                calls = forced_tool_calls(text, self.req.forced_function)
            except ValueError:  # cut off by max_tokens: the text as it is
                return [ChatDelta(content=text)]
            self.has_calls = True
            return [_call_deltas(calls)]
        end, calls = len(text), []
        if self.parser is not None:
            end = self.parser.content_end(text)
            if finished:
                calls = self.parser.extract(text).tool_calls
                calls = calls if self.req.parallel_tool_calls else calls[:1]
                if not calls:
                    end = len(text)
        piece, self.sent = text[self.sent:end], max(self.sent, end)
        deltas = [ChatDelta(content=piece)] if piece else []
        if calls:
            self.has_calls = True
            deltas.append(_call_deltas(calls))
        return deltas

    def finish_reason(self, out: RequestOutput) -> str | None:
        return "tool_calls" if self.has_calls and out.finish_reason == "stop" else (
            out.finish_reason)
