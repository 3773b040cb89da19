"""The normalizations: RMSNorm as the Llama family computes it (Hugging Face's
``LlamaRMSNorm``: normalize in fp32, cast back, then scale) and GPT-2's LayerNorm (torch's).
Row by row, so batch-invariant as they stand."""

from __future__ import annotations

import torch
from torch import nn

from cbatch.layers.module import DirectCall, Module


class RMSNorm(Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim (``[..., hidden]``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class LayerNorm(DirectCall, nn.LayerNorm):
    """``nn.LayerNorm`` called without the per-call hook dispatch (:mod:`cbatch.layers.module`)."""
