"""Per-request sampling settings (no torch: the scheduler reads them too)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

# top_k beyond any vocabulary (the sampler clamps it to the vocabulary it samples from)
MAX_TOP_K = 2**31


@dataclass
class SamplingParams:
    """How one request is decoded.

    max_tokens      new tokens to generate at most (>= 1)
    temperature     0 = greedy; otherwise logits are divided by it before sampling
    top_k           keep the k most likely tokens (0 or -1 = all; at most 2**31)
    top_p           keep the smallest set of tokens whose probability reaches top_p (1 = all)
    seed            per-request seed, an int in [0, 2**64): the same seed gives the same
                    tokens whatever else is in the batch (None: derived from the engine's
                    seed and the request)
    stop_token_ids  tokens that finish the request (with reason "stop"); they are kept
    ignore_eos      keep going past the model's end-of-sequence token
    stop            strings that finish the request (reason "stop"); the text ends before
                    the first one
    logprobs        None: none; k >= 1: the log-probability of each sampled token and the
                    k most likely alternatives at every step (RequestOutput.logprobs); the
                    engine refuses k above its max_logprobs
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
        # Every value the step cannot run is refused here, naming the field: a bad request is
        # an error for its caller, never a failure inside a step that every request shares.
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got "
                             f"{self.temperature!r}")
        if not _is_int(self.top_k) or not (self.top_k in (-1, 0) or 1 <= self.top_k <= MAX_TOP_K):
            raise ValueError(f"top_k must be -1 or 0 (off) or an int in [1, 2**31], got "
                             f"{self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be None or an int in [0, 2**64), got {self.seed!r}")
        self.top_k = max(self.top_k, 0)  # -1 (vLLM's "off") is 0 here
        self.temperature, self.top_p = float(self.temperature), float(self.top_p)
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of ints, got "
                             f"{self.stop_token_ids!r:.80}")
        self.stop_token_ids = list(self.stop_token_ids)
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be ints >= 0, got {self.stop_token_ids!r:.80}")
        if not isinstance(self.stop, (str, list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r:.80}")
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r:.80}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 1):
            raise ValueError(f"logprobs must be None or an int >= 1, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and not math.isnan(x)
