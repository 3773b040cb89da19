"""Turns a schedule into the step batch, runs the model, samples.

One path for every step: :class:`~cbatch.batch.StepBatchBuilder` fills persistent buffers,
the model runs eagerly, or, for a decode step on CUDA, the CUDA graph captured for the
smallest batch-size bucket that holds it replays.  Graph steps are padded to their bucket
with rows that write nothing (slot -1) and read a one-token context; with
``cuda_graphs=True`` on the CPU the same padded batches run eagerly, so the padding logic is
exercised without a GPU.
"""

from __future__ import annotations

import time

import torch

from cbatch import ops
from cbatch.batch import StepBatch, StepBatchBuilder
from cbatch.core.sampler import SamplingBatch, compute_logprobs, sample
from cbatch.core.scheduler import ScheduledSequence
from cbatch.kv_cache import KVCache
from cbatch.models.gpt2 import GPT2LMHeadModel


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a decode graph: 1, 2, 4, 8, then every 8 up to 64, then every
    16, and ``max_num_seqs`` itself."""
    sizes = [1, 2, 4, 8] + list(range(16, 65, 8)) + list(range(80, max_num_seqs + 1, 16))
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


class ModelRunner:
    def __init__(self, model: GPT2LMHeadModel, kv_cache: KVCache, max_num_seqs: int,
                 max_num_batched_tokens: int, cuda_graphs: bool = False):
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.device
        self.block_size = kv_cache.block_size
        max_blocks = -(-model.config.n_positions // kv_cache.block_size)
        self.builder = StepBatchBuilder(max_num_seqs, max(max_num_batched_tokens, max_num_seqs),
                                        max_blocks, kv_cache.block_size, self.device)
        self.buckets = graph_buckets(max_num_seqs) if cuda_graphs else []
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_capture_s = 0.0
        self.graph_memory_bytes = 0
        if self.device.type == "cuda":  # compile every kernel now, not in the first request
            cfg = model.config
            ops.warmup(model.dtype, cfg.head_dim, kv_cache.block_size, self.device,
                       model.attention_backend, cfg.n_head)
            if cuda_graphs:
                self.capture_graphs()

    # -------------------------------------------------------------- batches

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest graph bucket holding ``num_seqs`` decode rows (None: run eagerly)."""
        for size in self.buckets:
            if size >= num_seqs:
                return size
        return None

    def prepare(self, scheduled: list[ScheduledSequence], pad_to: int | None = None
                ) -> StepBatch:
        """The step batch of ``scheduled`` in persistent buffers; a decode step is padded to
        its graph bucket, and to at least ``pad_to`` rows (the static-batching policy keeps
        the rows of finished requests computing, as a padded batch does)."""
        runs = []
        for item in scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            runs.append((seq.token_ids[start:start + item.num_new_tokens], start,
                         seq.block_table))
        if not all(item.num_new_tokens == 1 for item in scheduled):
            return self.builder.build(runs)
        rows = max(len(scheduled), pad_to or 0)
        bucket = self.bucket(rows)
        if bucket is not None:
            return self.builder.build(runs, pad_to=bucket, full_width=True)
        return self.builder.build(runs, pad_to=rows)

    # -------------------------------------------------------------- running

    def logits(self, batch: StepBatch) -> torch.Tensor:
        """``[S, vocab]`` logits of each real sequence's last new token (a graph replay when
        one was captured for this batch)."""
        num_real = batch.num_seqs - batch.num_padded_seqs
        graph = self._graphs.get(batch.num_seqs) if batch.is_decode else None
        if graph is not None:
            graph[0].replay()
            return graph[1][:num_real]
        hidden = self.model(batch, self.kv_cache)
        return self.model.compute_logits(hidden[batch.logits_indices[:num_real]])

    @torch.inference_mode()
    def execute(self, batch: StepBatch, scheduled: list[ScheduledSequence]
                ) -> tuple[list[int], list[dict[int, float] | None] | None]:
        """Forward pass and sampling for a batch from :meth:`prepare` (waits for the device:
        the sampled tokens come back to the host).  Returns the sampled token of every
        scheduled sequence (entries of sequences still mid-prefill are meaningless and
        ignored by the engine) and their logprobs (see :func:`compute_logprobs`)."""
        params = [item.seq.params for item in scheduled]
        sampling = SamplingBatch(
            temperatures=[p.temperature for p in params],
            top_ks=[p.top_k for p in params],
            top_ps=[p.top_p for p in params],
            seeds=[item.seq.seed for item in scheduled],
            positions=[item.seq.num_output_tokens for item in scheduled],
        )
        logits = self.logits(batch)
        tokens = sample(logits, sampling)
        logprobs = compute_logprobs(logits, tokens, [p.logprobs for p in params])
        return tokens.tolist(), logprobs

    # -------------------------------------------------------------- CUDA graphs

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """One graph per bucket, largest first, all in one memory pool: embeddings, every
        layer, the final norm and the logits of all rows of a padded decode batch.  Each
        bucket runs once eagerly first, so kernels are compiled outside the capture."""
        torch.cuda.synchronize(self.device)
        start, before = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        pool = None
        for size in reversed(self.buckets):
            # size rows of padding only: slot -1 everywhere, nothing is written
            batch = self.builder.build([], pad_to=size, full_width=True)

            def forward(batch=batch):
                hidden = self.model(batch, self.kv_cache)
                return self.model.compute_logits(hidden)

            forward()
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = forward()
            pool = graph.pool()
            self._graphs[size] = (graph, logits)
        torch.cuda.synchronize(self.device)
        self.graph_capture_s = time.perf_counter() - start
        self.graph_memory_bytes = torch.cuda.memory_reserved(self.device) - before
