"""A linear layer on a :class:`~cbatch.layers.quantization.weight.QuantizedWeight`."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from cbatch.layers.module import Module
from cbatch.layers.quantization.weight import (QuantizedWeight, pack_w4a8, pack_w8a8,
                                               pack_w8a8g, quantize, unpack_w4a8, unpack_w8a8,
                                               unpack_w8a8g)
from cbatch.ops import cpu, quantized
from cbatch.quantization import Scheme

Place = Callable[[torch.Tensor], torch.Tensor]  # a tensor's copy where a runner keeps weights


class QuantizedLinear(Module):
    """``x @ W.T + bias`` with ``W`` quantized, run by :func:`cbatch.ops.quantized.linear`
    (cbatch's C++ kernel on the CPU, the Triton GEMMs on CUDA, else the pure-torch reference)
    for the layer's :attr:`scheme`, set once here: the weight's bits and group size, and
    ``act_bits``.

    ``act_bits=8``: x is quantized too, on every call, and the sums run in integers.  On
    symmetric int8 with one group per output channel (W8A8, as vLLM runs compressed-tensors'
    int8 checkpoints) x is int8 per token (:func:`cbatch.ops.reference.quantize_per_token`)
    and ``qweight`` holds the weight in
    :func:`~cbatch.layers.quantization.weight.pack_w8a8`'s layout; on int4 in groups of a
    multiple of 32 k, symmetric or with zero points (W4A8, llama.cpp's Q4_0 / Q4_1 x Q8_0
    route; CPU only), x is int8 per token and per group of the weight's k
    (:func:`cbatch.ops.reference.quantize_per_group`) and ``qweight`` is in
    :func:`~cbatch.layers.quantization.weight.pack_w4a8`'s; on int8 in groups of a multiple of
    16 k (W8A8 per group, kind ``"w8a8g"``: llama.cpp's Q8_0 x Q8_0; CPU only, W4A8's kernel)
    alike, ``qweight`` in :func:`~cbatch.layers.quantization.weight.pack_w8a8g`'s.
    :attr:`weight` unpacks any of them.

    ``forward(x, gelu=None, residual=None)`` as :class:`cbatch.layers.linear.Linear`'s (the
    GELU and the add run after the matmul).  The packed tensors are buffers: they follow
    ``.to(device)`` and are in the state dict under their own names.

    ``mins`` (fp32 ``[G, N16]``, or None): the weight's float mins, ``W = scales * q - mins``
    (:mod:`~cbatch.layers.quantization.weight`), a buffer beside ``scales``; every kind but
    W8A8 takes them.

    ``perm`` (int64 ``[K]``, or None): the weight's k are stored in this order (GPTQ's
    ``desc_act``, sorted by group so that groups are contiguous), and x is gathered into it
    first: ``y = x[..., perm] @ W.T``, W the weight as stored."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                 act_bits: int | None = None, perm: torch.Tensor | None = None):
        super().__init__()
        self.scheme = Scheme.of(weight.bits, weight.group_size, act_bits, weight.in_features)
        refusal = self.scheme.refusal(weight.in_features, weight.zeros is not None)
        if refusal:
            raise ValueError(f"act_bits=8 takes {Scheme(8, None, 8).requirement} (W8A8), "
                             f"{Scheme(8, 16, 8).requirement} (W8A8 per group) or "
                             f"{Scheme(4, 32, 8).requirement} (W4A8), got bits={weight.bits}, "
                             f"group_size={weight.group_size} of in_features="
                             f"{weight.in_features}"
                             + (", zero points" if weight.zeros is not None else ""))
        if weight.mins is not None and self.scheme.kind == "w8a8":
            raise ValueError("W8A8 takes symmetric int8 weights: got one with mins")
        if perm is not None and (perm.dtype != torch.int64
                                 or tuple(perm.shape) != (weight.in_features,)):
            raise ValueError(f"perm must be int64 [{weight.in_features}], got {perm.dtype} "
                             f"{list(perm.shape)}")
        self.kind = self.scheme.kind  # read on every call: an attribute, not a property
        self.group_size = weight.group_size
        self.in_features, self.out_features = weight.in_features, weight.out_features
        pack_for = {"w8a8": pack_w8a8, "w4a8": pack_w4a8, "w8a8g": pack_w8a8g}.get(self.kind)
        self.register_buffer("qweight", weight.qweight if pack_for is None else pack_for(weight))
        self.register_buffer("scales", weight.scales)
        self.register_buffer("zeros", weight.zeros)
        self.register_buffer("mins", weight.mins)
        self.register_buffer("perm", perm)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.placed = False  # qweight and scales moved to a CPU runner's huge pages

    def place(self, place: Place) -> bool:
        """Move the packed weight, scales and mins (the bytes a decode step streams) to
        ``place``'s memory (a CPU runner's huge pages), once; whether they moved now."""
        if self.placed:
            return False
        with torch.no_grad():
            self.qweight, self.scales = place(self.qweight), place(self.scales)
            if self.mins is not None:
                self.mins = place(self.mins)
        self.placed = True
        return True

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: Scheme) -> QuantizedLinear:
        """``linear``'s weight quantized to ``scheme`` (:func:`quantize`), its bias kept."""
        return cls(quantize(linear.weight, scheme.bits, scheme.group_size), linear.bias,
                   scheme.act_bits)

    @property
    def bits(self) -> int:
        return self.scheme.bits

    @property
    def act_bits(self) -> int | None:
        return self.scheme.act_bits

    @property
    def weight(self) -> QuantizedWeight:
        if self.kind in ("w4a8", "w8a8g"):
            unpack = unpack_w4a8 if self.kind == "w4a8" else unpack_w8a8g
            return unpack(self.qweight, self.scales, self.group_size, self.out_features,
                          self.in_features, self.zeros, self.mins)
        if self.kind == "w8a8":
            return unpack_w8a8(self.qweight, self.scales, self.out_features, self.in_features)
        return QuantizedWeight(self.bits, self.group_size, self.out_features, self.in_features,
                               self.qweight, self.scales, self.zeros, self.mins)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the dequantized weight, fp32 ``[T, in_features]``, bitwise
        :meth:`QuantizedWeight.dequantize`'s: a tied embedding's lookup.  The int8-activation
        kinds (a quantized lm_head's), read where they lie: a 4-byte lane of ``qweight`` is one
        column's four k (W8A8's ``q + 128``; W8A8 per group's ``q``; W4A8's nibbles, columns
        8..15 in the high ones)."""
        K, kind = self.in_features, self.kind
        if kind not in ("w8a8", "w8a8g", "w4a8"):
            raise ValueError(f"rows() reads the int8-activation layouts, not {kind}")
        if kind == "w8a8":
            quads = cpu.packed_rows(self.qweight.view(torch.int32), ids)  # [T, ceil(K / 4)]
            q = quads.view(torch.uint8)[:, :self.in_features].to(torch.int16) - 128
            return q * self.scales[0, ids, None]
        if kind == "w8a8g":  # lane n % 16 of block n // 16
            quads = cpu.packed_rows(self.qweight.view(torch.int32), ids)  # [T, Q]
            q = quads.view(torch.int8)[:, :K].to(torch.int32)
        else:  # lane n % 8, its low nibbles columns 0..7 of the block, its high ones 8..15
            quads = self.qweight.view(torch.int32)[ids // 16, :, ids % 8]  # [T, Q]
            u = quads.contiguous().view(torch.uint8)[:, :K].to(torch.int32)
            q = torch.where((ids % 16 < 8)[:, None], u & 15, u >> 4)
        group = torch.arange(K, device=ids.device) // self.group_size
        s = self.scales[:, ids].t()[:, group]  # [T, K]
        if self.mins is not None:
            return s * q.float() - self.mins[:, ids].t()[:, group]
        zeros = self.zeros
        z = (8 if kind == "w4a8" else 0) if zeros is None else \
            zeros[:, ids].t()[:, group].to(torch.int32)
        return s * (q - z).float()

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
        y = quantized.linear(x2, self.kind, buffers["qweight"], buffers["scales"],
                             buffers["zeros"], self.group_size, self.out_features,
                             self._parameters.get("bias"), buffers["mins"])
        if x2 is not x:
            y = y.view(*x.shape[:-1], self.out_features)
        if gelu is not None:
            y = F.gelu(y, approximate=gelu)
        return y if residual is None else residual + y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, group_size={self.group_size}, "
                + (f"act_bits={self.act_bits}, " if self.act_bits else "")
                + f"bias={self.bias is not None}")
