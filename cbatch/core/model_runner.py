"""Turns a schedule into the step batch, runs the model, samples.

One path for every step: :class:`~cbatch.core.input_batch.StepBatchBuilder` fills persistent
buffers, the model runs eagerly, or, on CUDA, a CUDA graph captured at start-up replays:

- a decode step (one token per row) replays the graph of the smallest batch-size bucket that
  holds it, padded with rows that write nothing (slot -1);
- with speculative decoding (``num_speculative_tokens`` k), a step whose every row brings at
  most k + 1 tokens (verifying rows: its last token and its drafts; decoding rows beside them)
  replays the graph of its bucket at k + 1 tokens a row: each run is padded at its front with
  fillers that recompute cached positions and write nothing, so its own tokens compute
  exactly what they would unpadded (:meth:`StepBatchBuilder.build`).

With ``cuda_graphs=True`` on the CPU the same padded batches run eagerly, so the padding logic
is exercised without a GPU.

:meth:`ModelRunner.execute` only launches: it returns :class:`SampledTokens`, whose copy to
the host is under way, so the engine can schedule and launch the next step before it reads
them (async scheduling).  A token of that next step that is still on the device is fed to
it from the previous step's sampled tokens, on the device.

Graphs are an optimisation, never a reason the engine cannot run: if capturing them fails, if
a replay at start-up differs from the eager forward of the same batch, or if a replay raises
later, the runner warns and runs every step eagerly from then on.
"""

from __future__ import annotations

import collections
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

from cbatch import ops
from cbatch.core.input_batch import StepBatchBuilder, run_starts
from cbatch.core.sampler import (SamplingBatch, TokenCounts, logits_rules, logprobs_tensors,
                                 sample)
from cbatch.core.scheduler import ScheduledSequence
from cbatch.devices import to_device
from cbatch.core.step_outputs import DraftPositions, PromptTargets, SampledTokens
from cbatch.core.structured_output import bitmask as grammar_bitmask
from cbatch.layers.kv_cache import KVCache
from cbatch.layers.step_batch import StepBatch


