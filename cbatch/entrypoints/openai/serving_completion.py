"""``POST /v1/completions`` over the AsyncEngine: prompts in, choices (or SSE chunks) out."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from cbatch.core.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestStream
from cbatch.entrypoints.llm import choice_params
from cbatch.entrypoints.openai.limits import check_length
from cbatch.entrypoints.openai.protocol import (CompletionChoice, CompletionLogprobs,
                                                CompletionRequest, CompletionResponse,
                                                OpenAIError, PromptLogprob, UsageInfo,
                                                _SamplingFields)
from cbatch.outputs import RequestOutput
from cbatch.sampling_params import SamplingParams
from cbatch.tokenizer import Tokenizer, token_text

# the fields an engine's refusal of a request may name (``param`` of its 400)
REQUEST_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) | {
    "prompt", "messages", "logprobs", "top_logprobs"}
# what a client hears when the engine failed (the failure itself is in the server's log)
ENGINE_UNAVAILABLE = "the engine is not available; see the server log"


def sampling_params(req: _SamplingFields, logprobs: int | None = None,
                    max_tokens: int | None = None) -> SamplingParams:
    """The engine's params for a request's choices (each choice runs as
    ``choice_params(params, i)``: seed + i).  Every check is :class:`SamplingParams`'; its
    refusal is a 400 naming the field.  ``max_tokens``: the endpoint's own (chat's
    ``max_completion_tokens``) when given."""
    max_tokens = max_tokens if max_tokens is not None else req.max_tokens
    given = dict(  # None: SamplingParams' default
        top_k=req.top_k, top_p=req.top_p, min_p=req.min_p, seed=req.seed,
        min_tokens=req.min_tokens, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
        stop_token_ids=req.stop_token_ids)
    fields = dict(
        {k: v for k, v in given.items() if v is not None},
        max_tokens=16 if max_tokens is None else max_tokens,  # OpenAI's default
        temperature=1.0 if req.temperature is None else req.temperature,  # OpenAI's too
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        ignore_eos=req.ignore_eos, logprobs=logprobs, prompt_logprobs=req.prompt_logprobs,
        logit_bias=req.logit_bias, allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words, include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        truncate_prompt_tokens=req.truncate_prompt_tokens, n=req.n, best_of=req.best_of)
    try:
        # response_format, structured_outputs, or a forced tool call's schema
        fields["structured_outputs"] = req.constraint()
        return SamplingParams(**fields)
    except ValueError as exc:
        raise OpenAIError.bad_request(exc, fields) from None


async def open_streams(engine: AsyncEngine, prompts: list, params: list[SamplingParams],
                       stream: bool, raw_request: Request | None = None
                       ) -> list[RequestStream]:
    """Admit one request per (prompt, params) pair as one (:meth:`AsyncEngine.add_requests`:
    all or none, under ``--max-waiting`` together); a refusal becomes the OpenAI error for the
    whole call.  ``stream=False``: each stream carries only its request's final output.
    ``raw_request``: its client's disconnect, watched from before the admission, aborts
    every one of them (an OpenAIError of status 499, which nobody hears, ends the call)."""
    admission = engine.add_requests(prompts, params, stream=stream)
    try:
        if raw_request is None:
            return await admission
        streams = await unless_disconnected(raw_request, admission)
    except QueueFullError as exc:
        raise OpenAIError(503, str(exc), "server_overloaded") from None
    except EngineDeadError:
        raise OpenAIError(503, ENGINE_UNAVAILABLE, "service_unavailable") from None
    except ValueError as exc:  # the engine's refusal, naming the field
        raise OpenAIError.bad_request(exc, REQUEST_FIELDS) from None
    if streams is None:  # the client went away while they were admitted: all aborted
        raise OpenAIError(499, "the client closed the connection", code="client_closed")
    return streams


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, output) from several streams as they come; leaving early aborts them all."""
    if len(streams) == 1:  # the common case, without a task per stream
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].abort()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        async for out in stream:
            queue.put_nowait((i, out))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        num_finished = 0
        while num_finished < len(streams):
            i, out = await queue.get()
            num_finished += out.finished
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


