"""The ``draft_model`` method of speculative decoding: a smaller model with the target's
vocabulary drafts k tokens per request, k autoregressive steps batched across requests, on a
paged KV cache of its own (:mod:`cbatch.core.spec_decode` says how drafts are verified).

The draft model runs through cbatch's own model runner (the same step batches, kernels and
greedy fast path as the target) on its own :class:`~cbatch.layers.kv_cache.KVCache` and
:class:`~cbatch.core.block_manager.BlockManager`: a :class:`~cbatch.core.worker.Worker` of its
own.  Each request it drafts for keeps a block table there and the count of its tokens whose
draft K/V are written.  Drafting for a set of
requests is one pass per draft position:

1. *catch up and draft 1*: each request's tokens that its draft cache lacks (its whole prompt
   the first time; after that the tokens the last step accepted: the target's own token and
   any accepted drafts) run as one run of a flat batch, and the draft's greedy token after the
   last is draft 1.  A catch-up longer than k + 1 tokens (a prompt) is first prefilled in
   chunks that fit the pass's token budget;
2. *drafts 2..k*: one token per request per pass, the previous draft, for the requests that
   want that many.

The drafts are the draft model's greedy tokens: a point mass, which the engine's
verification accepts exactly as the target would sample (spec_decode's module note).  The
K/V of a rejected draft stay where they were written, past the request's verified tokens:
the next catch-up starts at the first token that differs and writes over them, and nothing
reads a slot before it is written again.  A request whose draft cache cannot grow (the
draft's pool is full) or that would pass the draft model's context drafts less, or none.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from cbatch.config import EngineConfig, SpeculativeConfig
from cbatch.core.sampler import SamplingBatch
from cbatch.core.spec_decode.proposer import Proposer
from cbatch.core.worker import build_worker, weight_place
from cbatch.logger import init_logger
from cbatch.models.loader import load_model

logger = init_logger(__name__)


@dataclass
class _Drafted:
    """What the draft cache holds for one request: ``block_table``; the request's first
    ``verified`` tokens, whose K/V are written; and ``tail``, the drafts written after them
    (the request's next tokens if the target accepted them)."""

    block_table: list[int] = field(default_factory=list)
    verified: int = 0
    tail: list[int] = field(default_factory=list)

    def cached(self, token_ids: list[int]) -> int:
        """How many of ``token_ids`` (the request's tokens now) have their K/V written."""
        n, start = 0, self.verified
        for draft, token in zip(self.tail, token_ids[start:]):
            if draft != token:
                break
            n += 1
        return start + n


class DraftModelProposer(Proposer):
    """Drafts from ``config.model`` (``random:<name>``, a checkpoint directory or a hub id),
    built like the target (``engine_config``'s device, dtype, seed, threads, block size),
    whose vocabulary must be the target's (``vocab_size``)."""

    def __init__(self, config: SpeculativeConfig, engine_config: EngineConfig,
                 vocab_size: int, max_model_len: int):
        cfg = engine_config
        self.k = config.num_speculative_tokens
        self.model = load_model(config.model, cfg.device, cfg.torch_dtype, cfg.seed,
                                cfg.attention_backend, place=weight_place(cfg.device))
        if self.model.config.vocab_size != vocab_size:
            raise ValueError(f"speculative_config: the draft model {config.model!r} has a "
                             f"vocabulary of {self.model.config.vocab_size} tokens, the target "
                             f"{vocab_size}; a draft model must share the target's tokenizer")
        self.max_model_len = min(max_model_len, self.model.config.max_model_len)
        # one pass holds every request's catch-up of up to k + 1 tokens
        self.max_tokens = max(cfg.max_num_batched_tokens, cfg.max_num_seqs * (self.k + 1))
        # (its passes of one token a row, and its first of up to k + 1, in CUDA graphs)
        self.worker = build_worker(self.model, cfg, self.max_tokens)
        self.blocks, self.runner = self.worker.block_manager, self.worker.runner
        self._drafted: dict[str, _Drafted] = {}
        self.num_passes = 0  # forward passes of the draft model so far

    def release(self, request_id: str) -> None:
        drafted = self._drafted.pop(request_id, None)
        if drafted is not None:
            self.blocks.free(drafted.block_table)

    def propose_batch(self, seqs: list, ks: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        rows = []  # (index into seqs, its _Drafted, tokens to feed, cached, drafts wanted)
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            tokens = seq.token_ids
            k = min(k, self.max_model_len - len(tokens))  # positions the draft model has
            if k <= 0:
                continue
            drafted = self._drafted.setdefault(seq.request_id, _Drafted())
            # writes reach position len(tokens) + k - 2 (the last draft is not fed back)
            if not self.blocks.can_grow(drafted.block_table, len(tokens) + k - 1):
                continue  # the draft pool is full: this request verifies no drafts now
            self.blocks.grow(drafted.block_table, len(tokens) + k - 1)
            # (at least its last token runs again: a request that did not advance since it
            # last drafted, unscheduled or preempted, needs the draft's state after it)
            cached = min(drafted.cached(tokens), len(tokens) - 1)
            rows.append((i, drafted, tokens[cached:], cached, k))
        self.catch_up_s = 0.0
        if not rows:
            return drafts
        start = time.perf_counter()
        self._prefill_long(rows)
        self.catch_up_s = time.perf_counter() - start
        # pass 1: each row's remaining catch-up (at most k + 1 tokens), draft 1 after it
        tail = self.k + 1
        runs = [(feed[-tail:], cached + max(0, len(feed) - tail), d.block_table)
                for _, d, feed, cached, _ in rows]
        nexts = self._greedy(runs)
        for (i, d, *_), token in zip(rows, nexts):
            d.verified, d.tail = len(seqs[i].token_ids), []
            drafts[i].append(token)
        for j in range(1, max(k for *_, k in rows)):  # passes 2..k: one token per row
            live = [(i, d) for i, d, _, _, k in rows if k > j]
            runs = [([drafts[i][-1]], len(seqs[i].token_ids) + j - 1, d.block_table)
                    for i, d in live]
            for (i, d), token in zip(live, self._greedy(runs)):
                d.tail.append(drafts[i][-1])  # its K/V are written now
                drafts[i].append(token)
        return drafts

    def _prefill_long(self, rows: list) -> None:
        """Write the draft K/V of every catch-up token but a row's last k + 1, in passes of
        at most :attr:`max_tokens` tokens (a prompt, the first time a request drafts)."""
        tail = self.k + 1
        pending = [(d, feed[:-tail], cached) for _, d, feed, cached, _ in rows
                   if len(feed) > tail]
        while pending:
            runs, rest, budget = [], [], self.max_tokens
            for d, feed, cached in pending:
                take = min(len(feed), budget)
                if take:
                    runs.append((feed[:take], cached, d.block_table))
                    budget -= take
                if take < len(feed):
                    rest.append((d, feed[take:], cached + take))
            self._greedy(runs)  # (the token after each chunk is not needed)
            pending = rest

    @torch.inference_mode()
    def _greedy(self, runs: list) -> list[int]:
        """One forward pass of the draft model over ``runs`` (``(new tokens, cached,
        block_table)`` each); the greedy token after each run's last."""
        n = len(runs)
        batch = self.runner.build(runs)
        sampling = SamplingBatch(temperatures=[0.0] * n, top_ks=[0] * n, top_ps=[1.0] * n,
                                 seeds=[0] * n, positions=[0] * n)
        tokens, _, _ = self.runner.run(batch, sampling, [None] * n)
        self.num_passes += 1
        return tokens.tolist()

