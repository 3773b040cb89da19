"""Speculative decoding: who drafts, what a draft costs the scheduler, and which drafts a
step's samples accept.  No torch here (numpy for the lookup).

A decoding request that speculates (:func:`speculates`) gets drafts before each step
(:class:`NgramProposer`: prompt lookup; :class:`cbatch.core.draft_model.DraftModelProposer`: a
smaller model; ``Engine.proposer`` is any :class:`Proposer`, which a benchmark may replace), as
many as
:class:`AdaptiveDraftLength` grants it from its recent acceptance.  The scheduler gives its
last token and up to k of its drafts one run of the step's flat batch, as it gives a prefill
chunk several tokens, and the model runner samples the target at every one of those
positions, each draw at the request's own uniform for that output position
(:func:`cbatch.core.sampler.uniforms`).  :func:`accepted_tokens` keeps the drafts while they
equal those draws, then the first draw that differs (or the one after the last draft): 1 to
k + 1 tokens per step.

Why this is exact.  For greedy rows the draw is the argmax: the longest prefix of drafts that
the target itself would have chosen, plus its own next token.  For sampled rows it is
rejection sampling (Leviathan et al. 2023) with the n-gram draft's distribution, a point
mass on the draft d: accept d with probability p(d), else draw from the residual
(p - onehot(d))+ normalised, i.e. from p without d.  Drawing X ~ p and accepting iff X = d
has exactly that law (P(accept) = p(d); given a rejection X is distributed as p restricted
to tokens other than d), so each position's output token is distributed as the target's,
and since X is the draw the request would make without speculation (same uniform, same
rule), a seeded request's tokens do not depend on whether, or how much, it speculated.

Requests whose logits rules carry state from token to token or are per row (penalties,
min_tokens, bad words, logit_bias, allowed ids, min_p, structured outputs) or that ask for
logprobs do not speculate: they decode one token per step, in the same steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from cbatch.config import SpeculativeConfig
from cbatch.sampling_params import SamplingParams


def speculates(params: SamplingParams) -> bool:
    """Whether a request with ``params`` verifies drafts (see the module's last paragraph)."""
    return not params.processes_logits and params.logprobs is None


def ngram_lookup(token_ids: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Prompt lookup: the up to ``k`` tokens that followed the earliest earlier occurrence of
    the longest suffix of ``token_ids: int64 [L]`` that is ``max_n`` down to ``min_n``
    tokens long; empty when no such suffix occurred before.

    >>> ngram_lookup(np.array([1, 2, 3, 9, 1, 2]), 1, 3, 2).tolist()
    [3, 9]
    """
    L = len(token_ids)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        # windows starting at 0 .. L-1-n: each has a token after it, the suffix itself not
        windows = sliding_window_view(token_ids[:L - 1], n)  # [L - n, n]
        hits = np.flatnonzero((windows == token_ids[L - n:]).all(axis=1))
        if hits.size:
            start = hits[0] + n
            return token_ids[start:start + k]
    return token_ids[:0]


class Proposer:
    """Who drafts: :meth:`propose_batch` gives each decoding request that speculates its
    drafts before a step.  A subclass implements it, or :meth:`propose` (one request at a
    time, from its tokens alone); ``Engine.proposer`` may be replaced by any subclass (a
    benchmark does, bench_spec_decode.py)."""

    # seconds the last propose_batch spent catching a request's draft state up beyond its
    # last k + 1 tokens (a whole prompt, the tokens of a pause): not what drafting costs a
    # step, so the adaptive rule's cost leaves it out
    catch_up_s: float = 0.0

    def propose(self, token_ids: list[int]) -> list[int]:
        """Up to k drafts to follow ``token_ids`` (a request's prompt and output)."""
        raise NotImplementedError

    def propose_batch(self, seqs: list, ks: list[int]) -> list[list[int]]:
        """For each of ``seqs`` (decoding :class:`~cbatch.core.sequence.Sequence`), up to
        ``ks[i]`` drafts to follow its tokens (none where ``ks[i]`` is 0)."""
        return [self.propose(seq.token_ids)[:k] if k else [] for seq, k in zip(seqs, ks)]

    def release(self, request_id: str) -> None:
        """Forget a finished request (what a proposer keeps per request)."""


class NgramProposer(Proposer):
    """Drafts of the ``ngram`` method (:func:`ngram_lookup` over prompt + output)."""

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, token_ids: list[int]) -> list[int]:
        if len(token_ids) <= self.min_n:
            return []
        return ngram_lookup(np.asarray(token_ids, dtype=np.int64), self.min_n, self.max_n,
                            self.k).tolist()


class AdaptiveDraftLength:
    """Each request's draft length from its recent acceptance and what drafting costs
    (``adaptive``, on by default).

    A request keeps ``Sequence.spec_acceptance``, an exponential moving average (weight
    :attr:`WEIGHT` on the newest) of accepted / drafted over its verifications.  It starts at
    the engine's own average over recent verifications of all requests (:attr:`prior`,
    weight :attr:`PRIOR_WEIGHT`, 1 at first).  While a request's average is at least
    :attr:`threshold` it drafts k tokens; below, it drafts none (decoding exactly as without
    speculation, at no drafting cost) but for a probe of one draft after
    :attr:`PROBE_EVERY` steps, then twice as many after each probe that fails, up to
    :attr:`MAX_PROBE_EVERY`.  A request that starts paused (the prior is below the
    threshold: this engine's drafts have been failing) probes only if it is one in
    :attr:`PROBING_SHARE` of such requests, after :attr:`FIRST_PROBE_PAUSED` steps: its first
    probe costs a draft model the catch-up of its whole prompt, and what the few learn
    (through the prior) the others need not pay for.

    The threshold is where drafting stops paying.  With acceptance a per draft, a step that
    verifies k drafts gains 1 + a + ... + a^k tokens, and costs 1 + k (c + v) steps: c is
    :attr:`cost`, the engine's measured drafting seconds per draft position over the
    verifying step's seconds, times the step's rows per row that drafted (drafting holds up
    the whole step; about 0 for prompt lookup, about 0.4 for a random distilgpt2 drafting for
    every row of gpt2's), and v = :attr:`VERIFY_COST` what a verified draft adds to a step.
    The threshold is the a where the two are equal, and never below :attr:`THRESHOLD`.

    So drafts that never match cost a new engine's first requests a few verifications each,
    and later ones a probe or two; drafts that always match keep k.  With ``adaptive`` off
    every request drafts k (what the proposer finds).
    """

    WEIGHT = 0.3
    PRIOR_WEIGHT = 0.05
    THRESHOLD = 0.2
    PROBE_EVERY = 16
    MAX_PROBE_EVERY = 128
    FIRST_PROBE_PAUSED = 64
    PROBING_SHARE = 8
    NEVER = 1 << 62  # (steps before the probe of a request that starts paused and never probes)
    COST_WEIGHT = 0.2
    # a verified draft's share of a step: the verifier's ceiling on random:gpt2 (every draft
    # right, k = 4) gives 5 tokens for 1.35 (batch 1) to 1.7 (batch 8) steps' time
    VERIFY_COST = 0.1

    def __init__(self, k: int, adaptive: bool = True):
        self.k, self.adaptive = k, adaptive
        self.prior = 1.0
        self.cost = 0.0
        self._paused_starts = 0  # requests that started paused so far
        self.threshold = self._threshold()

    def _threshold(self) -> float:
        target = 1 + self.k * (self.cost + self.VERIFY_COST)
        lo, hi = 0.0, 1.0  # (1 + a + ... + a^k) grows with a: bisect for it = target
        for _ in range(30):
            mid = (lo + hi) / 2
            if sum(mid ** i for i in range(self.k + 1)) < target:
                lo = mid
            else:
                hi = mid
        return max(self.THRESHOLD, hi)

    def draft_length(self, seq) -> int:
        """How many drafts ``seq`` (a decoding :class:`~cbatch.core.sequence.Sequence` that
        speculates) asks for before this step: k, 1 for a probe, or 0 while paused; a paused
        request's every call counts towards its next probe."""
        if not self.adaptive:
            return self.k
        if seq.spec_acceptance is None:  # its first decoding step
            seq.spec_acceptance = self.prior
            seq.spec_probe_every = self.PROBE_EVERY
            if self.prior < self.threshold:
                self._paused_starts += 1
                seq.spec_probe_every = (self.FIRST_PROBE_PAUSED if
                                        self._paused_starts % self.PROBING_SHARE == 1
                                        else self.NEVER)
        if seq.spec_acceptance >= self.threshold:
            return self.k
        seq.spec_steps_paused += 1
        if seq.spec_steps_paused < seq.spec_probe_every:
            return 0
        seq.spec_steps_paused = 0
        seq.spec_probe_every = min(2 * seq.spec_probe_every, self.MAX_PROBE_EVERY)
        return 1

    def observe(self, seq, num_drafts: int, num_accepted: int) -> None:
        """``seq`` verified ``num_drafts`` (>= 1) drafts and the first ``num_accepted``
        held."""
        rate = num_accepted / num_drafts
        self.prior += self.PRIOR_WEIGHT * (rate - self.prior)
        if seq.spec_acceptance is None:  # (adaptive off: no state of its own)
            return
        seq.spec_acceptance += self.WEIGHT * (rate - seq.spec_acceptance)
        if seq.spec_acceptance >= self.threshold:
            seq.spec_probe_every = self.PROBE_EVERY

    def observe_cost(self, draft_s: float, num_positions: int, rows_per_drafter: float,
                     step_s: float) -> None:
        """A step verified drafts of up to ``num_positions`` positions, drafted in
        ``draft_s`` seconds, and took ``step_s`` seconds itself; it ran
        ``rows_per_drafter`` rows for each row that drafted (drafting holds every row of
        the step up, and gains only for those that drafted).  Steps of probes alone (one
        draft) are not counted: what drafting costs is what drafting k costs."""
        if num_positions == self.k and step_s > 0:
            c = draft_s / num_positions / step_s * rows_per_drafter
            self.cost += self.COST_WEIGHT * (c - self.cost)
            self.threshold = self._threshold()


def accepted_tokens(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a step adds to a sequence that verified ``drafts`` ([k]): ``sampled``
    ([k + 1]) holds the target's draw at each of the k + 1 positions (after its last token
    and after each draft).  Drafts are kept while each equals the draw at its position;
    then the first draw that differs, or the draw after the last draft: the accepted drafts
    and one token of the target's own."""
    for j, d in enumerate(drafts):
        if sampled[j] != d:
            return sampled[:j + 1]
    return sampled[:len(drafts) + 1]


@dataclass
class SpecDecodeCounters:
    """What speculation did, as vLLM counts it (``vllm:spec_decode_*``): drafts (a sequence
    verifying drafts in a step), draft tokens verified, draft tokens accepted, accepted
    tokens by draft position, and the seconds spent drafting and in verifying steps."""

    k: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.k

    def count(self, num_drafts: int, num_accepted: int) -> None:
        """One sequence's verification: ``num_drafts`` drafts, the first ``num_accepted``
        of them accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1
