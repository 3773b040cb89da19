"""The engine's one handle on speculative decoding: :class:`SpeculativeDecoder` drafts before
a step (:meth:`~SpeculativeDecoder.propose`), keeps what the step's samples accept
(:meth:`~SpeculativeDecoder.accept`, :func:`accepted_tokens`), learns what drafting costs
(:meth:`~SpeculativeDecoder.step_done`), forgets finished requests
(:meth:`~SpeculativeDecoder.release`) and reports its counters
(:meth:`~SpeculativeDecoder.stats`).  No torch here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from cbatch.config import EngineConfig
from cbatch.core.sequence import Sequence
from cbatch.core.spec_decode.adaptive import AdaptiveDraftLength
from cbatch.core.spec_decode.metrics import SpecDecodeCounters
from cbatch.core.spec_decode.proposer import Proposer, make_proposer
from cbatch.sampling_params import SamplingParams


def speculates(params: SamplingParams) -> bool:
    """Whether a request with ``params`` verifies drafts (the last paragraph of
    :mod:`cbatch.core.spec_decode` says which do not)."""
    return not params.processes_logits and params.logprobs is None


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
class Drafting:
    """The last round of drafting, for the adaptive rule's cost: its seconds but a long
    catch-up's, its positions (the most drafts a request got), and the rows it held up for
    each row that drafted."""

    draft_s: float = 0.0
    num_positions: int = 0
    rows_per_drafter: float = 1.0


class SpeculativeDecoder:
    """Speculation for an engine with ``config.speculative_config``: the proposer of its
    method (:func:`~cbatch.core.spec_decode.proposer.make_proposer`; ``proposer`` may be
    replaced by any :class:`~cbatch.core.spec_decode.proposer.Proposer`, as
    bench_spec_decode.py does), each request's draft length
    (:class:`~cbatch.core.spec_decode.adaptive.AdaptiveDraftLength`) and the counters
    (:class:`~cbatch.core.spec_decode.metrics.SpecDecodeCounters`)."""

    def __init__(self, config: EngineConfig, vocab_size: int, max_model_len: int):
        spec = config.speculative_config
        self.proposer: Proposer = make_proposer(spec, config, vocab_size, max_model_len)
        self.draft_length = AdaptiveDraftLength(spec.num_speculative_tokens, spec.adaptive)
        self.counters = SpecDecodeCounters(spec.num_speculative_tokens)
        self.drafting = Drafting()

    def propose(self, running: list[Sequence]) -> None:
        """Draft for every running request that decodes and speculates (its
        ``spec_token_ids``; the others get none); the scheduler decides how many of them its
        step verifies."""
        start = time.perf_counter()
        seqs = []
        for seq in running:
            seq.spec_token_ids = []
            if seq.is_decoding and speculates(seq.params):
                seqs.append(seq)
        ks = [self.draft_length.draft_length(seq.request_id) for seq in seqs]
        catch_up_s = 0.0
        if any(ks):
            for seq, k, drafts in zip(seqs, ks, self.proposer.propose_batch(seqs, ks)):
                seq.spec_token_ids = drafts[:k]
            catch_up_s = self.proposer.catch_up_s
        seconds = time.perf_counter() - start
        self.counters.draft_s += seconds
        drafting = sum(k > 0 for k in ks)
        self.drafting = Drafting(seconds - catch_up_s, max(ks, default=0),
                                 len(running) / max(1, drafting))

    def accept(self, request_id: str, drafts: list[int], sampled: list[int]) -> list[int]:
        """The tokens a request that verified ``drafts`` gains from the step's draws
        ``sampled`` (:func:`accepted_tokens`), counted and learnt from."""
        new = accepted_tokens(drafts, sampled)
        self.counters.count(len(drafts), len(new) - 1)
        self.draft_length.observe(request_id, len(drafts), len(new) - 1)
        return new

    def step_done(self, step_s: float) -> None:
        """A step that verified the last drafting took ``step_s`` seconds (launch to tokens
        on the host)."""
        self.counters.verify_s += step_s
        d = self.drafting
        self.draft_length.observe_cost(d.draft_s, d.num_positions, d.rows_per_drafter, step_s)

    def release(self, request_id: str) -> None:
        """Forget a finished request (its proposer's state, its draft length's)."""
        self.proposer.release(request_id)
        self.draft_length.release(request_id)

    def stats(self) -> dict:
        """``EngineStats``'s ``spec_decode_*`` fields."""
        return self.counters.stats()
