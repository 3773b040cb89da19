"""Static batching, the baseline that continuous batching replaces, as a scheduling policy.

A batch of up to ``max_num_seqs`` waiting requests is admitted only when the previous batch
has finished entirely, its prompts are prefilled in one step, and every decode step keeps
as many rows as the batch started with: the rows of requests that already finished keep
computing (padded rows that write nothing), which is what a padded static batch costs.
Everything else (the model, the kernels, the step batch, sampling) is the engine's own.
"""

from __future__ import annotations

from cbatch.core.block_manager import BlockManager
from cbatch.core.scheduler import Scheduler, SchedulerOutput


class StaticScheduler(Scheduler):
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_tokens: int):
        # the token budget never splits a batch's prefill: a static batch starts whole
        super().__init__(block_manager, max_num_seqs, max_num_tokens, "fcfs")
        self.batch_size = 0  # rows of the batch in flight

    def schedule(self) -> SchedulerOutput:
        self._retire_last_in_flight()  # before asking whether the batch has ended
        if not self.running:
            out = super().schedule()
            self.batch_size = len(out.scheduled)
        else:  # the batch runs to its longest request: nobody joins it
            waiting, self.waiting = self.waiting, []
            try:
                out = super().schedule()
            finally:
                self.waiting = waiting + self.waiting  # + any it preempted
        out.pad_to = self.batch_size
        return out
