"""A fused projection whose shards are stored in different forms.

The Llama family runs q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj`` (one
matmul each, as vLLM does).  A file may store the shards of one projection in different
quantized forms: llama.cpp's ``Q4_K_M`` files keep ``attn_v`` at 6 bits in some layers and
``attn_q``/``attn_k`` at 4.  Such a projection cannot be one weight in one layout; vLLM's GGUF
layers run each shard's kernel and write their outputs side by side, and so does
:class:`StackedLinear`, with one linear layer per run of shards of the same form (the shards
of a run fused as usual).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cbatch.layers.module import Module


class StackedLinear(Module):
    """``x @ W.T + bias`` for ``W`` stacked along the outputs from ``parts`` (linear layers
    with ``in_features`` and ``out_features``: :class:`~cbatch.layers.quantization.
    QuantizedLinear`, :class:`~cbatch.layers.linear.Linear`), each run by its own kernel.

    ``forward(x, gelu=None, residual=None)`` as :class:`cbatch.layers.linear.Linear`'s: x
    ``[..., in_features]`` → ``[..., sum of the parts' out_features]``."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        if len(parts) < 2 or len({p.in_features for p in parts}) != 1:
            raise ValueError("StackedLinear stacks two or more linear layers of one "
                             f"in_features, got {[getattr(p, 'in_features', p) for p in parts]}")
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor, gelu: str | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.cat([part(x) for part in self.parts], dim=-1)
        if gelu is not None:
            y = F.gelu(y, approximate=gelu)
        return y if residual is None else residual + y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
