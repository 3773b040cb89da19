"""Who drafts: the :class:`Proposer` interface, the ``ngram`` method (prompt lookup,
:class:`NgramProposer`) and :data:`PROPOSERS`, the registry of methods
(:mod:`cbatch.core.spec_decode` says how drafts are verified).  No torch here (numpy for the
lookup).
"""

from __future__ import annotations

import importlib

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from cbatch.config import EngineConfig, SpeculativeConfig


class Proposer:
    """Who drafts: :meth:`propose_batch` gives each decoding request that speculates its
    drafts before a step.  A subclass implements it, or :meth:`propose` (one request at a
    time, from its tokens alone); ``Engine.spec_decoder.proposer`` may be replaced by any
    subclass (a benchmark does, bench_spec_decode.py)."""

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


class NgramProposer(Proposer):
    """Drafts of the ``ngram`` method (:func:`ngram_lookup` over prompt + output)."""

    def __init__(self, config: SpeculativeConfig, engine_config: EngineConfig | None = None,
                 vocab_size: int = 0, max_model_len: int = 0):
        # (the target's engine_config, vocab_size and max_model_len: a lookup needs none)
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, token_ids: list[int]) -> list[int]:
        if len(token_ids) <= self.min_n:
            return []
        return ngram_lookup(np.asarray(token_ids, dtype=np.int64), self.min_n, self.max_n,
                            self.k).tolist()


# method -> (module, class), imported when an engine asks for it (as the model registry
# does); each is built from (its SpeculativeConfig, the target's EngineConfig, the target's
# vocab_size, the target's max_model_len)
PROPOSERS = {
    "ngram": ("cbatch.core.spec_decode.proposer", "NgramProposer"),
    "draft_model": ("cbatch.core.spec_decode.draft_model", "DraftModelProposer"),
}


def make_proposer(config: SpeculativeConfig, engine_config: EngineConfig, vocab_size: int,
                  max_model_len: int) -> Proposer:
    """The proposer of ``config.method`` (:data:`PROPOSERS`) for a target engine."""
    module, name = PROPOSERS[config.method]
    proposer_class = getattr(importlib.import_module(module), name)
    return proposer_class(config, engine_config, vocab_size, max_model_len)
