"""The normalizations: RMSNorm as the Llama family computes it (Hugging Face's
``LlamaRMSNorm``: normalize in fp32, cast back, then scale; the formula and its CPU kernel in
:mod:`cbatch.ops.layer_ops`) and GPT-2's LayerNorm (torch's).
Row by row, so batch-invariant as they stand."""

from __future__ import annotations

import torch
from torch import nn

from cbatch.layers.module import DirectCall, Module
from cbatch.ops import layer_ops


class RMSNorm(Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim (``[..., hidden]``).

    ``norm(x)`` returns the normalized x; ``norm(x, residual)`` first adds x to the residual
    stream and returns ``(norm(x + residual), x + residual)`` (vLLM's plumbing: one fused
    pass on the CPU, which takes over x and residual in place; :mod:`cbatch.ops.layer_ops`)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return layer_ops.rms_norm(x, self.weight, self.eps)
        return layer_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class LayerNorm(DirectCall, nn.LayerNorm):
    """``nn.LayerNorm`` called without the per-call hook dispatch (:mod:`cbatch.layers.module`)."""
