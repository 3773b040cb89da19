"""Shared builders for kernel and model tests."""

from __future__ import annotations

import torch


def shuffled_block_tables(seq_lens: list[int], block_size: int, num_blocks: int,
                          generator: torch.Generator) -> torch.Tensor:
    """int32 [S, max_blocks]: each sequence gets distinct, randomly placed physical blocks;
    entries past what a sequence needs hold out-of-range garbage (they must never be read)."""
    needed = [-(-n // block_size) for n in seq_lens]
    if sum(needed) > num_blocks:
        raise ValueError(f"{sum(needed)} blocks needed, pool has {num_blocks}")
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    max_blocks = max(needed) + 1
    tables = torch.full((len(seq_lens), max_blocks), 10**6, dtype=torch.int32)
    offset = 0
    for s, n in enumerate(needed):
        tables[s, :n] = torch.tensor(perm[offset:offset + n], dtype=torch.int32)
        offset += n
    return tables
