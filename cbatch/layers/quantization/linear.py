"""A linear layer on a :class:`~cbatch.layers.quantization.weight.QuantizedWeight`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cbatch.layers.module import Module
from cbatch.layers.quantization.weight import QuantizedWeight, quantize
from cbatch.ops import cpu, reference


class QuantizedLinear(Module):
    """``x @ W.T + bias`` with ``W`` quantized: cbatch's CPU kernel (``cbatch::
    quantized_linear``, dequantizing in registers) where it runs
    (:func:`cbatch.ops.cpu.quantized_linear_available`), else the pure-torch reference.

    ``forward(x, gelu=None, residual=None)`` as :class:`cbatch.layers.linear.Linear`'s (the
    GELU and the add run after the matmul).  The packed tensors are buffers: they follow
    ``.to(device)`` and are in the state dict under their own names."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.bits, self.group_size = weight.bits, weight.group_size
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.register_buffer("qweight", weight.qweight)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("zeros", weight.zeros)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.placed = False  # qweight and scales moved to a CPU runner's huge pages

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, group_size: int | None
                    ) -> QuantizedLinear:
        """``linear``'s weight quantized (:func:`quantize`), its bias kept as it is."""
        return cls(quantize(linear.weight, bits, group_size), linear.bias)

    @property
    def weight(self) -> QuantizedWeight:
        return QuantizedWeight(self.bits, self.group_size, self.out_features, self.in_features,
                               self.qweight, self.scales, self.zeros)

    def forward(self, x: torch.Tensor, gelu: str | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        args = (self.qweight, self.scales, self.zeros, self.bits, self.group_size,
                self.out_features, self.bias)
        if x.device.type == "cpu" and cpu.quantized_linear_available():
            y = torch.ops.cbatch.quantized_linear(x if x.stride(-1) == 1 else x.contiguous(),
                                                  *args)
        else:
            y = reference.quantized_linear(x, *args)
        if gelu is not None:
            y = F.gelu(y, approximate=gelu)
        return y if residual is None else residual + y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, group_size={self.group_size}, bias={self.bias is not None}")
