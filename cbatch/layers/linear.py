"""Batch-invariant linear layers: a row's result never depends on how many rows share the call.

torch's matmuls choose their algorithm from the problem's shape.  On the CPU, MKL's sgemm
computes one row as a matrix-vector product, and rows that do not fill a whole micro-kernel
panel (the last ``M % 4`` rows on AVX2, depending on how the rows are shared out among
threads) with an edge kernel that sums in another order; measured with the commands in
benchmarks/NOTES.md ("Batch-invariant mode").  On the GPU, cuBLAS picks tiles and split-K from M.
So in batch-invariant mode the model's linear layers run:

- CPU, where the "cbatch" route runs (:mod:`cbatch.ops.cpu`: AVX-512, or AVX2 for fp32):
  cbatch's kernel on its packed weights, for every row count; each output element is one
  in-order sum over k, whatever the other rows or the thread count.
- other CPUs, :func:`batch_invariant_linear`: the rows are padded with zero rows to a multiple of
  :data:`ROW_MULTIPLE`, so that every panel is full and every row goes through the same
  micro-kernel (a multiple of the panel heights of MKL's AVX2 and AVX-512 kernels).
  tests/core/test_batch_invariance.py checks, on the machine that runs it, that each row is
  bitwise the same for every M.  Not on AMX CPUs in bf16 (oneDNN's GEMM there sums a row
  differently as M grows, padded or not); every AMX CPU runs the "cbatch" route in bf16.
- CUDA: a Triton matmul with one fixed configuration and no split-K
  (``cbatch.kernels.matmul``).

A CPU engine's model runner packs the weights (:func:`cbatch.core.cpu.packing.pack_linears`);
:class:`Linear` then runs the packed kernel.

LayerNorm, the activation, the embeddings and the sampler work row by row already.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cbatch.layers.module import DirectCall
from cbatch.ops import cpu

ROW_MULTIPLE = 16


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose every output row is bitwise independent of the other rows of ``x``.

    x: ``[M, K]``; weight: ``[N, K]``; bias: ``[N]`` or None → ``[M, N]``.
    """
    if x.device.type == "cuda":
        from cbatch.kernels import matmul

        return matmul.matmul(x.contiguous(), weight, bias)
    M = x.shape[0]
    pad = -M % ROW_MULTIPLE
    if pad == 0:
        return F.linear(x, weight, bias)
    return F.linear(F.pad(x, (0, 0, 0, pad)), weight, bias)[:M]


class Linear(DirectCall, nn.Linear):
    """``nn.Linear`` that runs :func:`batch_invariant_linear` once ``batch_invariant`` is set
    (2-D inputs), and the CPU route's kernel on a packed weight once a CPU model runner packed
    it (:func:`cbatch.ops.cpu.packed_linear`).

    ``forward(x, gelu=None, residual=None)``: ``gelu`` (``"tanh"`` or ``"none"``, as
    ``F.gelu``'s ``approximate``) applies GELU to the output, ``residual`` is added to it; on
    packed weights both run inside the matmul (one parallel region instead of two, which
    matters most on a busy CPU).  Not both at once.
    """

    batch_invariant = False
    packed_weight: torch.Tensor | None = None  # the route's layout: the weight itself, or a copy
    greedy_screen: cpu.GreedyScreen | None = None  # an lm_head's, on a CPU

    def forward(self, x: torch.Tensor, gelu: str | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed_weight is not None:  # batch-invariant: packed for the cbatch route only
            return cpu.packed_linear(x, self.packed_weight, self.bias, self.out_features,
                                     gelu, residual,
                                     amx=cpu.may_use_amx(self.batch_invariant))
        if self.batch_invariant:
            y = batch_invariant_linear(x, self.weight, self.bias)
        else:
            y = F.linear(x, self.weight, self.bias)
        if gelu is not None:
            y = F.gelu(y, approximate=gelu)
        return y if residual is None else residual + y

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if cpu.is_packed(self.weight):  # checkpoints hold the dense layout
            destination[prefix + "weight"] = cpu.unpack(self.weight, self.out_features)
