"""``POST /v1/chat/completions``: the model's chat template turns messages into a prompt, which
is then generated like a completion.  A model without one (plain GPT-2, a random model, a
base checkpoint) gets a 400 that names it and says how to give it one (``--chat-template``)."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from cbatch.core.async_engine import AsyncEngine
from cbatch.entrypoints.llm import choice_params
from cbatch.entrypoints.openai.protocol import (ChatChoice, ChatCompletionRequest,
                                                ChatCompletionResponse, ChatDelta,
                                                ChatLogprobs, ChatLogprobToken, ChatTopLogprob,
                                                OpenAIError, _ChatTemplateFields)
from cbatch.entrypoints.openai.serving_completion import (clamp, logprob_token, open_streams,
                                                          prompt_logprobs, results,
                                                          sampling_params, sse, sse_or_error,
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
                 special_tokens: dict[str, str] | None = None, architecture: str | None = None):
        self.engine = engine
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

    def render(self, req: _ChatTemplateFields) -> str:
        """The prompt text of ``req.messages`` (a chat completion's, or /tokenize's)."""
        if self._template is None:
            arch = f" ({self.architecture})" if self.architecture else ""
            raise OpenAIError(400, f"model {self.model_name!r}{arch} has no chat template: "
                                   "its checkpoint ships none, and the server was started "
                                   "without one; give it one with `cbatch serve ... "
                                   "--chat-template FILE` (a Jinja template), or use "
                                   "/v1/completions", param="messages")
        from jinja2 import TemplateError

        try:
            return self._template.render(**{
                **self.special_tokens, **(req.chat_template_kwargs or {}),
                "messages": [m.for_template() for m in req.messages],
                "add_generation_prompt": req.add_generation_prompt})
        except TemplateError as exc:  # the messages do not fit the template: the caller's
            raise OpenAIError(400, f"the model's chat template refused these messages: {exc}",
                              param="messages") from None

    async def encode(self, req: _ChatTemplateFields, add_special_tokens: bool = False
                     ) -> list[int]:
        """The prompt's token ids: the template wrote the special tokens it wants, so none
        are added (unless asked); in a worker thread, as the engine encodes a string prompt
        (the loop serves on meanwhile)."""
        return await asyncio.to_thread(self.engine.tokenizer.encode, self.render(req),
                                       add_special_tokens=add_special_tokens)

    async def create(self, req: ChatCompletionRequest, raw_request: Request):
        prompt = await self.encode(req)
        max_tokens = (req.max_completion_tokens if req.max_completion_tokens is not None
                      else req.max_tokens)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling_params(req, logprobs, max_tokens=max_tokens)
        choices = [choice_params(params, c) for c in range(req.n)]
        streams = await open_streams(self.engine, [prompt] * req.n, choices, req.stream)
        if req.stream:
            return StreamingResponse(sse_or_error(self._stream(req, streams)),
                                     media_type="text/event-stream")
        response = await unless_disconnected(raw_request, self._full(req, streams))
        return JSONResponse(response.model_dump()) if response is not None else None

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

    async def _full(self, req: ChatCompletionRequest, streams) -> ChatCompletionResponse:
        finals: dict[int, RequestOutput] = {}
        async for i, out in results(streams):
            if out.finished:
                finals[i] = out
        choices = [ChatChoice(index=i, message=ChatDelta(role="assistant", content=out.text),
                              logprobs=self._logprobs(req, out, 0),
                              finish_reason=out.finish_reason,
                              prompt_logprobs=prompt_logprobs(out, req.prompt_logprobs,
                                                              self.engine.tokenizer))
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
        num_sent = [0] * len(streams)  # tokens whose logprobs went out
        finals: dict[int, RequestOutput] = {}
        async for i, out in results(streams):
            delta = out.text[len(sent[i]):]
            if not delta and not out.finished:
                continue  # (its tokens' logprobs go with the next chunk)
            if out.finished:
                finals[i] = out
            choice = ChatChoice(index=i, delta=ChatDelta(content=delta),
                                logprobs=self._logprobs(req, out, num_sent[i]),
                                finish_reason=out.finish_reason)
            sent[i], num_sent[i] = out.text, len(out.token_ids)
            yield sse(head.model_copy(update={"choices": [choice]}))
        if req.include_usage:
            yield sse(head.model_copy(update={"usage": usage(finals, req.n)}))
        yield "data: [DONE]\n\n"
