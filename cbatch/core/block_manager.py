"""Physical KV-cache blocks: a free list with reference counts.  No torch here.

A sequence's ``block_table`` (a list of block ids) is grown as it gets longer and handed
back whole when it finishes, is aborted or is preempted.  Reference counts let a block be
shared by several tables (prefix caching); a block returns to the free list when its last
holder lets go.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, "
                             f"{block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def blocks_to_grow(self, block_table: list[int], num_tokens: int) -> int:
        """New blocks ``block_table`` needs to hold ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_to_grow(block_table, num_tokens) <= len(self._free)

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append free blocks to ``block_table`` (in place) until it holds ``num_tokens``."""
        need = self.blocks_to_grow(block_table, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {need}, {len(self._free)} free")
        for _ in range(need):
            block = self._free.popleft()
            self._ref_counts[block] = 1
            block_table.append(block)

    def share(self, block_table: list[int]) -> list[int]:
        """A new table holding the same blocks (each gains a reference)."""
        for block in block_table:
            self._ref_counts[block] += 1
        return list(block_table)

    def free(self, block_table: list[int]) -> None:
        """Drop the table's references (in place: the table ends empty)."""
        for block in block_table:
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)
            elif self._ref_counts[block] < 0:
                raise RuntimeError(f"block {block} freed more often than it was taken")
        block_table.clear()

    def check_whole(self) -> None:
        """Raise unless every block is free (no leak after a run)."""
        if len(self._free) != self.num_blocks or any(self._ref_counts):
            held = [b for b, c in enumerate(self._ref_counts) if c]
            raise AssertionError(f"{self.num_blocks - len(self._free)} blocks not returned: "
                                 f"{held[:10]}")
