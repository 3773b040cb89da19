"""``POST /v1/completions`` over the AsyncEngine: prompts in, choices (or SSE chunks) out."""

from __future__ import annotations

import dataclasses
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from cbatch.entrypoints.openai.limits import check_length
from cbatch.entrypoints.openai.protocol import (CompletionChoice, CompletionLogprobs,
                                                CompletionRequest, CompletionResponse)
from cbatch.entrypoints.openai.serving_engine import (OpenAIError, OpenAIServing, clamp,
                                                      logprob_token, prompt_logprobs, results,
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

    async def create(self, req: CompletionRequest, raw_request: Request):
        prompts = self._prompts(req)
        params = sampling_params(req, req.logprobs)
        if req.echo and req.logprobs is not None:  # the echoed prompt's logprobs too
            params = dataclasses.replace(
                params, prompt_logprobs=max(req.prompt_logprobs or 0, req.logprobs))
        streams = await self.open(prompts, params, req.n, req.stream, raw_request)
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
