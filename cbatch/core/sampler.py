"""Batched token sampling: the logits rules of vLLM's ``SamplingParams``, greedy, and one
seeded draw per sampled row.

A step's ``[S, vocab]`` logits go through, in vLLM's order:

1. the rules that change logits, only for the rows that ask for them (:class:`LogitsRules`):
   a grammar's token bitmask, ``allowed_token_ids``, ``bad_words`` and ``min_tokens`` (banned
   tokens), ``logit_bias``, then the repetition, frequency and presence penalties, which read
   each request's token counts (:class:`TokenCounts`, kept on the device and updated by the
   sampler itself after every draw, so never rebuilt from the token lists);
2. greedy rows: the argmax of what step 1 left;
3. sampled rows: temperature, ``min_p``, ``top_k``, ``top_p`` and the draw, per row and
   without sorting the vocabulary (:func:`cbatch.ops.sampling.draw`: cbatch's C++ kernel on
   the CPU, Triton on CUDA, else the sorting reference).

The kernels of each stage are :mod:`cbatch.ops.sampling`'s; this module decides which rows
get which rule.

A row's draw is the first token, in vocabulary order, whose running probability passes a
uniform ``u`` in [0, 1) that comes from the request's seed and output position alone
(:func:`uniforms`): a request's tokens do not depend on what else is in the batch.
Steps where no row asks for a rule of step 1 run none of it (no copy of the logits either).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from cbatch.devices import to_device
from cbatch.ops import sampling

if TYPE_CHECKING:
    from cbatch.core.sequence import Sequence

_MASK64 = 2**64 - 1


@dataclass
class LogitsRules:
    """One step's rules other than temperature, top-k, top-p and min-p, for the rows that ask
    for them, as flat host lists (made by :func:`logits_rules`).  Rows index the step's
    ``[S, vocab]`` logits."""

    # rows, tokens, values of logit_bias
    bias: tuple[list[int], list[int], list[float]] = field(default_factory=lambda: ([], [], []))
    # rows, tokens banned by min_tokens and bad_words
    banned: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))
    allowed: list[tuple[int, list[int]]] = field(default_factory=list)  # (row, token ids)
    # penalties: rows, their TokenCounts slots, and each row's presence, frequency and
    # repetition penalty
    penalty_rows: list[int] = field(default_factory=list)
    penalty_slots: list[int] = field(default_factory=list)
    presence: list[float] = field(default_factory=list)
    frequency: list[float] = field(default_factory=list)
    repetition: list[float] = field(default_factory=list)
    counted_rows: list[int] = field(default_factory=list)  # rows whose draw joins the counts
    counts: TokenCounts | None = None

    def row(self, r: int) -> LogitsRules | None:
        """Row ``r``'s rules alone, as row 0 (None when it has none)."""
        def mine(rows: list[int], *values: list) -> tuple[list, ...]:
            picked = [i for i, row in enumerate(rows) if row == r]
            return ([0] * len(picked),) + tuple([v[i] for i in picked] for v in values)

        one = LogitsRules(bias=mine(*self.bias), banned=mine(*self.banned),
                          allowed=[(0, ids) for row, ids in self.allowed if row == r],
                          counts=self.counts)
        (one.penalty_rows, one.penalty_slots, one.presence, one.frequency,
         one.repetition) = mine(self.penalty_rows, self.penalty_slots, self.presence,
                                self.frequency, self.repetition)
        one.counted_rows = [0] * (r in self.counted_rows)
        empty = not (one.bias[0] or one.banned[0] or one.allowed or one.penalty_rows)
        return None if empty else one


