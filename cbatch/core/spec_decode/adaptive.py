"""The adaptive draft length: each request's number of drafts from its recent acceptance and
what drafting costs (``speculative_config``'s ``adaptive``; vLLM has no such rule).  No torch
here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestDraftState:
    """One request's state in :class:`AdaptiveDraftLength`."""

    acceptance: float  # moving average of accepted / drafted
    probe_every: int  # steps paused before its next probe
    steps_paused: int = 0  # since it last drafted while paused


class AdaptiveDraftLength:
    """Each request's draft length from its recent acceptance and what drafting costs
    (``adaptive``, on by default).

    Each request has its own :class:`RequestDraftState` here (until :meth:`release`): an
    exponential moving average (weight :attr:`WEIGHT` on the newest) of accepted / drafted
    over its verifications.  It starts at the engine's own average over recent verifications
    of all requests (:attr:`prior`, weight :attr:`PRIOR_WEIGHT`, 1 at first).  While a
    request's average is at least :attr:`threshold` it drafts k tokens; below, it drafts
    none (decoding exactly as without speculation, at no drafting cost) but for a probe of
    one draft after :attr:`PROBE_EVERY` steps, then twice as many after each probe that
    fails, up to :attr:`MAX_PROBE_EVERY`.  A request that starts paused (the prior is below
    the threshold: this engine's drafts have been failing) probes only if it is one in
    :attr:`PROBING_SHARE` of such requests, after :attr:`FIRST_PROBE_PAUSED` steps: its
    first probe costs a draft model the catch-up of its whole prompt, and what the few learn
    (through the prior) the others need not pay for.

    The threshold is where drafting stops paying.  With acceptance a per draft, a step that
    verifies k drafts gains 1 + a + ... + a^k tokens, and costs 1 + k (c + v) steps: c is
    :attr:`cost`, the engine's measured drafting seconds per draft position over the
    verifying step's seconds, times the step's rows per row that drafted (drafting holds up
    the whole step; near 0 for prompt lookup, far more for a draft model: benchmarks/NOTES.md,
    "Speculative decoding on the CPU"), and v = :attr:`VERIFY_COST` what a verified draft adds
    to a step.
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
    # a verified draft's share of a step, from the verifier's ceiling (every draft right:
    # benchmarks/NOTES.md, "Speculative decoding on the CPU")
    VERIFY_COST = 0.1

    def __init__(self, k: int, adaptive: bool = True):
        self.k, self.adaptive = k, adaptive
        self.prior = 1.0
        self.cost = 0.0
        self._paused_starts = 0  # requests that started paused so far
        self.threshold = self._threshold()
        self._requests: dict[str, RequestDraftState] = {}  # the decoding ones (adaptive)

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

    def draft_length(self, request_id: str) -> int:
        """How many drafts the request ``request_id`` (decoding, and it speculates) asks for
        before this step: k, 1 for a probe, or 0 while paused; a paused request's every call
        counts towards its next probe."""
        if not self.adaptive:
            return self.k
        r = self._requests.get(request_id)
        if r is None:  # its first decoding step
            r = self._requests[request_id] = RequestDraftState(self.prior, self.PROBE_EVERY)
            if self.prior < self.threshold:
                self._paused_starts += 1
                r.probe_every = (self.FIRST_PROBE_PAUSED if
                                 self._paused_starts % self.PROBING_SHARE == 1 else self.NEVER)
        if r.acceptance >= self.threshold:
            return self.k
        r.steps_paused += 1
        if r.steps_paused < r.probe_every:
            return 0
        r.steps_paused = 0
        r.probe_every = min(2 * r.probe_every, self.MAX_PROBE_EVERY)
        return 1

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """The request ``request_id`` verified ``num_drafts`` (>= 1) drafts and the first
        ``num_accepted`` held."""
        rate = num_accepted / num_drafts
        self.prior += self.PRIOR_WEIGHT * (rate - self.prior)
        r = self._requests.get(request_id)
        if r is None:  # (adaptive off: no state of its own)
            return
        r.acceptance += self.WEIGHT * (rate - r.acceptance)
        if r.acceptance >= self.threshold:
            r.probe_every = self.PROBE_EVERY

    def release(self, request_id: str) -> None:
        """Forget a finished request."""
        self._requests.pop(request_id, None)

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
