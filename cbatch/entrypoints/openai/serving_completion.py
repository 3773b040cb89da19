"""``POST /v1/completions`` over the AsyncEngine: prompts in, choices (or SSE chunks) out.

``best_of`` (OpenAI's): each prompt runs ``best_of`` candidates, one engine request each (the
engine's rule is one completion per request), and the n with the highest cumulative logprob
are returned.  ``usage`` counts the tokens of the n returned, as vLLM v0 did (OpenAI bills
every candidate; vLLM v1 refuses ``best_of`` != n)."""

from __future__ import annotations

import dataclasses
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from cbatch.entrypoints.openai.limits import check_length
from cbatch.entrypoints.openai.protocol import (CompletionChoice, CompletionLogprobs,
                                                CompletionRequest, CompletionResponse,
                                                UsageInfo)
from cbatch.entrypoints.openai.serving_engine import (OpenAIError, OpenAIServing,
                                                      chunk_usage, clamp, logprob_token,
                                                      prompt_logprobs, results,
                                                      sampling_params, sse, sse_or_error,
                                                      unless_disconnected, usage)
from cbatch.outputs import RequestOutput
from cbatch.tokenizer import Tokenizer


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


def cumulative_logprob(out: RequestOutput) -> float:
    """The sum of the logprobs of ``out``'s tokens (run with ``logprobs`` >= 0)."""
    return sum(entry[token] for token, entry in zip(out.token_ids, out.logprobs))


def best_candidates(finals: dict[int, RequestOutput], n: int, best_of: int
                    ) -> dict[int, RequestOutput]:
    """``best_of``: choice ``p * n + j`` is the j-th most likely (by cumulative logprob) of
    prompt p's candidates, which are ``finals[p * best_of + c]``."""
    chosen = {}
    for p in range(len(finals) // best_of):
        ranked = sorted((finals[p * best_of + c] for c in range(best_of)),
                        key=cumulative_logprob, reverse=True)
        chosen.update({p * n + j: out for j, out in enumerate(ranked[:n])})
    return chosen


class OpenAIServingCompletion(OpenAIServing):
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
        max_len = self.engine.max_model_len
        if req.truncate_prompt_tokens is None and any(
                not isinstance(p, str) and len(p) > max_len for p in prompts):
            raise OpenAIError(400, f"a prompt of token ids is longer than the model's "
                                   f"maximum length ({max_len})", param="prompt")
        return prompts

    @staticmethod
    def _best_of(req: CompletionRequest) -> int:
        """The candidates each prompt runs: ``best_of`` (n <= best_of, not streamed, as
        OpenAI's rule), else n."""
        best_of = req.n if req.best_of is None else req.best_of
        if best_of < req.n:
            raise OpenAIError(400, f"best_of must be >= n ({req.n}), got {best_of}",
                              param="best_of")
        if best_of > req.n and req.stream:
            raise OpenAIError(400, "best_of > n cannot be streamed (the best are known only "
                                   "once every candidate is finished)", param="best_of")
        return best_of

    async def create(self, req: CompletionRequest, raw_request: Request):
        prompts = self._prompts(req)
        best_of = self._best_of(req)
        # best_of > n: the candidates are ranked by the sum of their tokens' logprobs
        logprobs = req.logprobs if best_of == req.n else (req.logprobs or 0)
        params = sampling_params(req, logprobs, n=best_of)
        if req.echo and req.logprobs is not None:  # the echoed prompt's logprobs too
            params = dataclasses.replace(
                params, prompt_logprobs=max(req.prompt_logprobs or 0, req.logprobs))
        streams = await self.open(prompts, params, best_of, req.stream, raw_request,
                                  req.constraint_field())
        echo = [(p if isinstance(p, str) else self.engine.tokenizer.decode(p)) if req.echo
                else "" for p in prompts for _ in range(req.n)]
        if req.stream:
            return StreamingResponse(sse_or_error(self._stream(req, streams, echo)),
                                     media_type="text/event-stream")
        response = await unless_disconnected(raw_request,
                                             self._full(req, streams, echo, best_of))
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

    async def _full(self, req: CompletionRequest, streams, echo, best_of: int
                    ) -> CompletionResponse:
        finals: dict[int, RequestOutput] = {}
        async for i, out in results(streams):
            if out.finished:
                finals[i] = out
        tokenizer = self.engine.tokenizer
        chosen = finals if best_of == req.n else best_candidates(finals, req.n, best_of)
        choices = [CompletionChoice(
            index=i, text=echo[i] + out.text, finish_reason=out.finish_reason,
            logprobs=self._logprobs(req, out, 0, len(echo[i]), echoed=req.echo),
            prompt_logprobs=prompt_logprobs(out, req.prompt_logprobs, tokenizer))
            for i, out in sorted(chosen.items())]
        # the prompts once each, and the tokens of the choices returned (as vLLM v0 counted)
        counted = usage(finals, best_of)
        returned = sum(len(out.token_ids) for out in chosen.values())
        return CompletionResponse(model=self.model_of(req), choices=choices, usage=UsageInfo(
            prompt_tokens=counted.prompt_tokens, completion_tokens=returned,
            total_tokens=counted.prompt_tokens + returned))

    async def _stream(self, req: CompletionRequest, streams, echo) -> AsyncIterator[str]:
        chunk_id = CompletionResponse(model=self.model_of(req), choices=[])
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
            yield sse(chunk_id.model_copy(update={"choices": [choice], "usage": chunk_usage(
                len(out.prompt_token_ids), out) if req.continuous_usage else None}))
        if req.include_usage:
            yield sse(chunk_id.model_copy(update={"usage": usage(finals, req.n)}))
        yield "data: [DONE]\n\n"