async def results(streams: list[RequestStream]
                  ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """:func:`merge`, with the failures a client may hear of as OpenAI errors: a request
    that failed alone is a 500, a failed engine a 503 (the reasons are in the log)."""
    try:
        async for i, out in merge(streams):
            if out.finish_reason == "error":
                raise OpenAIError(500, f"the engine failed to process this request (choice "
                                       f"{i}); see the server log", "server_error")
            yield i, out
    except EngineDeadError:
        raise OpenAIError(503, ENGINE_UNAVAILABLE, "service_unavailable") from None


async def sse_or_error(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream's SSE chunks; an OpenAIError mid-stream ends it with an error chunk and
    ``[DONE]`` (the status line is sent already)."""
    try:
        async for chunk in chunks:
            yield chunk
    except OpenAIError as exc:
        yield sse(json.dumps(exc.body()))
        yield "data: [DONE]\n\n"


async def unless_disconnected(raw_request: Request, coro):
    """Run ``coro`` unless the client hangs up first; then cancel it (which aborts its
    requests) and return None.  Streaming responses need no such watch: Starlette cancels
    them on disconnect."""
    async def disconnected() -> None:
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(coro), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
    # a cancelled admission is done only once it has run its clean-up (aborting what it
    # admitted); its result is nobody's then
    if not work.done() or work.cancelled():
        return None
    return work.result()


def sse(payload: BaseModel | str) -> str:
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


def clamp(logprob: float) -> float:
    """A log-probability JSON can carry (-inf is not JSON), as vLLM clamps it."""
    return max(logprob, -9999.0)


def logprob_token(tokenizer: Tokenizer, token_id: int, as_id: bool) -> tuple[str, bytes]:
    """A token as logprobs name it: ``token_text`` (its text, or OpenAI's ``bytes:\\x..``
    for part of a character, so distinct tokens never share a name), or ``token_id:<id>``
    (vLLM's ``return_tokens_as_token_ids``)."""
    text, raw = token_text(tokenizer, token_id)
    return (f"token_id:{token_id}", raw) if as_id else (text, raw)


def completion_logprobs(tokenizer: Tokenizer, token_ids: list[int],
                        logprobs: list[dict[int, float] | None], text_offset: int,
                        as_ids: bool = False) -> CompletionLogprobs:
    """OpenAI's logprobs block of ``token_ids`` (one ``{token_id: logprob}`` of
    ``RequestOutput.logprobs`` or ``.prompt_logprobs`` each: the k most likely and the
    token's own, so up to k + 1 entries, as OpenAI and vLLM give; None for an echoed prompt's
    first token, which nothing predicts); ``text_offset``: where the first token's text
    starts."""
    result = CompletionLogprobs()
    for token, alternatives in zip(token_ids, logprobs):
        result.tokens.append(logprob_token(tokenizer, token, as_ids)[0])
        if alternatives is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            result.token_logprobs.append(clamp(alternatives[token]))
            result.top_logprobs.append({logprob_token(tokenizer, t, as_ids)[0]: clamp(lp)
                                        for t, lp in alternatives.items()})
        result.text_offset.append(text_offset)
        text_offset += len(tokenizer.decode([token]))
    return result


def prompt_logprobs(out: RequestOutput, k: int | None, tokenizer: Tokenizer
                    ) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's ``prompt_logprobs`` of a choice (``SamplingParams.prompt_logprobs=k``): per
    prompt token, ``{"token id": {logprob, rank, decoded_token}}`` for the k most likely (in
    order: rank 1, 2, ...) and the prompt's own token (rank None when it is not among them);
    None for the first token."""
    entries = getattr(out, "prompt_logprobs", None)
    if k is None or entries is None:
        return None
    return [None if alternatives is None else {
        str(t): PromptLogprob(logprob=clamp(lp), rank=r + 1 if r < k else None,
                              decoded_token=tokenizer.decode([t]))
        for r, (t, lp) in enumerate(alternatives.items())} for alternatives in entries]


class OpenAIServingCompletion:
    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def _prompts(self, req: CompletionRequest) -> list[str | list[int]]:
        prompt = req.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise OpenAIError(400, "prompt must not be empty", param="prompt")
        try:
            check_length("prompt", prompts)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="prompt") from None
        # a list of token ids longer than the model is refused before anything reads it
        # (unless it is to be truncated)
        max_len = self.engine.engine.max_model_len
        if req.truncate_prompt_tokens is None and any(
                not isinstance(p, str) and len(p) > max_len for p in prompts):
            raise OpenAIError(400, f"a prompt of token ids is longer than the model's "
                                   f"maximum length ({max_len})", param="prompt")
        return prompts

    async def create(self, req: CompletionRequest, raw_request: Request):
        prompts = self._prompts(req)
        params = sampling_params(req, req.logprobs)
        if req.echo and req.logprobs is not None:  # the echoed prompt's logprobs too
            params = dataclasses.replace(
                params, prompt_logprobs=max(req.prompt_logprobs or 0, req.logprobs))
        choices = [choice_params(params, c) for c in range(req.n)]
        streams = await open_streams(self.engine, [p for p in prompts for _ in range(req.n)],
                                     choices * len(prompts), req.stream, raw_request)
        echo = [(p if isinstance(p, str) else self.engine.tokenizer.decode(p)) if req.echo
                else "" for p in prompts for _ in range(req.n)]
        if req.stream:
            return StreamingResponse(sse_or_error(self._stream(req, streams, echo)),
                                     media_type="text/event-stream")
        response = await unless_disconnected(raw_request, self._full(req, streams, echo))
        return JSONResponse(response.model_dump()) if response is not None else None

    def _logprobs(self, req: CompletionRequest, out: RequestOutput, start: int,
                  text_offset: int, echoed: bool = False) -> CompletionLogprobs | None:
        """The logprobs block of ``out``'s tokens from ``start`` on (None unless asked);
        ``echoed``: the prompt's tokens first (``echo``), from offset 0."""
        if req.logprobs is None:
            return None
        tokens, logprobs = out.token_ids[start:], out.logprobs[start:]
        if echoed:
            k = req.logprobs
            tokens = out.prompt_token_ids + tokens
            logprobs = [None if e is None else dict(list(e.items())[:k]) | {t: e[t]}
                        for t, e in zip(out.prompt_token_ids, out.prompt_logprobs)] + logprobs
            text_offset = 0
        return completion_logprobs(self.engine.tokenizer, tokens, logprobs, text_offset,
                                   req.return_tokens_as_token_ids)

    async def _full(self, req: CompletionRequest, streams, echo) -> CompletionResponse:
        finals: dict[int, RequestOutput] = {}
        async for i, out in results(streams):
            if out.finished:
                finals[i] = out
        tokenizer = self.engine.tokenizer
        choices = [CompletionChoice(
            index=i, text=echo[i] + out.text, finish_reason=out.finish_reason,
            logprobs=self._logprobs(req, out, 0, len(echo[i]), echoed=req.echo),
            prompt_logprobs=prompt_logprobs(out, req.prompt_logprobs, tokenizer))
            for i, out in sorted(finals.items())]
        return CompletionResponse(model=self.model_name, choices=choices,
                                  usage=usage(finals, req.n))

    async def _stream(self, req: CompletionRequest, streams, echo) -> AsyncIterator[str]:
        chunk_id = CompletionResponse(model=self.model_name, choices=[])
        sent = [""] * len(streams)
        num_sent = [0] * len(streams)  # tokens whose logprobs went out
        offset = [len(e) for e in echo]  # text_offset of the next of them
        finals: dict[int, RequestOutput] = {}
        tokenizer = self.engine.tokenizer
        async for i, out in results(streams):
            delta = out.text[len(sent[i]):]
            if not delta and not out.finished:
                continue  # this token completed no character yet (its logprobs wait too)
            if out.finished:
                finals[i] = out
            # the first chunk of a choice carries the echoed prompt (and its prompt logprobs)
            text, echo[i] = echo[i] + delta, ""
            logprobs = self._logprobs(req, out, num_sent[i], offset[i],
                                      echoed=req.echo and not num_sent[i] and not sent[i])
            if logprobs is not None and logprobs.tokens:
                offset[i] = logprobs.text_offset[-1] + len(tokenizer.decode(out.token_ids[-1:]))
            choice = CompletionChoice(
                index=i, text=text, finish_reason=out.finish_reason, logprobs=logprobs,
                prompt_logprobs=None if num_sent[i] else prompt_logprobs(
                    out, req.prompt_logprobs, tokenizer))
            sent[i], num_sent[i] = out.text, len(out.token_ids)
            yield sse(chunk_id.model_copy(update={"choices": [choice]}))
        if req.include_usage:
            yield sse(chunk_id.model_copy(update={"usage": usage(finals, req.n)}))
        yield "data: [DONE]\n\n"


def usage(finals: dict[int, RequestOutput], n: int) -> UsageInfo:
    """Prompt tokens counted once per prompt (not per choice), as OpenAI does."""
    prompt = sum(len(out.prompt_token_ids) for i, out in finals.items() if i % n == 0)
    completion = sum(len(out.token_ids) for out in finals.values())
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion)