@dataclass
class SamplingBatch:
    """Per-row settings for one step's ``[S, vocab]`` logits (host lists, built by the runner)."""

    temperatures: list[float]
    top_ks: list[int]
    top_ps: list[float]
    seeds: list[int]
    positions: list[int]  # how many tokens each request has generated so far
    min_ps: list[float] | None = None  # None: 0 for every row
    rules: LogitsRules | None = None  # None: no row asks for one
    # structured outputs: int32 [S, ceil(vocab / 32)], bit t of row s set where token t may
    # be sampled (xgrammar's token bitmask; rows without a grammar all ones); None: no row
    # has a grammar
    bitmask: torch.Tensor | None = None
    # None: an error of the sampler propagates.  A dict (the engine's steps): a row whose own
    # rules or draw raise is recorded here (row -> error), its token is meaningless, and the
    # other rows get the tokens they would have had (:func:`sample`)
    failed: dict[int, Exception] | None = None

    @property
    def all_greedy(self) -> bool:
        return all(t == 0.0 for t in self.temperatures)

    @property
    def plain(self) -> bool:
        """No row asks for anything but temperature, top-k, top-p and min-p."""
        return self.rules is None and self.bitmask is None

    def row(self, r: int) -> SamplingBatch:
        """Row ``r`` alone, as row 0 of a batch of one (no ``failed``: its errors raise)."""
        return SamplingBatch(
            temperatures=[self.temperatures[r]], top_ks=[self.top_ks[r]],
            top_ps=[self.top_ps[r]], seeds=[self.seeds[r]], positions=[self.positions[r]],
            min_ps=None if self.min_ps is None else [self.min_ps[r]],
            rules=None if self.rules is None else self.rules.row(r),
            bitmask=None if self.bitmask is None else self.bitmask[r:r + 1])


class TokenCounts:
    """Per request that asks for a penalty, on the device: how many times each token is in
    its output (int32 ``[slots, vocab]``) and which tokens are in its prompt (bool
    ``[slots, vocab]``).  A request gets a slot when it first samples with a penalty and keeps
    it until it finishes (preemption keeps its output tokens, so its counts stay right); the
    sampler adds each drawn token (:meth:`add`)."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size, self.device = vocab_size, device
        self.output = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self._slots: dict[str, int] = {}
        self._free: list[int] = []

    def slot(self, seq: Sequence) -> int:
        """The slot of ``seq``, made (from its prompt and the output it has) on first use."""
        s = self._slots.get(seq.request_id)
        if s is not None:
            return s
        if not self._free:
            n = self.output.shape[0]
            grow = max(4, n)
            self.output = torch.cat([self.output, self.output.new_zeros(grow, self.vocab_size)])
            self.prompt = torch.cat([self.prompt, self.prompt.new_zeros(grow, self.vocab_size)])
            self._free = list(range(n + grow - 1, n - 1, -1))
        s = self._free.pop()
        self._slots[seq.request_id] = s
        self.prompt[s].zero_()
        self.prompt[s, to_device(seq.prompt_token_ids, self.device)] = True
        self.output[s].zero_()
        if seq.output_token_ids:
            ids = to_device(seq.output_token_ids, self.device)
            self.output[s].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        return s

    def release(self, request_id: str) -> None:
        s = self._slots.pop(request_id, None)
        if s is not None:
            self._free.append(s)

    def add(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count ``tokens: int64 [P]`` in the outputs of ``slots: int64 [P]``."""
        self.output.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.int32),
                               accumulate=True)


def logits_rules(seqs: list[Sequence], samples: list[bool], eos_token_ids: frozenset[int],
                 counts: TokenCounts, failed: dict[int, Exception] | None = None
                 ) -> LogitsRules | None:
    """The :class:`LogitsRules` of a step's sequences (row s is ``seqs[s]``; ``samples[s]``:
    whether its draw is kept); None when none asks for one.  Bad words of more than one token
    read the output on the host, so their requests run with the previous step resolved
    (:attr:`SamplingParams.needs_output_on_host`).  ``failed`` (a dict): a row whose rules
    raise is recorded there and gets none (else the error propagates)."""
    rules = None
    for row, seq in enumerate(seqs):
        if not seq.params.processes_logits:
            continue
        rules = rules or LogitsRules()
        try:
            _add_rules(rules, row, seq, samples, eos_token_ids, counts)
        except Exception as exc:
            if failed is None:
                raise
            failed[row] = exc  # this row's own: it alone fails
    return rules


