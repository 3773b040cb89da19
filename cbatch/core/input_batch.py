"""The one builder of step batches: persistent buffers filled in place each step."""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np
import torch

from cbatch.layers.kv_cache import KVCache
from cbatch.layers.step_batch import StepBatch

_PAD_TABLE = [0]  # a padding row's context: its tokens in block 0


class StepBatchBuilder:
    """Fills persistent step buffers in place and hands out :class:`StepBatch` views of them.

    Every field has a fixed offset in one int64 and one int32 buffer (pinned host memory and
    a device copy on CUDA; one buffer on the CPU), sized for ``max_num_seqs`` rows,
    ``max_num_tokens`` new tokens and ``max_blocks_per_seq`` table entries per row.  A step
    costs two host-to-device copies and no tensor allocation, and a decode batch of a given
    padded size always lands at the same addresses: what a CUDA graph replays.
    """

    def __init__(self, max_num_seqs: int, max_num_tokens: int, max_blocks_per_seq: int,
                 block_size: int, device: torch.device | str = "cpu"):
        self.max_num_seqs, self.max_num_tokens = max_num_seqs, max_num_tokens
        self.max_blocks_per_seq, self.block_size = max_blocks_per_seq, block_size
        self.device = torch.device(device)
        S, T = max_num_seqs, max_num_tokens
        # int64: ids [T] | positions [T] | slots [T] | logits rows [S] | deferred tokens:
        #        their index in ids [S] | their row in the previous step's samples [S] |
        #        their values (gathered on the device) [S]
        # int32: cu_seqlens [S+1] | seq_lens [S] | block tables [S * max_blocks_per_seq]
        self._i64 = {"ids": 0, "pos": T, "slots": 2 * T, "rows": 3 * T, "dst": 3 * T + S,
                     "src": 3 * T + 2 * S, "gathered": 3 * T + 3 * S}
        self._i32 = {"cu": 0, "lens": S + 1, "tables": 2 * S + 1}
        on_gpu = self.device.type == "cuda"
        host64 = torch.zeros(3 * T + 4 * S, dtype=torch.int64, pin_memory=on_gpu)
        host32 = torch.zeros(2 * S + 1 + S * max_blocks_per_seq, dtype=torch.int32,
                             pin_memory=on_gpu)
        self._host = (host64, host32)
        self._np64, self._np32 = host64.numpy(), host32.numpy()
        if on_gpu:
            self._dev = (host64.to(self.device), host32.to(self.device))
            self._copied = torch.cuda.Event()  # the host buffers may be refilled after it
        else:
            self._dev, self._copied = self._host, None
        # the block table each row of the host buffer holds (at width self._width): a row
        # whose sequence and blocks are those of the last step is not written again
        self._tables: list[list[int] | None] = [None] * max_num_seqs
        self._width = 0

    def _write_tables(self, rows: np.ndarray, tables: list[Sequence[int]]) -> None:
        """Each row's table into ``rows: [n, width]``, only where it changed; entries past a
        table's end are left as they are (kernels read only the blocks a length needs)."""
        if rows.shape[1] != self._width:
            self._tables, self._width = [None] * self.max_num_seqs, rows.shape[1]
        held = self._tables
        for r, table in enumerate(tables):
            if held[r] != table:
                rows[r, :len(table)] = table
                held[r] = list(table)

    def build(self, runs: Sequence[tuple[Sequence[int], int, Sequence[int]]],
              pad_to: int | None = None, full_width: bool = False, query_len: int | None = None,
              deferred: Sequence[tuple[int, int, int]] = (), sampled: torch.Tensor | None = None
              ) -> StepBatch:
        """``runs[s] = (new_tokens, num_cached, block_table)`` of each sequence, in batch order.

        ``pad_to`` adds rows up to that many sequences (a batch-size bucket); ``full_width``
        lays the block tables out ``max_blocks_per_seq`` wide instead of as wide as this step
        needs.  ``query_len`` pads every run at its front to that many tokens with filler
        tokens that recompute positions already cached (so a run of n tokens after c cached
        needs ``c >= query_len - n``): id 0, slot -1 (they write nothing), their context all
        written, so the run's own tokens, its last and the causal offset ``seq_len -
        query_len`` are what they are unpadded; padding rows then hold ``query_len`` tokens
        each.  With ``full_width`` and ``query_len`` the batch has a CUDA graph's fixed shape
        (:attr:`StepBatch.graph_shape`).  The caller guarantees that every table covers its
        sequence (:func:`make_step_batch` checks it).

        ``deferred`` lists ``(run, index in the run's tokens, row of sampled)`` for new tokens
        whose ids are still on the device (async scheduling): ``sampled: int64 [S']`` holds the
        previous step's sampled tokens, and they are copied into ``input_ids`` there, in
        stream order, without a trip through the host.
        """
        bs = self.block_size
        q = query_len or 1
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu, lens = [0], []
        for tokens, start, table in runs:
            end = start + len(tokens)
            if query_len and query_len != len(tokens):  # fillers first: they recompute
                fill = query_len - len(tokens)  # cached positions, writing nothing
                if not 0 <= fill <= start:
                    raise ValueError(f"a run of {len(tokens)} tokens after {start} cached "
                                     f"cannot be padded to {query_len}")
                ids += [0] * fill
                positions += range(start - fill, start)
                slots += [-1] * fill
            ids += tokens
            if end - start == 1:  # a decode row: the common case, kept cheap
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                positions += range(start, end)
                slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            cu.append(len(ids))
            lens.append(end)
        S, T_real = len(runs), len(ids)
        n = max(S, pad_to or 0)
        pad = n - S
        T = T_real + pad * q
        width = self.max_blocks_per_seq if full_width else max(len(r[2]) for r in runs)
        if n > self.max_num_seqs or T > self.max_num_tokens or width > self.max_blocks_per_seq:
            raise ValueError(f"step of {n} sequences, {T} tokens and {width} blocks per "
                             f"sequence exceeds the builder's {self.max_num_seqs}, "
                             f"{self.max_num_tokens}, {self.max_blocks_per_seq}")
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the host buffers
        o64, o32, h64, h32 = self._i64, self._i32, self._np64, self._np32
        pad_ends = range(T_real + q, T + 1, q)  # each padding row's end in the tokens
        h64[o64["ids"]:o64["ids"] + T] = ids + [0] * (T - T_real)
        h64[o64["pos"]:o64["pos"] + T] = positions + [0] * (T - T_real)
        h64[o64["slots"]:o64["slots"] + T] = slots + [-1] * (T - T_real)
        h64[o64["rows"]:o64["rows"] + n] = [c - 1 for c in cu[1:]] + [e - 1 for e in pad_ends]
        h32[o32["cu"]:o32["cu"] + n + 1] = cu + list(pad_ends)
        h32[o32["lens"]:o32["lens"] + n] = lens + [q] * pad
        self._write_tables(h32[o32["tables"]:o32["tables"] + n * width].reshape(n, width),
                           [r[2] for r in runs] + [_PAD_TABLE] * pad)
        k = len(deferred)
        if k:
            h64[o64["dst"]:o64["dst"] + k] = [cu[s + 1] - len(runs[s][0]) + i
                                              for s, i, _ in deferred]
            h64[o64["src"]:o64["src"] + k] = [r for _, _, r in deferred]
        if self._copied is not None:
            for dev, host in zip(self._dev, self._host):
                dev.copy_(host, non_blocking=True)
            self._copied.record()
        d64, d32 = self._dev
        if k:
            gathered = d64[o64["gathered"]:o64["gathered"] + k]
            torch.index_select(sampled, 0, d64[o64["src"]:o64["src"] + k], out=gathered)
            d64[o64["ids"]:o64["ids"] + T].index_copy_(0, d64[o64["dst"]:o64["dst"] + k],
                                                       gathered)
        return StepBatch(
            input_ids=d64[o64["ids"]:o64["ids"] + T],
            positions=d64[o64["pos"]:o64["pos"] + T],
            slot_mapping=d64[o64["slots"]:o64["slots"] + T],
            logits_indices=d64[o64["rows"]:o64["rows"] + n],
            cu_seqlens_q=d32[o32["cu"]:o32["cu"] + n + 1],
            seq_lens=d32[o32["lens"]:o32["lens"] + n],
            block_tables=d32[o32["tables"]:o32["tables"] + n * width].view(n, width),
            is_decode=T == n,
            max_query_len=query_len or max((len(r[0]) for r in runs), default=1),
            num_padded_seqs=pad,
            graph_shape=(n, query_len) if full_width and query_len else None,
        )


