"""``POST /v1/chat/completions``: the model's chat template turns messages into a prompt, which
is then generated like a completion.  A model without one (plain GPT-2, a random model, a
base checkpoint) gets a 400 that names it and says how to give it one (``--chat-template``)."""

from __future__ import annotations

import asyncio
import functools
import json
from pathlib import Path
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from cbatch.core.async_engine import AsyncEngine
from cbatch.entrypoints.openai.chat_content import render_with_spans
from cbatch.entrypoints.openai.protocol import (ChatChoice, ChatCompletionRequest,
                                                ChatCompletionResponse, ChatDelta, OpenAIError)
from cbatch.entrypoints.openai.serving_completion import (open_streams, results, sampling_params,
                                                          sse, sse_or_error,
                                                          unless_disconnected, usage)
from cbatch.outputs import RequestOutput


def load_chat_template(checkpoint_dir: Path | None) -> str | None:
    """The Jinja chat template a checkpoint ships (``chat_template.jinja``, or the
    ``chat_template`` field of ``tokenizer_config.json``), else None."""
    if checkpoint_dir is None:
        return None
    if (checkpoint_dir / "chat_template.jinja").is_file():
        return (checkpoint_dir / "chat_template.jinja").read_text()
    config = checkpoint_dir / "tokenizer_config.json"
    if config.is_file():
        template = json.loads(config.read_text()).get("chat_template")
        return template if isinstance(template, str) else None
    return None


def load_special_tokens(checkpoint_dir: Path | None) -> dict[str, str]:
    """The ``bos_token`` and ``eos_token`` strings of ``tokenizer_config.json`` (templates
    write them into the prompt: Llama's begins with ``{{ bos_token }}``); "" when absent."""
    config = None if checkpoint_dir is None else checkpoint_dir / "tokenizer_config.json"
    raw = json.loads(config.read_text()) if config is not None and config.is_file() else {}
    tokens = {}
    for name in ("bos_token", "eos_token"):
        value = raw.get(name) or ""
        tokens[name] = value.get("content", "") if isinstance(value, dict) else value
    return tokens


def read_chat_template(value: str) -> str:
    """``--chat-template``: a file holding a Jinja template, or the template itself; checked
    (it must parse) before any model loads."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    path = Path(value)
    is_file = len(value) < 4096 and "\n" not in value and path.is_file()
    template = path.read_text() if is_file else value
    if not is_file and "{{" not in template and "{%" not in template:
        raise ValueError(f"chat template {value!r} is neither a file nor a Jinja template")
    try:
        ImmutableSandboxedEnvironment().parse(template)
    except TemplateSyntaxError as e:
        raise ValueError(f"chat template {value!r:.60} does not parse: {e}") from None
    return template


def _raise_template_error(message: str):
    from jinja2 import TemplateError

    raise TemplateError(message)


class OpenAIServingChat:
    def __init__(self, engine: AsyncEngine, model_name: str, chat_template: str | None,
                 special_tokens: dict[str, str] | None = None, architecture: str | None = None,
                 special_tokens_in_content: bool = True):
        self.engine = engine
        # False: contents are encoded as plain text (--no-special-tokens-in-content)
        self.special_tokens_in_content = special_tokens_in_content
        self.model_name = model_name
        self.architecture = architecture  # the model's class, for the no-template error
        self.special_tokens = {"bos_token": "", "eos_token": "", **(special_tokens or {})}
        self._template = None
        if chat_template is not None:
            # a sandbox, as transformers renders templates: a template is data, not code
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            # templates refuse messages they cannot render with raise_exception(message)
            # (Llama-2 and Mistral's do, for roles out of order), as in transformers
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(chat_template)

    def render(self, req: ChatCompletionRequest, messages: list[dict] | None = None) -> str:
        """The template's text for ``req`` (``messages``: these message dicts instead of
        the request's)."""
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
                messages = [m.model_dump() for m in req.messages]
            return self._template.render(messages=messages, add_generation_prompt=True,
                                         **self.special_tokens)
        except TemplateError as exc:  # the messages do not fit the template: the caller's
            raise OpenAIError(400, f"the model's chat template refused these messages: {exc}",
                              param="messages") from None

    async def create(self, req: ChatCompletionRequest, raw_request: Request):
        prompt = await self.prompt_ids(req)
        max_tokens = req.max_completion_tokens or req.max_tokens
        params = [sampling_params(req, c, max_tokens=max_tokens) for c in range(req.n)]
        streams = await open_streams(self.engine, [prompt] * req.n, params, req.stream,
                                     raw_request)
        if req.stream:
            return StreamingResponse(sse_or_error(self._stream(req, streams)),
                                     media_type="text/event-stream")
        response = await unless_disconnected(raw_request, self._full(req, streams))
        return JSONResponse(response.model_dump()) if response is not None else None

    async def prompt_ids(self, req: ChatCompletionRequest) -> list[int]:
        """The rendered template's token ids.  The template wrote the special tokens it
        wants: encoded without adding more, in a worker thread (as the engine does for a
        string prompt: the loop serves on meanwhile); without special tokens in content, the
        messages' contents are encoded as plain text (:mod:`chat_content`)."""
        tokenizer = self.engine.tokenizer
        if self.special_tokens_in_content:
            encode = functools.partial(tokenizer.encode, self.render(req),
                                       add_special_tokens=False)
        else:
            text, spans = render_with_spans(functools.partial(self.render, req),
                                            [m.model_dump() for m in req.messages])
            encode = functools.partial(tokenizer.encode_literal_spans, text, spans)
        try:
            return await asyncio.to_thread(encode)
        except ValueError as exc:  # text the tokenizer cannot take (a lone surrogate)
            raise OpenAIError(400, f"messages: {exc}", param="messages") from None

    async def _full(self, req: ChatCompletionRequest, streams) -> ChatCompletionResponse:
        finals: dict[int, RequestOutput] = {}
        async for i, out in results(streams):
            if out.finished:
                finals[i] = out
        choices = [ChatChoice(index=i, message=ChatDelta(role="assistant", content=out.text),
                              finish_reason=out.finish_reason)
                   for i, out in sorted(finals.items())]
        return ChatCompletionResponse(model=self.model_name, choices=choices,
                                      usage=usage(finals, req.n))

    async def _stream(self, req: ChatCompletionRequest, streams) -> AsyncIterator[str]:
        head = ChatCompletionResponse(model=self.model_name, choices=[],
                                      object="chat.completion.chunk")
        for i in range(len(streams)):  # OpenAI's first chunk of a choice names the role
            delta = ChatDelta(role="assistant", content="")
            yield sse(head.model_copy(update={"choices": [ChatChoice(index=i, delta=delta)]}))
        sent = [""] * len(streams)
        finals: dict[int, RequestOutput] = {}
        async for i, out in results(streams):
            delta = out.text[len(sent[i]):]
            if not delta and not out.finished:
                continue
            sent[i] = out.text
            if out.finished:
                finals[i] = out
            choice = ChatChoice(index=i, delta=ChatDelta(content=delta),
                                finish_reason=out.finish_reason)
            yield sse(head.model_copy(update={"choices": [choice]}))
        if req.include_usage:
            yield sse(head.model_copy(update={"usage": usage(finals, req.n)}))
        yield "data: [DONE]\n\n"
