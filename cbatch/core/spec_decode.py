"""Speculative decoding: who drafts, what a draft costs the scheduler, and which drafts a
step's samples accept.  No torch here (numpy for the lookup).

A decoding request that speculates (:func:`speculates`) gets drafts before each step
(:class:`NgramProposer`: prompt lookup; ``Engine.proposer`` is any object with
:meth:`NgramProposer.propose`'s signature, which a benchmark may replace), as many as
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


class NgramProposer:
    """Drafts of the ``ngram`` method (:func:`ngram_lookup` over prompt + output)."""

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, token_ids: list[int]) -> list[int]:
        """Up to k draft tokens to follow ``token_ids`` (a request's prompt and output)."""
        if len(token_ids) <= self.min_n:
            return []
        return ngram_lookup(np.asarray(token_ids, dtype=np.int64), self.min_n, self.max_n,
                            self.k).tolist()


class AdaptiveDraftLength:
    """Each request's draft length from its recent acceptance (``adaptive``, on by default).

    A request keeps ``Sequence.spec_acceptance``, an exponential moving average (weight
    :attr:`WEIGHT` on the newest) of accepted / drafted over its verifications, starting at
    1.  While it is at least :attr:`THRESHOLD` the request drafts k tokens; below, it drafts
    none (decoding exactly as without speculation, at no drafting cost) but for one probe of
    k drafts every :attr:`PROBE_EVERY` steps, whose acceptance may lift it back.  Drafts
    that never match therefore stop after 5 verifications (1 -> 0.7 -> ... -> 0.17) and
    then cost one verification in 16 steps; drafts that always match keep k.  With
    ``adaptive`` off every request drafts k (what the proposer finds).
    """

    WEIGHT = 0.3
    THRESHOLD = 0.2
    PROBE_EVERY = 16

    def __init__(self, k: int, adaptive: bool = True):
        self.k, self.adaptive = k, adaptive

    def draft_length(self, seq) -> int:
        """How many drafts ``seq`` (a decoding :class:`~cbatch.core.sequence.Sequence` that
        speculates) asks for before this step: k, or 0 while paused; a paused request's
        every call counts towards its next probe."""
        if not self.adaptive or seq.spec_acceptance >= self.THRESHOLD:
            return self.k
        seq.spec_steps_paused += 1
        if seq.spec_steps_paused < self.PROBE_EVERY:
            return 0
        seq.spec_steps_paused = 0
        return self.k

    def observe(self, seq, num_drafts: int, num_accepted: int) -> None:
        """``seq`` verified ``num_drafts`` (>= 1) drafts and the first ``num_accepted``
        held."""
        seq.spec_acceptance += self.WEIGHT * (num_accepted / num_drafts - seq.spec_acceptance)


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