def run_starts(lengths: Sequence[int], query_len: int | None = None) -> list[int]:
    """Where each run's own tokens begin in a step's flat tokens (``lengths[s]`` tokens in
    run s), unpadded or padded at the front to ``query_len`` tokens
    (:meth:`StepBatchBuilder.build`)."""
    if query_len:
        return [(s + 1) * query_len - n for s, n in enumerate(lengths)]
    return list(itertools.accumulate(lengths[:-1], initial=0))


def make_step_batch(
    new_tokens: Sequence[Sequence[int]],
    num_cached: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
) -> StepBatch:
    """One :class:`StepBatch` from plain Python lists, checked, through a one-off
    :class:`StepBatchBuilder` (the engine keeps a persistent one).

    ``new_tokens[s]`` are sequence s's tokens for this step, placed after its
    ``num_cached[s]`` cached ones; ``block_tables[s]`` must cover all of them.
    """
    if not new_tokens:
        raise ValueError("a step batch needs at least one sequence")
    if not len(new_tokens) == len(num_cached) == len(block_tables):
        raise ValueError("new_tokens, num_cached and block_tables must have one entry per "
                         f"sequence, got {len(new_tokens)}, {len(num_cached)}, "
                         f"{len(block_tables)}")
    for s, (tokens, cached, table) in enumerate(zip(new_tokens, num_cached, block_tables)):
        if not tokens:
            raise ValueError(f"sequence {s} has no new tokens")
        seq_len = cached + len(tokens)
        if max_positions is not None and seq_len > max_positions:
            raise ValueError(f"sequence {s} reaches position {seq_len - 1}, past the model's "
                             f"n_positions = {max_positions}")
        if len(table) * block_size < seq_len:
            raise ValueError(f"sequence {s} needs {-(-seq_len // block_size)} blocks for "
                             f"{seq_len} tokens but its block table has {len(table)}")
    builder = StepBatchBuilder(len(new_tokens), sum(map(len, new_tokens)),
                               max(map(len, block_tables)), block_size, device)
    return builder.build([(list(t), c, list(b)) for t, c, b in
                          zip(new_tokens, num_cached, block_tables)])


@torch.inference_mode()
def prefill_logits(model, prompts: Sequence[Sequence[int]], block_size: int = 16
                   ) -> list[torch.Tensor]:
    """Each prompt's logits at every position (``[len(prompt), vocab]`` each), from one
    prefill step of all of them on a KV cache of their own: for checks and benchmarks that
    compare models on the same tokens, not for the engine."""
    blocks = [-(-len(p) // block_size) for p in prompts]
    cache = KVCache(model.config, sum(blocks), block_size, dtype=model.dtype,
                    device=model.device)
    starts = [sum(blocks[:i]) for i in range(len(blocks))]
    tables = [list(range(start, start + n)) for start, n in zip(starts, blocks)]
    batch = make_step_batch(prompts, [0] * len(prompts), tables, block_size, model.device)
    logits = model.compute_logits(model(batch, cache))
    cu = batch.cu_seqlens_q.tolist()
    return [logits[cu[i]:cu[i + 1]] for i in range(len(prompts))]