def _add_rules(rules: LogitsRules, row: int, seq: Sequence, samples: list[bool],
               eos_token_ids: frozenset[int], counts: TokenCounts) -> None:
    """Add ``seq``'s rules as row ``row``: what can raise runs first, so a row that raises
    adds nothing."""
    p = seq.params
    banned: set[int] = set()
    if seq.num_output_tokens < p.min_tokens:
        banned.update(p.stop_token_ids)
        if not p.ignore_eos:
            banned.update(eos_token_ids)
    if seq.bad_words_token_ids:
        out = seq.output_token_ids
        for word in seq.bad_words_token_ids:
            head = word[:-1]
            if not head or (len(out) >= len(head) and tuple(out[-len(head):]) == head):
                banned.add(word[-1])
    slot = counts.slot(seq) if p.penalized else None
    if p.logit_bias:
        rules.bias[0].extend([row] * len(p.logit_bias))
        rules.bias[1].extend(p.logit_bias)
        rules.bias[2].extend(p.logit_bias.values())
    if banned:
        rules.banned[0].extend([row] * len(banned))
        rules.banned[1].extend(banned)
    if p.allowed_token_ids is not None:
        rules.allowed.append((row, p.allowed_token_ids))
    if slot is not None:
        rules.counts = counts
        rules.penalty_rows.append(row)
        rules.penalty_slots.append(slot)
        rules.presence.append(p.presence_penalty)
        rules.frequency.append(p.frequency_penalty)
        rules.repetition.append(p.repetition_penalty)
        if samples[row]:
            rules.counted_rows.append(row)


def apply_rules(logits: torch.Tensor, rules: LogitsRules | None,
                bitmask: torch.Tensor | None) -> None:
    """Apply step 1 of the module's rules to ``logits: fp32 [S, V]``, in place."""
    if bitmask is not None:
        sampling.apply_bitmask(logits, bitmask)
    if rules is None:
        return
    dev, V = logits.device, logits.shape[-1]
    for row, ids in rules.allowed:
        keep = torch.zeros(V, dtype=torch.bool, device=dev)
        keep[to_device(ids, dev)] = True
        logits[row].masked_fill_(~keep, float("-inf"))
    if rules.banned[0]:
        logits[to_device(rules.banned[0], dev), to_device(rules.banned[1], dev)] = float("-inf")
    if rules.bias[0]:
        logits.index_put_((to_device(rules.bias[0], dev), to_device(rules.bias[1], dev)),
                          to_device(rules.bias[2], dev, torch.float32), accumulate=True)
    if rules.penalty_rows:
        values = [to_device(v, dev, torch.float32)
                  for v in (rules.presence, rules.frequency, rules.repetition)]
        sampling.apply_penalties(logits, to_device(rules.penalty_rows, dev),
                                 to_device(rules.penalty_slots, dev), rules.counts.output,
                                 rules.counts.prompt, *values)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniforms(seeds: list[int], positions: list[int]) -> list[float]:
    """One uniform in [0, 1) per (request seed, output position): the request's own stream,
    53 random bits each (splitmix64 of the seed, then of the position)."""
    return [(_splitmix64(_splitmix64(s) ^ p) >> 11) * 2.0**-53
            for s, p in zip(seeds, positions)]


def _draw(logits: torch.Tensor, rows: list[int], batch: SamplingBatch) -> torch.Tensor:
    """The draw of the sampled ``rows`` of ``logits`` by ``batch``'s settings."""
    dev = logits.device
    min_ps = batch.min_ps or [0.0] * len(batch.temperatures)
    return sampling.draw(
        logits, to_device(rows, dev),
        to_device([batch.temperatures[r] for r in rows], dev, torch.float32),
        to_device([batch.top_ks[r] for r in rows], dev, torch.int64),
        to_device([batch.top_ps[r] for r in rows], dev, torch.float32),
        to_device([min_ps[r] for r in rows], dev, torch.float32),
        to_device(uniforms([batch.seeds[r] for r in rows],
                           [batch.positions[r] for r in rows]), dev, torch.float64))


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``logits: [S, V]`` → int64 token ids ``[S]`` (``logits`` itself is never changed).

    With ``batch.failed`` a dict, an error while applying the rules or drawing does not end
    the step: the rows are sampled again one at a time, and those that raise alone are
    recorded in it (their tokens are 0); the others get the tokens they would have had,
    since a row's token never depends on the other rows."""
    if batch.failed is None:
        return _sample(logits, batch)
    try:
        return _sample(logits, batch)
    except Exception:
        pass
    tokens = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
    for r in range(logits.shape[0]):
        if r in batch.failed:  # its rules failed already: not drawn
            continue
        try:
            tokens[r] = _sample(logits[r:r + 1], batch.row(r))[0]
        except Exception as exc:
            batch.failed[r] = exc
    return tokens


