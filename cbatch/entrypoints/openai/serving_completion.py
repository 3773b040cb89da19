"""``POST /v1/completions`` over the AsyncEngine: prompts in, choices (or SSE chunks) out."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from cbatch.core.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestStream
from cbatch.entrypoints.openai.limits import check_length
from cbatch.entrypoints.openai.protocol import (CompletionChoice, CompletionLogprobs,
                                                CompletionRequest, CompletionResponse,
                                                OpenAIError, UsageInfo, _SamplingFields)
from cbatch.outputs import RequestOutput
from cbatch.sampling_params import SamplingParams

# what a client hears when the engine failed (the failure itself is in the server's log)
ENGINE_UNAVAILABLE = "the engine is not available; see the server log"


def sampling_params(req: _SamplingFields, choice: int, logprobs: int | None = None,
                    max_tokens: int | None = None) -> SamplingParams:
    """The engine's params for choice ``choice`` of a request: with a seed, choice i samples
    with seed + i, so n choices differ and each is reproducible alone."""
    try:
        return SamplingParams(
            max_tokens=max_tokens or req.max_tokens or 16, temperature=req.temperature,
            top_k=max(req.top_k, 0), top_p=req.top_p,
            seed=None if req.seed is None else req.seed + choice,
            stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
            # OpenAI's logprobs=0 asks for the sampled token's logprob alone
            logprobs=None if logprobs is None else max(logprobs, 1))
    except ValueError as exc:
        raise OpenAIError(400, str(exc)) from None


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
    except ValueError as exc:
        raise OpenAIError(400, str(exc)) from None
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
    return work.result() if not work.cancelled() else None


def sse(payload: BaseModel | str) -> str:
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


def completion_logprobs(out: RequestOutput, k: int, detokenize: Callable[[list[int]], str],
                        text_offset: int) -> CompletionLogprobs | None:
    """OpenAI's logprobs block from ``out.logprobs`` (one ``{token_id: logprob}`` per output
    token: the k most likely and the sampled one)."""
    result = CompletionLogprobs()
    for token, alternatives in zip(out.token_ids, out.logprobs):
        text = detokenize([token])
        result.tokens.append(text)
        result.token_logprobs.append(alternatives.get(token))
        top = sorted(alternatives.items(), key=lambda kv: -kv[1])[:k]
        result.top_logprobs.append({detokenize([t]): lp for t, lp in top} if k else None)
        result.text_offset.append(text_offset)
        text_offset += len(text)
    return result


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
        max_len = self.engine.engine.max_model_len
        if any(not isinstance(p, str) and len(p) > max_len for p in prompts):
            raise OpenAIError(400, f"a prompt of token ids is longer than the model's "
                                   f"maximum length ({max_len})", param="prompt")
        return prompts

    async def create(self, req: CompletionRequest, raw_request: Request):
        prompts = self._prompts(req)
        params = [sampling_params(req, c, req.logprobs) for c in range(req.n)]
        streams = await open_streams(self.engine, [p for p in prompts for _ in range(req.n)],
                                     params * len(prompts), req.stream, raw_request)
        echo = [(p if isinstance(p, str) else self.engine.tokenizer.decode(p)) if req.echo
                else "" for p in prompts for _ in range(req.n)]
        if req.stream:
            return StreamingResponse(sse_or_error(self._stream(req, streams, echo)),
                                     media_type="text/event-stream")
        response = await unless_disconnected(raw_request, self._full(req, streams, echo))
        return JSONResponse(response.model_dump()) if response is not None else None

    async def _full(self, req: CompletionRequest, streams, echo) -> CompletionResponse:
        finals: dict[int, RequestOutput] = {}
        async for i, out in results(streams):
            if out.finished:
                finals[i] = out
        choices = [CompletionChoice(
            index=i, text=echo[i] + out.text, finish_reason=out.finish_reason,
            logprobs=None if req.logprobs is None else completion_logprobs(
                out, req.logprobs, self.engine.tokenizer.decode, len(echo[i])))
            for i, out in sorted(finals.items())]
        return CompletionResponse(model=self.model_name, choices=choices,
                                  usage=usage(finals, req.n))

    async def _stream(self, req: CompletionRequest, streams, echo) -> AsyncIterator[str]:
        chunk_id = CompletionResponse(model=self.model_name, choices=[])
        sent = [""] * len(streams)
        finals: dict[int, RequestOutput] = {}
        async for i, out in results(streams):
            delta = out.text[len(sent[i]):]
            if not delta and not out.finished:
                continue  # this token completed no character yet
            sent[i] = out.text
            if out.finished:
                finals[i] = out
            # the first chunk of a choice carries the echoed prompt
            text, echo[i] = echo[i] + delta, ""
            choice = CompletionChoice(index=i, text=text, finish_reason=out.finish_reason)
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
