"""Per-request metrics and engine-wide statistics."""

from __future__ import annotations

from dataclasses import dataclass


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
    graph_capture_s: float = 0.0  # start-up time spent capturing decode CUDA graphs
    graph_memory_bytes: int = 0  # device memory their pool holds

    @property
    def host_overhead(self) -> float:
        """Fraction of step time spent outside the model: the Python work per step."""
        if self.elapsed <= 0:
            return 0.0
        return 1.0 - self.phase_s["execute"] / self.elapsed

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed if self.elapsed > 0 else 0.0
