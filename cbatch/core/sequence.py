"""A request as the scheduler sees it: tokens, progress through the cache, and lifecycle.

No torch here.  Lifecycle: WAITING → RUNNING (prefilling, then decoding) → FINISHED; a
preempted sequence goes back to WAITING and is recomputed (its blocks are released, the
tokens it already produced are kept and prefilled again, from the cache where it still holds
them).

With async scheduling a step is scheduled before the previous step's sampled tokens reach the
host: such a token is *in flight* (``num_inflight``).  It counts in ``num_tokens`` (the
scheduler plans with it and the runner feeds it from the device) but joins ``token_ids`` only
when the engine reads it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from cbatch.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_order: int
    priority: int = 0
    seed: int = 0  # effective sampling seed (params.seed, or one the engine derived)
    stream: bool = True  # an output at every step it advances; False: only the final one
    # params.bad_words as token ids (each word with and without a leading space)
    bad_words_token_ids: list[tuple[int, ...]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # prompt + output known on the host
    num_inflight: int = 0  # sampled tokens still on the device (async scheduling)
    # speculative decoding: the drafts proposed to follow token_ids (verified, not yet known)
    spec_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)  # if params ask
    # params.prompt_logprobs: one entry per prompt token scored so far (the first is None)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of its first cached blocks
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    error: str | None = None  # why it failed (finish_reason "error"), for the log
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # a cbatch.core.detokenizer.IncrementalDetokenizer, made when the text is first read (not
    # imported: this module stays free of everything but sampling_params)
    detokenizer: object | None = None
    # a cbatch.core.structured_output.SequenceGrammar when params.structured_outputs is set
    # (made once its grammar is compiled; not imported, for the same reason)
    grammar: object | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output, in-flight tokens included."""
        return len(self.token_ids) + self.num_inflight

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The output tokens known on the host."""
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        """Tokens sampled so far, in-flight ones included."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to feed through the model before the next sample."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        return self.num_uncomputed_tokens == 1 and self.num_output_tokens > 0

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