def _sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if not batch.plain:
        logits = logits.to(torch.float32, copy=True)
        apply_rules(logits, batch.rules, batch.bitmask)
    tokens = sampling.argmax(logits)
    # a row whose top_p is at most 1 / V keeps its most likely token alone, whatever its
    # temperature (that token's probability is at least 1 / V): its draw is the argmax, which
    # float32 weights tied at a huge temperature would not tell apart
    V = logits.shape[-1]
    rows = [r for r, (t, p) in enumerate(zip(batch.temperatures, batch.top_ps))
            if t > 0 and p * V > 1]
    if rows:
        tokens[to_device(rows, logits.device)] = _draw(logits, rows, batch)
    rules = batch.rules
    if rules is not None and rules.counted_rows:
        slot_of = dict(zip(rules.penalty_rows, rules.penalty_slots))
        dev = logits.device
        rules.counts.add(to_device([slot_of[r] for r in rules.counted_rows], dev),
                         tokens[to_device(rules.counted_rows, dev)])
    return tokens


def logprobs_tensors(logits: torch.Tensor, tokens: torch.Tensor,
                     num_logprobs: list[int | None]) -> tuple[torch.Tensor, ...] | None:
    """Log-probabilities of the sampled tokens and the most likely alternatives, on the
    device (no host sync; :func:`logprobs_lists` reads them).

    ``logits: [S, V]`` are the rows :func:`sample` drew ``tokens: [S]`` from; row s asks for
    ``num_logprobs[s]`` alternatives (None: nothing).  The log-probabilities are the
    log-softmax of the model's raw logits in fp32, before temperature, top-k and top-p (what
    vLLM returns by default), so they do not depend on how a request is sampled.  For the R
    rows that ask: ``(top values [R, k], top ids [R, k], sampled ids [R], sampled values
    [R])``, k the most any row asks for; None when no row asks (nothing is computed then)."""
    rows = [s for s, k in enumerate(num_logprobs) if k is not None]
    if not rows:
        return None
    idx = to_device(rows, logits.device)
    logprobs = logits[idx].float().log_softmax(dim=-1)  # [R, V]
    k = min(max(num_logprobs[s] for s in rows), logprobs.shape[-1])  # (at most the vocab)
    top_values, top_ids = logprobs.topk(k, dim=-1)
    sampled_ids = tokens[idx]
    sampled = logprobs.gather(-1, sampled_ids[:, None])[:, 0]
    return top_values, top_ids, sampled_ids, sampled


def logprobs_lists(tensors: tuple[torch.Tensor, ...] | None, num_logprobs: list[int | None]
                   ) -> list[dict[int, float] | None] | None:
    """:func:`logprobs_tensors`' result on the host: per row, ``{token id: logprob}`` holding
    the k most likely tokens, most likely first, then the sampled token if it is not among
    them; None for rows that asked for nothing, and None for the whole step when no row
    asked."""
    if tensors is None:
        return None
    top_values, top_ids, sampled_ids, sampled = (t.tolist() for t in tensors)
    out: list[dict[int, float] | None] = [None] * len(num_logprobs)
    rows = [s for s, k in enumerate(num_logprobs) if k is not None]
    for i, (s, token, value) in enumerate(zip(rows, sampled_ids, sampled)):
        k = num_logprobs[s]
        entry = dict(zip(top_ids[i][:k], top_values[i][:k]))
        entry.setdefault(token, value)
        out[s] = entry
    return out
