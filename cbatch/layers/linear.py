"""Batch-invariant linear layers: a row's result never depends on how many rows share the call.

torch's matmuls choose their algorithm from the problem's shape.  On the CPU, MKL's sgemm
computes one row as a matrix-vector product, and rows that do not fill a whole micro-kernel
panel (the last ``M % 4`` rows on AVX2, depending on how the rows are shared out among
threads) with an edge kernel that sums in another order; measured with the commands in
benchmarks/NOTES.md ("batch invariance").  On the GPU, cuBLAS picks tiles and split-K from M.
So in batch-invariant mode the model's linear layers run:

- CPU, where the "cbatch" route runs (:mod:`cbatch.layers.cpu_linear`: AVX-512, or AVX2 for
  fp32): cbatch's kernel on its packed weights, for every row count; each output element is
  one in-order sum over k, whatever the other rows or the thread count.
- other CPUs, :func:`linear`: the rows are padded with zero rows to a multiple of
  :data:`ROW_MULTIPLE`, so that every panel is full and every row goes through the same
  micro-kernel (a multiple of the panel heights of MKL's AVX2 and AVX-512 kernels).
  tests/core/test_batch_invariance.py checks, on the machine that runs it, that each row is
  bitwise the same for every M.
- CUDA: a Triton matmul with one fixed configuration and no split-K
  (``cbatch.kernels.matmul``).

LayerNorm, the activation, the embeddings and the sampler work row by row already.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from cbatch.layers import cpu_linear
from cbatch.layers.module import DirectCall

ROW_MULTIPLE = 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``F.linear`` whose every output row is bitwise independent of the other rows of ``x``.

    x: ``[M, K]``; weight: ``[N, K]``; bias: ``[N]`` or None → ``[M, N]``.
    """
    if x.device.type == "cuda":
        from cbatch.kernels import matmul

        return matmul.linear(x.contiguous(), weight, bias)
    M = x.shape[0]
    pad = -M % ROW_MULTIPLE
    if pad == 0:
        return F.linear(x, weight, bias)
    return F.linear(F.pad(x, (0, 0, 0, pad)), weight, bias)[:M]


class Linear(DirectCall, nn.Linear):
    """``nn.Linear`` that runs :func:`linear` once ``batch_invariant`` is set (2-D inputs),
    and the CPU route's kernel on a packed weight once :func:`pack_linears` packed it
    (:mod:`cbatch.layers.cpu_linear`).

    ``forward(x, gelu=None, residual=None)``: ``gelu`` (``"tanh"`` or ``"none"``, as
    ``F.gelu``'s ``approximate``) applies GELU to the output, ``residual`` is added to it; on
    packed weights both run inside the matmul (one parallel region instead of two, which
    matters most on a busy CPU).  Not both at once.
    """

    batch_invariant = False
    packed_weight: torch.Tensor | None = None  # the route's layout: the weight itself, or a copy
    greedy_screen: cpu_linear.GreedyScreen | None = None  # an lm_head's (pack_linears)

    def forward(self, x: torch.Tensor, gelu: str | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed_weight is not None:  # batch-invariant: packed for the cbatch route only
            return cpu_linear.linear(x, self.packed_weight, self.bias, self.out_features,
                                     gelu, residual)
        if self.batch_invariant:
            y = linear(x, self.weight, self.bias)
        else:
            y = F.linear(x, self.weight, self.bias)
        if gelu is not None:
            y = F.gelu(y, approximate=gelu)
        return y if residual is None else residual + y

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if cpu_linear.is_packed(self.weight):  # checkpoints hold the dense layout
            destination[prefix + "weight"] = cpu_linear.unpack(self.weight, self.out_features)


def _shared_weights(model: nn.Module) -> set[int]:
    """ids of parameters that more than one module holds (tied weights)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
    return {pid for pid, n in seen.items() if n > 1}


def pack_linears(model: nn.Module, batch_invariant: bool = False,
                 place: Callable[[torch.Tensor], torch.Tensor] | None = None) -> bool:
    """Pack every :class:`Linear` of a CPU model for its dtype's route on this CPU (see
    :func:`cbatch.layers.cpu_linear.cpu_linear_route`; ``"torch"`` packs nothing);
    idempotent.  ``batch_invariant``: only the ``"cbatch"`` route, whose kernel sums a row
    alike for every row count, keeps packed weights; with another route the dense weights
    come back (:func:`linear` pads their rows).  ``place``: where each packed weight (and
    greedy screen) goes, a copy of it in other memory (the model runner's huge pages); one
    at a time, so the dense weight it replaces is freed before the next is packed.  Returns
    whether the weights are packed."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    if not layers or layers[0].weight.device.type != "cpu":
        return False
    dtype = layers[0].weight.dtype
    route = cpu_linear.cpu_linear_route(dtype)
    if batch_invariant and any(layer.packed_weight is not None and layer.packed_weight.is_mkldnn
                               for layer in layers):
        unpack_linears(model)
    if route == "torch" or (batch_invariant and route != "cbatch"):
        return False
    shared = _shared_weights(model)
    # The lm_head gets a greedy screen (cpu_linear.GreedyScreen: fp32 a bf16 copy, bf16 an
    # int8 one) where cbatch's kernel runs it; it is exact for the logits of cbatch's kernel,
    # which also streams the lm_head faster than oneDNN (benchmarks/NOTES.md, "The lm_head's
    # greedy screen", "An int8 screen for the bf16 lm_head").
    head = getattr(model, "lm_head", None)
    screened = route == "cbatch" and isinstance(head, Linear) and head.bias is None \
        and head.in_features % 2 == 0 and cpu_linear.screen_available(dtype)
    with torch.no_grad():
        for layer in layers:
            if layer.packed_weight is not None:
                continue
            if route == "cbatch" and dtype == torch.bfloat16 and layer.in_features % 2:
                continue  # vdpbf16ps takes pairs of k
            if layer is head and screened:
                screen = cpu_linear.pack_screen(layer.weight)
                layer.greedy_screen = dataclasses.replace(screen, weight=place(screen.weight)) \
                    if place else screen
            packed = cpu_linear.pack(layer.weight, route)
            if place and not packed.is_mkldnn:  # oneDNN's opaque tensors stay where they are
                packed = place(packed)
            if id(layer.weight) in shared:
                layer.packed_weight = packed  # the dense weight stays for its other user
            else:
                layer.weight = nn.Parameter(packed, requires_grad=False)
                layer.packed_weight = layer.weight.detach()  # a tensor, not a 2nd parameter
    return True


def unpack_linears(model: nn.Module) -> None:
    """Give every packed :class:`Linear` its dense weight back."""
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, Linear) and layer.packed_weight is not None:
                if cpu_linear.is_packed(layer.weight):
                    layer.weight = nn.Parameter(
                        cpu_linear.unpack(layer.weight, layer.out_features))
                layer.packed_weight = None
                layer.greedy_screen = None
