"""A linear layer on a :class:`~cbatch.layers.quantization.weight.QuantizedWeight`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cbatch.layers.module import Module
from cbatch.layers.quantization.weight import (QuantizedWeight, pack_w4a8, pack_w8a8, quantize,
                                               unpack_w4a8, unpack_w8a8)
from cbatch.ops import cpu, reference
from cbatch.ops.backends import triton_available


def on_triton(x: torch.Tensor) -> bool:
    """Whether a quantized layer runs its matmul in Triton for ``x``: CUDA tensors, where
    triton is installed (tests point this at CPU tensors under Triton's interpreter)."""
    return x.device.type == "cuda" and triton_available()


def triton_quantized_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                            zeros: torch.Tensor | None, bits: int, group_size: int,
                            out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """W8A16 / W4A16 in Triton (``kernels/quant_matmul.py``,
    ``torch.ops.cbatch_triton.quantized_linear``) on x ``[..., K]``: the arguments of
    :func:`cbatch.ops.reference.quantized_linear`."""
    from cbatch.ops import triton as triton_ops  # (importing triton is slow: on first use)

    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = triton_ops.quantized_linear(x2, qweight, scales, zeros, bits, group_size,
                                    out_features, bias)
    return y.view(*x.shape[:-1], out_features)


def triton_quantized_linear_w8a8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                                 out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8 in Triton on x ``[..., K]``, the arguments of
    :func:`cbatch.ops.reference.quantized_linear_w8a8` (``qweight`` in ``pack_w8a8``'s
    layout): x quantized per token (``torch.ops.cbatch_triton.scaled_int8_quant``), then
    ``torch.ops.cbatch_triton.w8a8_linear``."""
    from cbatch.ops import triton as triton_ops  # (importing triton is slow: on first use)

    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    x_q, x_scale = triton_ops.scaled_int8_quant(x2)
    y = triton_ops.w8a8_linear(x_q, x_scale, qweight, scales, out_features, bias, x.dtype)
    return y.view(*x.shape[:-1], out_features)


class QuantizedLinear(Module):
    """``x @ W.T + bias`` with ``W`` quantized: on CUDA the Triton GEMMs
    (:func:`triton_quantized_linear`, dequantizing in registers;
    :func:`triton_quantized_linear_w8a8`); on the CPU cbatch's kernel (``cbatch::
    quantized_linear``; W8A8: ``cbatch::quantized_linear_w8a8``) where it runs
    (:func:`cbatch.ops.cpu.quantized_linear_available`); else the pure-torch reference.

    ``act_bits=8`` (W8A8, as vLLM runs compressed-tensors' int8 checkpoints): x is quantized
    too, to int8 per token on every call (:func:`cbatch.ops.reference.quantize_per_token`),
    and the sums run in integers (``cbatch::quantized_linear_w8a8``); the weight must be
    symmetric int8 with one group per output channel, and ``qweight`` holds it in the W8A8
    layout (:func:`~cbatch.layers.quantization.weight.pack_w8a8`; :attr:`weight` unpacks it).
    On int4 in groups of a multiple of 32 k, symmetric or with zero points (W4A8, llama.cpp's
    Q4_0 / Q4_1 x Q8_0 / Q8_1 route),
    x is quantized per token and per group of the weight's k
    (:func:`cbatch.ops.reference.quantize_per_group`), each group's sums run in integers and
    the groups' scaled sums in fp32 (``cbatch::quantized_linear_w4a8``; the weight in
    :func:`~cbatch.layers.quantization.weight.pack_w4a8`'s layout).  It has no CUDA kernel.

    ``forward(x, gelu=None, residual=None)`` as :class:`cbatch.layers.linear.Linear`'s (the
    GELU and the add run after the matmul).  The packed tensors are buffers: they follow
    ``.to(device)`` and are in the state dict under their own names.

    ``perm`` (int64 ``[K]``, or None): the weight's k are stored in this order (GPTQ's
    ``desc_act``, sorted by group so that groups are contiguous), and x is gathered into it
    first: ``y = x[..., perm] @ W.T``, W the weight as stored."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                 act_bits: int | None = None, perm: torch.Tensor | None = None):
        super().__init__()
        if act_bits not in (None, 8):
            raise ValueError(f"act_bits must be None or 8, got {act_bits}")
        if act_bits == 8 and (weight.group_size % 32 if weight.bits == 4 else (
                weight.groups != 1 or weight.zeros is not None)):
            raise ValueError(f"act_bits=8 takes symmetric int8 weights with one group per "
                             f"output channel (W8A8) or int4 in groups of a multiple of 32 "
                             f"(W4A8), got bits={weight.bits}, group_size="
                             f"{weight.group_size} of in_features={weight.in_features}"
                             + (", zero points" if weight.zeros is not None else ""))
        if perm is not None and (perm.dtype != torch.int64
                                 or tuple(perm.shape) != (weight.in_features,)):
            raise ValueError(f"perm must be int64 [{weight.in_features}], got {perm.dtype} "
                             f"{list(perm.shape)}")
        self.bits, self.group_size, self.act_bits = weight.bits, weight.group_size, act_bits
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.register_buffer("qweight", weight.qweight if act_bits is None
                             else pack_w8a8(weight) if weight.bits == 8 else pack_w4a8(weight))
        self.register_buffer("scales", weight.scales)
        self.register_buffer("zeros", weight.zeros)
        self.register_buffer("perm", perm)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.placed = False  # qweight and scales moved to a CPU runner's huge pages

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, group_size: int | None,
                    act_bits: int | None = None) -> QuantizedLinear:
        """``linear``'s weight quantized (:func:`quantize`), its bias kept as it is."""
        return cls(quantize(linear.weight, bits, group_size), linear.bias, act_bits)

    @property
    def weight(self) -> QuantizedWeight:
        if self.act_bits == 8 and self.bits == 4:
            return unpack_w4a8(self.qweight, self.scales, self.group_size, self.out_features,
                               self.in_features, self.zeros)
        if self.act_bits == 8:
            return unpack_w8a8(self.qweight, self.scales, self.out_features, self.in_features)
        return QuantizedWeight(self.bits, self.group_size, self.out_features, self.in_features,
                               self.qweight, self.scales, self.zeros)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the dequantized weight, fp32 ``[T, in_features]`` (``scales * q``,
        as :meth:`QuantizedWeight.dequantize`): a tied embedding's lookup.  W8A8 only (the
        layout a quantized lm_head has), read where they lie: a 4-byte lane of ``qweight`` is
        one column's four k (:func:`~cbatch.layers.quantization.weight.pack_w8a8`)."""
        if self.act_bits != 8 or self.bits != 8:
            raise ValueError(f"rows() reads the W8A8 layout, not bits={self.bits}, "
                             f"act_bits={self.act_bits}")
        quads = cpu.packed_rows(self.qweight.view(torch.int32), ids)  # [T, ceil(K / 4)]
        q = quads.view(torch.uint8)[:, :self.in_features].to(torch.int16) - 128
        return q * self.scales[0, ids, None]

    def forward(self, x: torch.Tensor, gelu: str | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        # The tensors are read from nn.Module's own dicts: its __getattr__, which finds
        # buffers and parameters, costs about 2 µs a name, and a batch-1 decode step of a
        # 32-layer model makes 129 of these calls
        # (benchmarks/NOTES.md, "Host side of a step").
        # A bias set to None is a plain attribute, in neither dict.
        buffers = self._buffers
        perm = buffers["perm"]
        if perm is not None:
            x = x.index_select(-1, perm)
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        qweight, scales, bias = buffers["qweight"], buffers["scales"], self._parameters.get("bias")
        if self.act_bits == 8 and self.bits == 4:
            y = self._forward_w4a8(x2, qweight, scales, buffers["zeros"], bias)
        elif self.act_bits == 8:
            y = self._forward_w8a8(x2, qweight, scales, bias)
        else:
            y = self._forward_w16(x2, qweight, scales, buffers["zeros"], bias)
        if x2 is not x:
            y = y.view(*x.shape[:-1], self.out_features)
        if gelu is not None:
            y = F.gelu(y, approximate=gelu)
        return y if residual is None else residual + y

    def _forward_w16(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     zeros: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        args = (qweight, scales, zeros, self.bits, self.group_size, self.out_features, bias)
        if on_triton(x):
            return triton_quantized_linear(x, *args)
        if x.is_cpu and cpu.quantized_linear_available():
            return torch.ops.cbatch.quantized_linear(
                x if x.stride(-1) == 1 else x.contiguous(), *args)
        return reference.quantized_linear(x, *args)

    def _forward_w8a8(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        args = (qweight, scales, self.out_features, bias)
        if on_triton(x):
            return triton_quantized_linear_w8a8(x, *args)
        if x.is_cpu and cpu.quantized_linear_available():
            return torch.ops.cbatch.quantized_linear_w8a8(
                x if x.stride(-1) == 1 else x.contiguous(), *args)
        return reference.quantized_linear_w8a8(x, *args)

    def _forward_w4a8(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                      zeros: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        args = (qweight, scales, self.group_size, self.out_features, bias, zeros)
        if x.is_cpu and cpu.quantized_linear_w4a8_available():
            return torch.ops.cbatch.quantized_linear_w4a8(
                x if x.stride(-1) == 1 else x.contiguous(), *args)
        return reference.quantized_linear_w4a8(x, *args)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, group_size={self.group_size}, "
                + (f"act_bits={self.act_bits}, " if self.act_bits else "")
                + f"bias={self.bias is not None}")