# How far a graph's logits may be from the eager forward's on the same padded batch (the
# same kernels run either way; this allows for a different reduction order, no more).
GRAPH_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a decode graph: 1, 2, 4, 8, then every 8 up to 64, then every
    16, and ``max_num_seqs`` itself."""
    sizes = [1, 2, 4, 8] + list(range(16, 65, 8)) + list(range(80, max_num_seqs + 1, 16))
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


class ModelRunner:
    """The runner of every device; :class:`~cbatch.core.cpu.model_runner.CPUModelRunner` adds
    what only a CPU does; :func:`cbatch.core.worker.model_runner_class` picks one for a
    device."""

    # how the engine allocates the KV pool for this runner (None: torch.zeros)
    kv_cache_zeros: Callable | None = None

    def __init__(self, model: nn.Module, kv_cache: KVCache, max_num_seqs: int,
                 max_num_batched_tokens: int, cuda_graphs: bool = False,
                 num_speculative_tokens: int = 0):
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.device
        max_blocks = -(-model.config.max_model_len // kv_cache.block_size)
        self.builder = StepBatchBuilder(max_num_seqs, max(max_num_batched_tokens, max_num_seqs),
                                        max_blocks, kv_cache.block_size, self.device)
        # the graph shapes (rows, tokens per row): decode steps at each bucket; with drafts of
        # up to k tokens, steps of at most k + 1 tokens a row at each bucket that fits
        self.buckets = graph_buckets(max_num_seqs) if cuda_graphs else []
        self.query_len = 1 + num_speculative_tokens if num_speculative_tokens else 0
        self.verify_buckets = [size for size in self.buckets if self.query_len
                               and size * self.query_len <= self.builder.max_num_tokens]
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.steps_by_shape: collections.Counter[tuple[int, int]] = collections.Counter()
        self.graph_capture_s = 0.0
        self.graph_memory_bytes = 0
        # the last executed step's sampled tokens [S] on the device, and the row of each
        # sequence that sampled in it (id(seq) -> row): where in-flight tokens come from
        self._sampled: torch.Tensor | None = None
        self._sampled_rows: dict[int, int] = {}
        eos = model.config.eos_token_id
        self.eos_token_ids = frozenset(eos if isinstance(eos, tuple) else
                                       () if eos is None else (eos,))
        self.token_counts = TokenCounts(model.config.vocab_size, self.device)  # penalties'
        self.dry_run()
        if self.device.type == "cuda":  # compile every kernel now, not in the first request
            cfg = model.config
            ops.warmup(model.dtype, cfg.head_dim, kv_cache.block_size, self.device,
                       model.attention_backend, cfg.num_heads, cfg.num_kv_heads)
            if cuda_graphs:
                self.setup_graphs()

    # -------------------------------------------------------------- batches

    def graph_shapes(self) -> list[tuple[int, int]]:
        """Every (rows, tokens per row) a step is padded to, most tokens first: the graphs
        captured on CUDA."""
        shapes = [(size, 1) for size in self.buckets]
        shapes += [(size, self.query_len) for size in self.verify_buckets]
        return sorted(shapes, key=lambda shape: (-shape[0] * shape[1], shape))

    def bucket(self, num_seqs: int, buckets: list[int] | None = None) -> int | None:
        """The smallest of ``buckets`` (default: the decode buckets) holding ``num_seqs`` rows
        (None: run eagerly)."""
        for size in self.buckets if buckets is None else buckets:
            if size >= num_seqs:
                return size
        return None

    def prepare(self, scheduled: list[ScheduledSequence], pad_to: int | None = None
                ) -> StepBatch:
        """The step batch of ``scheduled`` in persistent buffers (:meth:`build`).  A
        sequence's in-flight token (async scheduling) is read on the device from the last
        step's samples."""
        runs, deferred = [], []
        for s, item in enumerate(scheduled):
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            known = n - len(item.draft_token_ids)  # then the drafts it verifies
            tokens = seq.token_ids[start:start + known]
            if len(tokens) < known:  # its last token was sampled by the step still running
                deferred.append((s, len(tokens), self._sampled_rows[id(seq)]))
                tokens.append(0)
            runs.append((tokens + item.draft_token_ids, start, seq.block_table))
        return self.build(runs, deferred, pad_to)

    def build(self, runs: list[tuple[list[int], int, list[int]]],
              deferred: list[tuple[int, int, int]] = (), pad_to: int | None = None
              ) -> StepBatch:
        """The step batch of ``runs`` (``(new tokens, cached, block table)`` each,
        :meth:`StepBatchBuilder.build`) in a graph's shape where one holds it: a decode step
        padded to its bucket, a step of at most k + 1 tokens a row (k drafts) to its bucket at
        k + 1 tokens a row; and to at least ``pad_to`` rows (the static-batching policy keeps
        the rows of finished requests computing, as a padded batch does)."""
        rows = max(len(runs), pad_to or 0)
        shape = {}
        if all(len(tokens) == 1 for tokens, _, _ in runs):
            bucket = self.bucket(rows)
            shape = dict(pad_to=bucket, full_width=True, query_len=1) if bucket else \
                dict(pad_to=rows)
        elif self.verify_buckets:
            q, bucket = self.query_len, self.bucket(rows, self.verify_buckets)
            # (a run's fillers recompute cached positions: it needs as many before it)
            if bucket and all(len(tokens) <= q <= start + len(tokens)
                              for tokens, start, _ in runs):
                shape = dict(pad_to=bucket, full_width=True, query_len=q)
        batch = self.builder.build(runs, deferred=deferred, sampled=self._sampled, **shape)
        if batch.graph_shape is not None:
            self.steps_by_shape[batch.graph_shape] += 1
        return batch

    # -------------------------------------------------------------- running

    @torch.inference_mode()
    def dry_run(self) -> None:
        """One forward of a padding row (it writes nothing) through every layer and the
        logits: an engine whose settings cannot run here (attention backend, dtype, device)
        fails when it is made, before a server reports healthy, not in its first request."""
        batch = self.builder.build([], pad_to=1, full_width=True)
        self.model.compute_logits(self.model(batch, self.kv_cache))

    def logits(self, batch: StepBatch, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``[N, vocab]`` logits at ``rows`` (int64 ``[N]``, indices into the step's flat
        tokens), or (None) of each real sequence's last new token; a graph replay when one
        was captured for this batch's shape."""
        graph = self._graphs.get(batch.graph_shape)
        if graph is not None:
            try:
                graph[0].replay()
            except Exception as exc:  # the same padded batch runs eagerly instead
                self.disable_graphs(f"replaying the CUDA graph of {batch.graph_shape} (rows, "
                                    f"tokens a row) failed ({type(exc).__name__}: {exc})")
            else:
                if rows is not None:
                    return graph[1][rows]
                if batch.is_decode:  # the logits of every row, the real ones first
                    return graph[1][:batch.num_seqs - batch.num_padded_seqs]
                return graph[1][batch.logits_indices[:batch.num_seqs - batch.num_padded_seqs]]
        return self.model.compute_logits(self.last_hidden(batch, rows))

    def last_hidden(self, batch: StepBatch, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``[N, hidden]``: the final hidden state at the positions a step samples: ``rows``
        (int64 ``[N]``, indices into the step's flat tokens), or (None) each real sequence's
        last new token."""
        hidden = self.model(batch, self.kv_cache)
        if rows is None:
            rows = batch.logits_indices[:batch.num_seqs - batch.num_padded_seqs]
        return hidden[rows]

    @torch.inference_mode()
    def execute(self, batch: StepBatch, scheduled: list[ScheduledSequence]) -> SampledTokens:
        """Launch the forward pass and sampling of a batch from :meth:`prepare` (call it
        before the scheduled sequences advance); :meth:`SampledTokens.wait` gives the
        tokens."""
        seqs = [item.seq for item in scheduled]
        samples = row_samples = [item.samples for item in scheduled]
        positions = [seq.num_output_tokens for seq in seqs]  # the output index each draws
        starts = run_starts([item.num_new_tokens for item in scheduled],
                            batch.graph_shape and batch.graph_shape[1])
        drafts, rows = DraftPositions.of(scheduled, starts), None
        draw_of = list(range(len(scheduled)))  # each row's (first) draw
        if drafts is not None:  # a row per position sampled: 1 + drafts of a verifying row
            seqs, samples = drafts.repeat(seqs), drafts.repeat(row_samples)
            positions = [p + j for p, count in zip(positions, drafts.counts)
                         for j in range(count)]
            rows, draw_of = to_device(drafts.token_indices, self.device), drafts.offsets[:-1]
        params = [seq.params for seq in seqs]
        failed: dict[int, Exception] = {}  # sampling row -> the error of its own rules or draw
        sampling = SamplingBatch(
            temperatures=[p.temperature for p in params],
            top_ks=[p.top_k for p in params],
            top_ps=[p.top_p for p in params],
            seeds=[seq.seed for seq in seqs],
            positions=positions,
            min_ps=[p.min_p for p in params],
            rules=logits_rules(seqs, samples, self.eos_token_ids, self.token_counts, failed),
            bitmask=grammar_bitmask(scheduled),
            failed=failed,
        )
        num_logprobs = [p.logprobs for p in params]
        prompt = PromptTargets.of(scheduled, starts)
        tokens, logprobs, prompt_logprobs = self.run(batch, sampling, num_logprobs, prompt,
                                                     rows)
        self._sampled = tokens
        self._sampled_rows = {id(item.seq): draw_of[row] for row, item in enumerate(scheduled)
                              if row_samples[row] and not item.draft_token_ids}
        if failed and drafts is not None:  # sampling rows -> their scheduled rows
            owner = drafts.repeat(list(range(len(scheduled))))
            failed = {owner[r]: exc for r, exc in failed.items()}
        return SampledTokens(tokens, row_samples, logprobs, num_logprobs, prompt,
                             prompt_logprobs, drafts, failed)

    def run(self, batch: StepBatch, sampling: SamplingBatch, num_logprobs: list[int | None],
            prompt: PromptTargets | None = None, rows: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None,
                       tuple[torch.Tensor, ...] | None]:
        """The forward pass and the sampler: int64 tokens ``[N]`` (one per sampling row: each
        sequence's last token, or the positions ``rows`` names, :class:`DraftPositions`),
        the logprobs tensors (:func:`~cbatch.core.sampler.logprobs_tensors`; None when no
        row asked) and those of the prompt tokens ``prompt`` names (None when it is
        None)."""
        if prompt is None:  # (a graph replay where one has the batch's shape)
            logits, prompt_logprobs = self.logits(batch, rows), None
        else:  # logits at the prompt's positions too: the eager forward
            hidden = self.model(batch, self.kv_cache)
            if rows is None:
                rows = batch.logits_indices[:batch.num_seqs - batch.num_padded_seqs]
            logits = self.model.compute_logits(hidden[rows])
            at = self.model.compute_logits(hidden[to_device(prompt.token_indices, self.device)])
            prompt_logprobs = logprobs_tensors(at, to_device(prompt.targets, self.device),
                                               prompt.num_logprobs)
        tokens = sample(logits, sampling)
        return tokens, logprobs_tensors(logits, tokens, num_logprobs), prompt_logprobs

    def steps_by_threads(self) -> dict[int, int]:
        """Steps run at each CPU thread count (the CPU runner's thread policy; none here)."""
        return {}

    def release(self, request_id: str) -> None:
        """Forget what the runner holds for a finished request (its penalties' counts)."""
        self.token_counts.release(request_id)

    def describe(self) -> dict[str, str]:
        """The device-specific paths live in this engine, a phrase each (the CPU runner's;
        none here)."""
        return {}

    # -------------------------------------------------------------- CUDA graphs

    def setup_graphs(self) -> None:
        """Capture the graphs of :meth:`graph_shapes` and check them against the eager
        forward; on any failure, warn and run eagerly."""
        try:
            self.capture_graphs()
            self.check_graphs()
        except Exception as exc:
            self.disable_graphs(f"CUDA graphs failed at start-up ({type(exc).__name__}: "
                                f"{exc})")

    @torch.inference_mode()
    def check_graphs(self) -> None:
        """Replay each captured graph on its all-padding batch and compare its logits with
        the eager forward of the same batch; RuntimeError if they differ beyond the dtype's
        :data:`GRAPH_TOLERANCE`."""
        tol = GRAPH_TOLERANCE.get(self.model.dtype, 1e-2)
        for (size, query_len), (graph, logits) in self._graphs.items():
            batch = self.builder.build([], pad_to=size, full_width=True, query_len=query_len)
            graph.replay()
            replayed = logits.clone()
            eager = self.model.compute_logits(self.model(batch, self.kv_cache))
            if not torch.allclose(replayed, eager, rtol=tol, atol=tol, equal_nan=True):
                diff = (replayed.float() - eager.float()).abs().nan_to_num(float("inf")).max()
                raise RuntimeError(f"the graph of {size} rows of {query_len} tokens replays "
                                   f"logits up to {diff:.3g} away from the eager forward's "
                                   f"(tolerance {tol})")

    def disable_graphs(self, why: str) -> None:
        """Drop every graph and bucket: from now on every step runs eagerly, unpadded."""
        warnings.warn(f"{why}; every step runs eagerly from now on", RuntimeWarning,
                      stacklevel=2)
        self._graphs.clear()
        self.buckets, self.verify_buckets = [], []

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """One graph per shape of :meth:`graph_shapes`, most tokens first, all in one memory
        pool: embeddings, every layer, the final norm and the logits of every token of a
        padded batch.  Each shape runs once eagerly first, so kernels are compiled outside
        the capture."""
        torch.cuda.synchronize(self.device)
        start, before = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        pool = None
        for size, query_len in self.graph_shapes():
            # rows of padding only: slot -1 everywhere, nothing is written
            batch = self.builder.build([], pad_to=size, full_width=True, query_len=query_len)

            def forward(batch=batch):
                hidden = self.model(batch, self.kv_cache)
                return self.model.compute_logits(hidden)

            forward()
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = forward()
            pool = graph.pool()
            self._graphs[size, query_len] = (graph, logits)
        torch.cuda.synchronize(self.device)
        self.graph_capture_s = time.perf_counter() - start
        self.graph_memory_bytes = torch.cuda.memory_reserved(self.device) - before
