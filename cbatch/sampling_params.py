"""Per-request sampling settings (no torch: the scheduler reads them too)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How one request is decoded.

    max_tokens      new tokens to generate at most (>= 1)
    temperature     0 = greedy; otherwise logits are divided by it before sampling
    top_k           keep the k most likely tokens (0 = all)
    top_p           keep the smallest set of tokens whose probability reaches top_p (1 = all)
    seed            per-request seed: the same seed gives the same tokens whatever else is
                    in the batch (None: derived from the engine's seed and the request)
    stop_token_ids  tokens that finish the request (with reason "stop"); they are kept
    ignore_eos      keep going past the model's end-of-sequence token
    stop            strings that finish the request (reason "stop"); the text ends before
                    the first one
    logprobs        None: none; k >= 1: the log-probability of each sampled token and the
                    k most likely alternatives at every step (RequestOutput.logprobs)
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.stop_token_ids = list(self.stop_token_ids)
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int)
                                          or self.logprobs < 1):
            raise ValueError(f"logprobs must be None or an int >= 1, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
