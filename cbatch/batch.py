"""The flat, unpadded step batch that one model forward pass consumes (docs/design.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class StepBatch:
    """Tensors of one step: S sequences, T new tokens in total, each sequence's run contiguous.

    input_ids     int64 [T]   the new tokens
    positions     int64 [T]   absolute position of each token in its sequence
    cu_seqlens_q  int32 [S+1] offsets of each sequence's run in the flat batch
    seq_lens      int32 [S]   each sequence's length after this step (cached + new)
    block_tables  int32 [S, max_blocks] physical block ids
    slot_mapping  int64 [T]   cache slot of each new token; -1 writes nothing
    logits_indices int64 [S]  the row of each sequence's last new token (the one to sample from)
    is_decode     every sequence has exactly one new token (host-side flag: picks the kernel)
    max_query_len the longest run of new tokens (host int: sizes the prefill kernel's grid)
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor
    is_decode: bool
    max_query_len: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def make_step_batch(
    new_tokens: Sequence[Sequence[int]],
    num_cached: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
) -> StepBatch:
    """Build a :class:`StepBatch` from plain Python lists (one host→device copy per tensor).

    ``new_tokens[s]`` are sequence s's tokens for this step, placed after its
    ``num_cached[s]`` cached ones; ``block_tables[s]`` must cover all of them.
    """
    if not new_tokens:
        raise ValueError("a step batch needs at least one sequence")
    if not len(new_tokens) == len(num_cached) == len(block_tables):
        raise ValueError("new_tokens, num_cached and block_tables must have one entry per "
                         f"sequence, got {len(new_tokens)}, {len(num_cached)}, "
                         f"{len(block_tables)}")
    input_ids, positions, slots, cu, seq_lens = [], [], [], [0], []
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
        pos = range(cached, seq_len)
        input_ids += tokens
        positions += pos
        slots += [table[p // block_size] * block_size + p % block_size for p in pos]
        cu.append(len(input_ids))
        seq_lens.append(seq_len)
    max_blocks = max(len(t) for t in block_tables)
    padded_tables = [list(t) + [0] * (max_blocks - len(t)) for t in block_tables]

    def tensor(data, dtype):
        return torch.tensor(data, dtype=dtype).to(device, non_blocking=True)

    return StepBatch(
        input_ids=tensor(input_ids, torch.int64),
        positions=tensor(positions, torch.int64),
        cu_seqlens_q=tensor(cu, torch.int32),
        seq_lens=tensor(seq_lens, torch.int32),
        block_tables=tensor(padded_tables, torch.int32),
        slot_mapping=tensor(slots, torch.int64),
        logits_indices=tensor([c - 1 for c in cu[1:]], torch.int64),
        is_decode=all(len(t) == 1 for t in new_tokens),
        max_query_len=max(len(t) for t in new_tokens),
    )
