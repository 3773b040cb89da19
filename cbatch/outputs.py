"""What the engine hands back for a request."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable


@dataclass(frozen=True)
class RequestMetrics:
    """Times are ``time.perf_counter()`` seconds; derived latencies are in seconds."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_output_tokens: int
    num_preemptions: int

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first."""
        if self.finished_time is None or self.first_token_time is None:
            return None
        if self.num_output_tokens < 2:
            return 0.0
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def e2e(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated so far (all of them once finished)
    finished: bool
    # "stop" | "length" | "abort" once finished; "error" when processing this request alone
    # failed (its text is then empty, ``error`` says why; the engine serves on)
    finish_reason: str | None
    metrics: RequestMetrics
    # SamplingParams(logprobs=k): per generated token, {token id: log-probability} of the k
    # most likely tokens (most likely first) and the sampled one; the log-softmax of the raw
    # logits, before temperature, top-k and top-p.  None when not asked for.
    logprobs: list[dict[int, float]] | None = None
    # SamplingParams(prompt_logprobs=k): per prompt token, the same for its own token given
    # the ones before it; the first entry is None (nothing comes before it).  None when not
    # asked for.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # (number of output tokens, finished) -> their text: the request's incremental
    # detokenizer, which decodes each token once however many snapshots read it
    text_of: Callable[[int, bool], str] | None = field(default=None, repr=False, compare=False)
    error: str | None = None  # why it failed (finish_reason "error")

    def __repr__(self) -> str:
        """What ``print(out)`` shows (vLLM's RequestOutput repr, flat): the id, the text
        (its first 60 characters, with its full length, when longer), the token counts,
        and how it finished."""
        text = self.text
        shown = repr(text) if len(text) <= 60 else f"{text[:60]!r}... ({len(text)} chars)"
        error = f", error={self.error!r}" if self.error is not None else ""
        return (f"RequestOutput(request_id={self.request_id!r}, text={shown}, "
                f"num_prompt_tokens={len(self.prompt_token_ids)}, "
                f"num_tokens={len(self.token_ids)}, finished={self.finished}, "
                f"finish_reason={self.finish_reason!r}{error})")

    @cached_property
    def text(self) -> str:
        """The generated text, decoded on first access (steps nobody reads do not pay for it):
        up to the first stop string; while unfinished, the part no later token can change."""
        if self.text_of is None:
            return ""
        return self.text_of(len(self.token_ids), self.finished)
