"""What a step samples and scores, and what comes back of it: :class:`PromptTargets` (the
prompt tokens whose logprobs it computes), :class:`DraftPositions` (where a step that verifies
speculative drafts samples) and :class:`SampledTokens` (its tokens and logprobs on their way
to the host).  :class:`~cbatch.core.model_runner.ModelRunner` makes them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cbatch.core.sampler import logprobs_lists
from cbatch.core.scheduler import ScheduledSequence


@dataclass
class PromptTargets:
    """The prompt tokens whose logprobs a step computes (``SamplingParams.prompt_logprobs``):
    the logits at ``token_indices`` (into the step's flat tokens) score ``targets`` (each the
    prompt token after that position), with ``num_logprobs`` alternatives each; row s of the
    step owns ``counts[s]`` of them, in order."""

    token_indices: list[int]
    targets: list[int]
    num_logprobs: list[int]
    counts: list[int]

    @classmethod
    def of(cls, scheduled: list[ScheduledSequence], starts: list[int]
           ) -> PromptTargets | None:
        """Those of a step's sequences that ask, for the positions this step computes (a
        position p scores prompt token p + 1; row s's tokens begin at ``starts[s]`` in the
        step's, :func:`~cbatch.core.input_batch.run_starts`); None when none asks."""
        out = cls([], [], [], [])
        for item, offset in zip(scheduled, starts):
            seq, n = item.seq, item.num_new_tokens
            k = seq.params.prompt_logprobs
            start = seq.num_computed_tokens
            end = min(start + n, seq.num_prompt_tokens - 1)
            # a recomputed (preempted) prefix has its logprobs already: only the rest
            first = max(start, len(seq.prompt_logprobs) - 1)
            count = max(0, end - first) if k is not None else 0
            if count:
                out.token_indices += range(offset + first - start, offset + end - start)
                out.targets += seq.prompt_token_ids[first + 1:end + 1]
                out.num_logprobs += [k] * count
            out.counts.append(count)
        return out if out.targets else None


@dataclass
class DraftPositions:
    """Where a step that verifies speculative drafts samples (``core/spec_decode/``): row s
    of the step draws ``counts[s]`` tokens, at its run's last ``counts[s]`` positions (its
    last token's and each draft's: 1 + its drafts), in order; ``token_indices`` are those
    positions in the step's flat tokens, ``offsets[s]`` where row s's draws start in the
    step's ``[sum(counts)]`` tokens."""

    token_indices: list[int]
    counts: list[int]
    offsets: list[int]

    @classmethod
    def of(cls, scheduled: list[ScheduledSequence], starts: list[int]
           ) -> DraftPositions | None:
        """Those of a step whose row s's tokens begin at ``starts[s]``; None when no row
        verifies drafts (each samples its last)."""
        if not any(item.draft_token_ids for item in scheduled):
            return None
        out = cls([], [], [0])
        for item, start in zip(scheduled, starts):
            count = 1 + len(item.draft_token_ids)
            end = start + item.num_new_tokens
            out.token_indices += range(end - count, end)
            out.counts.append(count)
            out.offsets.append(out.offsets[-1] + count)
        return out

    def repeat(self, per_row: list) -> list:
        """``per_row`` (one entry per row) with row s's entry ``counts[s]`` times."""
        return [x for x, count in zip(per_row, self.counts) for _ in range(count)]


class SampledTokens:
    """One step's sampled tokens (and logprobs), on their way to the host."""

    def __init__(self, tokens: torch.Tensor, samples: list[bool],
                 logprobs: tuple[torch.Tensor, ...] | None, num_logprobs: list[int | None],
                 prompt: PromptTargets | None = None,
                 prompt_logprobs: tuple[torch.Tensor, ...] | None = None,
                 drafts: DraftPositions | None = None,
                 failed: dict[int, Exception] | None = None):
        self.samples = samples  # per row: whether it reached its sequence's last token
        # row -> the error that its own rules or draw raised: that request alone fails
        self.failed = failed or {}
        # row s's draws: tokens[offsets[s]:offsets[s + 1]] (None: tokens[s], one per row)
        self.offsets = None if drafts is None else drafts.offsets
        # on CUDA: non-blocking copies into pinned memory, then an event to wait for
        self._tokens = tokens.to("cpu", non_blocking=True)
        self._logprobs, self._prompt_logprobs = (None if t is None else tuple(
            x.to("cpu", non_blocking=True) for x in t) for t in (logprobs, prompt_logprobs))
        self._num_logprobs = num_logprobs
        self.prompt = prompt
        self._ready = None
        if tokens.is_cuda:
            self._ready = torch.cuda.Event()
            self._ready.record()

    def wait(self) -> tuple[list[int], list[dict[int, float] | None] | None]:
        """Block until they are on the host: the token of every scheduled sequence (entries
        of sequences still mid-prefill are meaningless; with drafts, each row's draws from
        ``offsets[s]``) and the logprobs, one entry per token (see
        :func:`~cbatch.core.sampler.logprobs_tensors`)."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._tokens.tolist(), logprobs_lists(self._logprobs, self._num_logprobs)

    def prompt_logprobs(self) -> list[list[dict[int, float]]] | None:
        """Per row, the logprobs of the prompt tokens this step scored (``{token id:
        logprob}``: its k most likely and the prompt's own token), after :meth:`wait`; None
        when no row asked."""
        if self.prompt is None:
            return None
        flat = logprobs_lists(self._prompt_logprobs, self.prompt.num_logprobs)
        out, i = [], 0
        for count in self.prompt.counts:
            out.append(flat[i:i + count])
            i += count
        return out
