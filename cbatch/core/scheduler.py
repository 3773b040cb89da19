"""Iteration-level scheduling (Orca, vLLM): which sequences run this step, with how many
tokens.  No torch here.

Every step spends a token budget (``max_num_batched_tokens``) and a sequence cap
(``max_num_seqs``): running decodes first, then running prefills (the next chunk of a long
prompt), then waiting requests in policy order.  When a running sequence needs a block and
none is free, the lowest-priority running sequence is preempted (recompute: its blocks are
freed and it waits again).  A waiting request is admitted only when the blocks for all its
current tokens are free, so a preempted request does not come straight back and thrash.

With prefix caching, a request is admitted with the cached prefix of its tokens already
computed: it counts only the blocks it really needs, and its first chunk starts at the first
uncached token.  The blocks a step filled are registered in the cache at the start of the
next ``schedule()`` (and when a sequence leaves or is preempted), once the step writing their
K/V has been launched: the device runs steps in order, so no later step reads them early.

A prompt that many requests share is prefilled once, not once per request (SGLang's
in-batch prefix caching): a waiting request whose next uncached full block a sequence of this
step is filling with the same tokens waits one step, then finds that block in the cache.
Each such wait coincides with a step that fills the block, so a request waits at most once
per block of its prompt that another request is filling.

Speculative decoding (``core/spec_decode/``): a decoding sequence with drafts
(``Sequence.spec_token_ids``) verifies as many of them as the budget and the free blocks left
by every running sequence's own tokens allow (drafts never preempt anyone), and no more than
``max_tokens`` leaves room for; its step then feeds its last token and those drafts
(``ScheduledSequence.draft_token_ids``).  Only verified tokens count as computed, so the
prefix cache never hashes a draft, and the blocks that rejected drafts took past a sequence's
tokens go back at the next ``schedule()``.

With async scheduling (the engine schedules step n+1 while step n runs) a sequence's newest
token may still be in flight: it is scheduled like any known token, except that a sequence
whose in-flight token is its last (``max_tokens``) needs nothing more: it leaves ``running``
and gives its blocks back at once, as it would have finished by now without async
scheduling (the engine finishes it when the token arrives).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cbatch.config import POLICIES
from cbatch.core.block_manager import BlockManager, PrefixMatch
from cbatch.core.sequence import Sequence, SequenceStatus


def policy_key(policy: str):
    """Sort key: lower runs first (and is preempted last)."""
    if policy == "fcfs":
        return lambda s: (s.arrival_order,)
    if policy == "priority":
        return lambda s: (s.priority, s.arrival_order)
    if policy == "sjf":
        return lambda s: (s.params.max_tokens - s.num_output_tokens, s.arrival_order)
    raise ValueError(f"scheduling_policy must be one of {POLICIES}, got {policy!r}")


@dataclass
class ScheduledSequence:
    seq: Sequence
    # tokens fed this step: the uncomputed ones, or a chunk of them; then the drafts
    num_new_tokens: int
    draft_token_ids: list[int] = field(default_factory=list)  # the drafts this step verifies

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's last token (and so samples the next)."""
        return (self.seq.num_computed_tokens + self.num_new_tokens - len(self.draft_token_ids)
                == self.seq.num_tokens)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # (source, destination) blocks whose K/V must be copied before this step writes the cache:
    # cached tokens at the start of a block a new request cannot share (block_manager.py)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    pad_to: int = 0  # run a decode step with at least this many rows (static batching)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, policy: str = "fcfs"):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self._key = policy_key(policy)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_cache_queried_tokens = 0  # tokens of admitted requests looked up in the cache
        self.num_cache_hit_tokens = 0  # of which were found there (and not computed)

    # -------------------------------------------------------------- membership

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and give its blocks back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def stats(self) -> dict:
        """What it counts, as :class:`~cbatch.core.stats.EngineStats`'s fields."""
        return dict(num_running=len(self.running), num_waiting=len(self.waiting),
                    num_preemptions=self.num_preemptions,
                    prefix_cache_queried_tokens=self.num_cache_queried_tokens,
                    prefix_cache_hit_tokens=self.num_cache_hit_tokens)

    # -------------------------------------------------------------- scheduling

    def _cache_computed(self, seq: Sequence) -> None:
        # a token still in flight has K/V (or soon will) but no id to hash yet
        self.block_manager.cache_computed(seq.block_table, seq.block_hashes, seq.token_ids,
                                          min(seq.num_computed_tokens, len(seq.token_ids)))

    def _release(self, seq: Sequence) -> None:
        """Give the sequence's blocks back, caching the ones it computed."""
        if not seq.block_table:
            return  # it holds none: waiting, or retired by _retire_last_in_flight
        self._cache_computed(seq)
        self.block_manager.free(seq.block_table)
        seq.block_hashes.clear()

    def _filled_this_step(self, seq: Sequence, match: PrefixMatch,
                          scheduled: list[ScheduledSequence]) -> bool:
        """Whether a sequence scheduled this step fills, with ``seq``'s own tokens, the
        first full block of ``seq``'s prompt past its cached prefix ``match``."""
        bs = self.block_manager.block_size
        start = len(match.blocks) * bs
        end = start + bs
        if not self.block_manager.enable_prefix_caching or end > seq.num_tokens - 1:
            return False  # (the last token is always computed: match_prefix stops short)
        prefix = seq.token_ids[:end]
        return any(item.seq.num_computed_tokens + item.num_new_tokens
                   - len(item.draft_token_ids) >= end
                   and item.seq.token_ids[start] == prefix[start]
                   and item.seq.token_ids[:end] == prefix for item in scheduled)

    def _admit(self, seq: Sequence, match: PrefixMatch, budget: int,
               out: SchedulerOutput) -> int | None:
        """Start a waiting sequence from its cached prefix ``match``; returns the tokens it
        computes this step, or None when the blocks for all its tokens are not free."""
        bm = self.block_manager
        if bm.blocks_to_admit(match, seq.num_tokens) > bm.num_free_blocks:
            return None
        num_cached = len(match.blocks) * bm.block_size + match.num_copied_tokens
        n = min(seq.num_tokens - num_cached, budget)
        copy = bm.take_prefix(seq.block_table, match, num_cached + n)
        if copy is not None:
            out.block_copies.append(copy)
        seq.block_hashes = match.hashes
        seq.num_computed_tokens = num_cached
        self.num_cache_queried_tokens += seq.num_tokens
        self.num_cache_hit_tokens += num_cached
        return n

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)
        out.preempted.append(seq)

    def _retire_last_in_flight(self) -> None:
        """Release the running sequences whose last token (``max_tokens``) is in flight."""
        done = [s for s in self.running
                if s.num_inflight and s.num_output_tokens >= s.params.max_tokens]
        for seq in done:
            self.running.remove(seq)
            self._release(seq)

    def _schedule_drafts(self, scheduled: list[ScheduledSequence], budget: int) -> int:
        """Add to each scheduled decode its drafts, as many as ``budget``, the free blocks
        and ``max_tokens`` allow (a step adds at most drafts + 1 tokens); returns the
        tokens added."""
        bm, bs, used = self.block_manager, self.block_manager.block_size, 0
        for item in scheduled:
            seq = item.seq
            if not seq.spec_token_ids or not seq.is_decoding:
                continue
            k = min(len(seq.spec_token_ids), budget - used,
                    seq.params.max_tokens - seq.num_output_tokens - 1)
            end = seq.num_computed_tokens + 1  # its last token's slot is already held
            k = min(k, (len(seq.block_table) + bm.num_free_blocks) * bs - end)
            if k <= 0:
                continue
            bm.grow(seq.block_table, end + k)
            item.draft_token_ids = seq.spec_token_ids[:k]
            item.num_new_tokens += k
            used += k
        return used

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        self._retire_last_in_flight()
        for seq in self.running:  # the blocks the last step filled join the cache
            self._cache_computed(seq)
            bm.truncate(seq.block_table, seq.num_tokens)  # taken by rejected drafts
        # Running sequences: decodes first, then prefill chunks, each group in policy order.
        order = sorted(self.running, key=lambda s: (not s.is_decoding, self._key(s)))
        scheduled: dict[int, ScheduledSequence] = {}
        for seq in order:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_uncomputed_tokens, budget)
            if n == 0:
                break
            target = seq.num_computed_tokens + n
            while not bm.can_grow(seq.block_table, target):
                victim = max((s for s in self.running if s is not seq), key=self._key,
                             default=None)
                if victim is None or self._key(victim) < self._key(seq):
                    victim = seq  # nobody of lower priority holds blocks: step aside itself
                if id(victim) in scheduled:
                    budget += scheduled.pop(id(victim)).num_new_tokens
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            bm.grow(seq.block_table, target)
            scheduled[id(seq)] = ScheduledSequence(seq, n)
            budget -= n
        out.scheduled = list(scheduled.values())
        budget -= self._schedule_drafts(out.scheduled, budget)

        # Waiting sequences, unless this step already had to preempt (no thrash).
        if not out.preempted:
            for seq in sorted(self.waiting, key=self._key):
                if budget == 0 or len(self.running) >= self.max_num_seqs:
                    break
                match = bm.match_prefix(seq.token_ids)
                if (seq.params.prompt_logprobs is not None
                        and len(seq.prompt_logprobs) < seq.num_prompt_tokens):
                    match = PrefixMatch()  # its prompt's logprobs need every position computed
                if self._filled_this_step(seq, match, out.scheduled):
                    break  # next step it finds that block cached (in order, as below)
                n = self._admit(seq, match, budget, out)
                if n is None:
                    break  # admit in order: a big request is not overtaken forever
                self.waiting.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                out.scheduled.append(ScheduledSequence(seq, n))
                budget -= n
        return out
