"""What the OpenAI endpoints share (vLLM's ``serving_engine.py``): a request's sampling
params, admitting its prompts and choices as one, its streams' outputs with the failures a
client hears of, SSE framing, logprob entries and usage.  ``/v1/completions``
(:mod:`serving_completion`) and ``/v1/chat/completions`` (:mod:`serving_chat`) build on
:class:`OpenAIServing`."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from typing import AsyncIterator

from fastapi import Request
from pydantic import BaseModel

from cbatch.core.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestStream
from cbatch.core.structured_output import ConstraintError, WorkersBusy
from cbatch.entrypoints.openai.protocol import PromptLogprob, UsageInfo, _SamplingFields
from cbatch.outputs import RequestOutput
from cbatch.sampling_params import SamplingParams
from cbatch.tokenizer import Tokenizer, token_text

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

    @classmethod
    def bad_request(cls, error: Exception | str, fields) -> OpenAIError:
        """A 400 of a refusal whose message begins with the field it is about (every check
        of cbatch's writes them so): ``param`` is that field when it is one of ``fields``."""
        message = str(error).removeprefix("Value error, ")  # (pydantic's prefix)
        name = re.match(r"\w+", message)
        return cls(400, message, param=name.group() if name and name.group() in fields
                   else None)


# the fields an engine's refusal of a request may name (``param`` of its 400)
REQUEST_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) | {
    "prompt", "messages", "logprobs", "top_logprobs"}
# what a client hears when the engine failed (the failure itself is in the server's log)
ENGINE_UNAVAILABLE = "the engine is not available; see the server log"
# how a request's error begins when its output could not follow its constraint
CONSTRAINT_ERROR = f"{ConstraintError.__name__}: "


def sampling_params(req: _SamplingFields, logprobs: int | None = None,
                    max_tokens: int | None = None, n: int | None = None) -> SamplingParams:
    """The engine's params for a request's choices (each choice runs as
    ``params.choice(i)``: seed + i).  Every check is :class:`SamplingParams`'; its
    refusal is a 400 naming the field.  ``max_tokens``: the endpoint's own (chat's
    ``max_completion_tokens``) when given; ``n``: the engine's choices per prompt when the
    endpoint runs more than it returns (completions' ``best_of``)."""
    max_tokens = max_tokens if max_tokens is not None else req.max_tokens
    given = dict(  # None: SamplingParams' default
        top_k=req.top_k, top_p=req.top_p, min_p=req.min_p, seed=req.seed,
        min_tokens=req.min_tokens, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
        stop_token_ids=req.stop_token_ids)
    fields = dict(
        {k: v for k, v in given.items() if v is not None},
        max_tokens=16 if max_tokens is None else max_tokens,  # OpenAI's completions default
        temperature=1.0 if req.temperature is None else req.temperature,  # OpenAI's too
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        ignore_eos=req.ignore_eos, logprobs=logprobs, prompt_logprobs=req.prompt_logprobs,
        logit_bias=req.logit_bias, allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words, include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        truncate_prompt_tokens=req.truncate_prompt_tokens, n=req.n if n is None else n,
        best_of=req.best_of if n is None else None)
    try:
        # response_format, structured_outputs, or a forced tool call's schema
        fields["structured_outputs"] = req.constraint()
        return SamplingParams(**fields)
    except ValueError as exc:
        raise OpenAIError.bad_request(exc, fields) from None


async def open_streams(engine: AsyncEngine, prompts: list, params: list[SamplingParams],
                       stream: bool, raw_request: Request | None = None,
                       constraint_field: str | None = None) -> list[RequestStream]:
    """Admit one request per (prompt, params) pair as one (:meth:`AsyncEngine.add_requests`:
    all or none, under ``--max-waiting`` together); a refusal becomes the OpenAI error for the
    whole call.  ``stream=False``: each stream carries only its request's final output.
    ``raw_request``: its client's disconnect, watched from before the admission, aborts
    every one of them (an OpenAIError of status 499, which nobody hears, ends the call).
    ``constraint_field``: the request's field that holds its constraint, named in the 400 of
    a constraint refused (default: ``structured_outputs.<kind>``)."""
    admission = engine.add_requests(prompts, params, stream=stream)
    try:
        if raw_request is None:
            return await admission
        streams = await unless_disconnected(raw_request, admission)
    except (QueueFullError, WorkersBusy) as exc:
        raise OpenAIError(503, str(exc), "server_overloaded") from None
    except EngineDeadError:
        raise OpenAIError(503, ENGINE_UNAVAILABLE, "service_unavailable") from None
    except ConstraintError as exc:  # (the grammar workers')
        exc = exc.named(constraint_field) if constraint_field else exc
        raise OpenAIError(400, str(exc), param=exc.field) from None
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
    that failed alone is a 500, a failed engine a 503 (the reasons are in the log), but one
    whose output could not follow its constraint a 400 that says why."""
    try:
        async for i, out in merge(streams):
            if out.finish_reason == "error" and (out.error or "").startswith(CONSTRAINT_ERROR):
                raise OpenAIError(400, f"choice {i}: {out.error[len(CONSTRAINT_ERROR):]}")
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


class OpenAIServing:
    """An endpoint over the engine: its requests' choices admitted and streamed."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name  # the first of the names the server answers to

    def model_of(self, req) -> str:
        """The model a response names: as its request did (one of the served names), as
        vLLM does, else the first served name."""
        return req.model or self.model_name

    async def open(self, prompts: list, params: SamplingParams, n: int, stream: bool,
                   raw_request: Request | None, constraint_field: str | None = None
                   ) -> list[RequestStream]:
        """Admit ``n`` choices of each prompt as one (:func:`open_streams`); stream i is
        choice ``i % n`` of prompt ``i // n``."""
        choices = [params.choice(c) for c in range(n)]
        return await open_streams(self.engine, [p for p in prompts for _ in range(n)],
                                  choices * len(prompts), stream, raw_request,
                                  constraint_field)


def chunk_usage(num_prompt_tokens: int, out: RequestOutput | None) -> UsageInfo:
    """vLLM's ``continuous_usage_stats``: a stream chunk's usage, of its choice so far."""
    completion = 0 if out is None else len(out.token_ids)
    return UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=completion,
                     total_tokens=num_prompt_tokens + completion)


def usage(finals: dict[int, RequestOutput], n: int) -> UsageInfo:
    """Prompt tokens counted once per prompt (not per choice), as OpenAI does."""
    prompt = sum(len(out.prompt_token_ids) for i, out in finals.items() if i % n == 0)
    completion = sum(len(out.token_ids) for out in finals.values())
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion)
