"""The paged KV cache: one allocation shared by all layers, cut into fixed-size blocks."""

from __future__ import annotations

import torch

from cbatch.batch import to_device
from cbatch.config import GPT2Config


def bytes_per_token(config: GPT2Config, dtype: torch.dtype) -> int:
    """KV-cache bytes one token costs across all layers: ``2 * n_layer * H * D * dtype_bytes``
    (GPT-2 small in fp16: 36 KiB)."""
    return 2 * config.n_layer * config.n_head * config.head_dim * dtype.itemsize


class KVCache:
    """``data: [num_layers, 2, num_blocks, block_size, H, D]``; :meth:`layer` gives one layer's
    ``key_cache, value_cache`` views, each ``[num_blocks, block_size, H, D]`` and contiguous."""

    def __init__(self, config: GPT2Config, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, "
                             f"{block_size}")
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.data = torch.zeros(config.n_layer, 2, num_blocks, block_size, config.n_head,
                                config.head_dim, dtype=dtype, device=device)

    @classmethod
    def from_memory(cls, config: GPT2Config, memory_bytes: int, block_size: int = 16,
                    dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
                    ) -> KVCache:
        """As many blocks as fit in ``memory_bytes``."""
        num_blocks = memory_bytes // (bytes_per_token(config, dtype) * block_size)
        if num_blocks < 1:
            raise ValueError(f"{memory_bytes} bytes hold no block of {block_size} tokens "
                             f"({bytes_per_token(config, dtype)} bytes per token)")
        return cls(config, int(num_blocks), block_size, dtype, device)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, 0], self.data[i, 1]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``source -> destination`` in every layer, K and V (all sources
        are read before any destination is written)."""
        src, dst = (to_device(list(ids), self.data.device) for ids in zip(*pairs))
        self.data[:, :, dst] = self.data[:, :, src]
