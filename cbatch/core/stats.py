"""Engine-wide statistics, and the clock that charges each part of a step to its phase
(per-request metrics travel with each output: :class:`cbatch.outputs.RequestMetrics`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineStats:
    num_steps: int
    num_running: int
    num_waiting: int
    num_finished: int
    num_preemptions: int
    num_prefill_tokens: int  # tokens computed in prefill chunks (recomputation included)
    num_output_tokens: int
    elapsed: float  # seconds spent in step()
    phase_s: dict[str, float]  # of which: schedule, prepare (step tensors), execute (model +
    # sampling, device included), postprocess (token bookkeeping, outputs)
    kv_cache_usage: float  # fraction of blocks in use now
    mean_batch_occupancy: float  # mean scheduled sequences / max_num_seqs over steps
    prefix_cache_queried_tokens: int  # tokens of admitted requests (re-admissions too)
    prefix_cache_hit_tokens: int  # of which were found in the prefix cache
    graph_capture_s: float = 0.0  # start-up time spent capturing decode CUDA graphs
    graph_memory_bytes: int = 0  # device memory their pool holds
    # CPU: steps run at each thread count (the thread policy's choices; empty elsewhere)
    steps_by_threads: dict[int, int] = field(default_factory=dict)
    # speculative decoding (vLLM's spec_decode counters): drafts (a sequence verifying
    # drafts in a step), draft tokens verified, of which accepted, accepted by draft
    # position; seconds spent drafting, and wall seconds of the steps that verified drafts
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    spec_decode_draft_s: float = 0.0
    spec_decode_verify_s: float = 0.0

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Fraction of the verified draft tokens that were accepted."""
        if self.spec_decode_num_draft_tokens == 0:
            return 0.0
        return self.spec_decode_num_accepted_tokens / self.spec_decode_num_draft_tokens

    @property
    def spec_decode_mean_accepted_length(self) -> float:
        """Tokens a verifying sequence gains per step, on average: 1 + accepted drafts (as
        vLLM's mean acceptance length)."""
        if self.spec_decode_num_drafts == 0:
            return 0.0
        return 1.0 + self.spec_decode_num_accepted_tokens / self.spec_decode_num_drafts

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Fraction of admitted tokens whose K/V came from the prefix cache."""
        if self.prefix_cache_queried_tokens == 0:
            return 0.0
        return self.prefix_cache_hit_tokens / self.prefix_cache_queried_tokens

    @property
    def host_overhead(self) -> float:
        """Fraction of step time spent outside the model: the Python work per step."""
        if self.elapsed <= 0:
            return 0.0
        return 1.0 - self.phase_s["execute"] / self.elapsed

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed if self.elapsed > 0 else 0.0


class StepCounters:
    """What the engine counts as it steps (read out as :class:`EngineStats`), and the clock
    that charges each stretch of a step to its phase."""

    PHASES = ("schedule", "prepare", "execute", "postprocess")

    def __init__(self) -> None:
        self.num_steps = self.num_finished = 0
        self.num_prefill_tokens = self.num_output_tokens = 0
        self.elapsed = self.occupancy_sum = 0.0
        self.phase_s = dict.fromkeys(self.PHASES, 0.0)
        self._clock = 0.0  # when the phase being timed began

    def start(self) -> float:
        """A step begins: the clock starts; returns the time now."""
        self._clock = time.perf_counter()
        return self._clock

    def tick(self, phase: str) -> float:
        """Charge the time since the last tick to ``phase``; returns the time now."""
        now = time.perf_counter()
        self.phase_s[phase] += now - self._clock
        self._clock = now
        return now

    def stats(self) -> dict:
        """The counters as :class:`EngineStats`'s fields."""
        return dict(num_steps=self.num_steps, num_finished=self.num_finished,
                    num_prefill_tokens=self.num_prefill_tokens,
                    num_output_tokens=self.num_output_tokens, elapsed=self.elapsed,
                    phase_s=dict(self.phase_s),
                    mean_batch_occupancy=self.occupancy_sum / max(1, self.num_steps))
