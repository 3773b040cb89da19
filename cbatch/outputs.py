"""What the engine hands back for a request."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from cbatch.metrics import RequestMetrics

if TYPE_CHECKING:
    from cbatch.detokenizer import IncrementalDetokenizer


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
    detokenizer: IncrementalDetokenizer | None = field(default=None, repr=False, compare=False)
    error: str | None = None

    @cached_property
    def text(self) -> str:
        """The generated text, decoded on first access (steps nobody reads do not pay for it):
        up to the first stop string; while unfinished, the part no later token can change."""
        if self.detokenizer is None:
            return ""
        return self.detokenizer.text_at(len(self.token_ids), self.finished)
