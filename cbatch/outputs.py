"""What the engine hands back for a request."""

from __future__ import annotations

from dataclasses import dataclass

from cbatch.metrics import RequestMetrics


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated so far (all of them once finished)
    text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    metrics: RequestMetrics
