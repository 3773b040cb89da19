"""Paged attention of one layer: write the step's new K/V into the cache, then attend.

The one rule that picks the kernel lives here: a step whose every sequence brings exactly one
new token runs the decode kernel, any other step the prefill kernel (which handles any mix of
chunks and single tokens).  In batch-invariant mode every step runs the prefill kernel: the
two kernels sum a token's attention in different orders, so a token must not switch kernels
with what else its step holds.
"""

from __future__ import annotations

import torch

from cbatch.layers.kv_cache import KVCache
from cbatch.layers.module import Module
from cbatch.layers.step_batch import StepBatch
from cbatch.ops import BoundKernels


class PagedAttention(Module):
    """Attention of a step's new tokens over their sequences' paged KV cache (no weights).

    ``forward(q, k, v, batch, kv_cache, kernels)``: q, k, v ``[T, H, D]`` (dense ``[H, D]`` rows;
    views of a fused projection are fine) → ``[T, H, D]``.
    """

    batch_invariant = False  # set by the model's set_batch_invariant

    def __init__(self, layer_idx: int, scale: float):
        super().__init__()
        self.layer_idx = layer_idx
        self.scale = scale

    def kernel_for(self, batch: StepBatch) -> str:
        """``"decode"`` or ``"prefill"``: the kernel this layer runs for ``batch``."""
        return "decode" if batch.is_decode and not self.batch_invariant else "prefill"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: StepBatch,
                kv_cache: KVCache, kernels: BoundKernels) -> torch.Tensor:
        key_cache, value_cache = kv_cache.layer(self.layer_idx)
        kernels.write_kv_cache(k, v, key_cache, value_cache, batch.slot_mapping)
        if self.kernel_for(batch) == "decode":
            return kernels.decode(q, key_cache, value_cache, batch.block_tables, batch.seq_lens,
                                  self.scale)
        return kernels.prefill(q, key_cache, value_cache, batch.block_tables, batch.cu_seqlens_q,
                               batch.seq_lens, self.scale, batch.max_query_len)
