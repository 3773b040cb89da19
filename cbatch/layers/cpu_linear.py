"""CPU linear layers on oneDNN, with each weight packed once into oneDNN's blocked layout.

torch's fp32 ``F.linear`` runs MKL's sgemm, which on a CPU that is not Intel's takes its AVX2
code path even where the CPU has AVX-512; and every call re-blocks the weight for the
micro-kernel.  oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``, the route vLLM's and
IPEX's CPU backends take) dispatches on the CPU's own instruction set (AVX-512, AVX512-BF16,
AMX), and reads a weight reordered once by ``torch.ops.mkldnn._reorder_linear_weight`` with
no per-call packing.  Measured per shape and row count in benchmarks/NOTES.md ("CPU GEMM
routes", ``benchmarks/bench_linear.py``).

:func:`pack_linears` turns a model's :class:`~cbatch.layers.linear.Linear` layers over to it
when an engine's model runner is built (any model), on a CPU where it is the faster route
(:func:`cpu_linear_route`): the packed weight replaces the dense one (same bytes), except for
a weight shared with another module (a ``lm_head`` tied to the token embedding, which needs
the dense rows), which keeps its dense weight and gets a packed copy beside it.
:func:`unpack_linears` undoes it (the batch-invariant linear pads rows on the dense weight;
the runner of a batch-invariant engine unpacks).  Results differ from ``F.linear``'s
only in summation order (fp32: ~1e-6 relative).

``$CBATCH_CPU_LINEAR`` (``onednn`` or ``torch``) overrides the choice.
"""

from __future__ import annotations

import os

import torch

ROUTES = ("onednn", "torch")


def cpu_linear_route(dtype: torch.dtype) -> str:
    """``"onednn"`` (packed weights) or ``"torch"`` (``F.linear``) for ``dtype`` on this CPU.

    oneDNN where this torch has it and the CPU has AVX-512 (where it was measured faster at
    every shape but one) and, for bf16, where oneDNN runs bf16 on this CPU; ``F.linear``
    elsewhere (not measured there) and for other dtypes.
    """
    forced = os.environ.get("CBATCH_CPU_LINEAR")
    if forced:
        if forced not in ROUTES:
            raise ValueError(f"CBATCH_CPU_LINEAR must be one of {ROUTES}, got {forced!r}")
        if forced == "onednn" and not torch.backends.mkldnn.is_available():
            raise ValueError("CBATCH_CPU_LINEAR=onednn but this torch has no oneDNN")
        return forced
    if not torch.backends.mkldnn.is_available() or not torch.cpu._is_avx512_supported():
        return "torch"
    if dtype == torch.float32:
        return "onednn"
    if dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "onednn"
    return "torch"


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A dense ``[N, K]`` weight in oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
           activation: str = "none", approximate: str = "") -> torch.Tensor:
    """``act(x @ W.T + bias)`` on a packed weight.

    x: ``[M, K]``; packed: from :func:`pack` of ``[N, K]``; bias: ``[N]`` or None;
    activation: ``"none"`` or ``"gelu"`` (with ``approximate`` ``"tanh"`` or ``"none"``, as
    ``F.gelu``),
    applied inside the matmul's epilogue → ``[M, N]``.
    """
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, activation, [], approximate)


def linear_add(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
               residual: torch.Tensor) -> torch.Tensor:
    """``residual + x @ W.T + bias`` on a packed weight, the add in the matmul's epilogue.

    x: ``[M, K]``; residual: ``[M, N]`` → ``[M, N]`` (a new tensor).
    """
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, bias, "add")
