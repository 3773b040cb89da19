"""The Llama layers' small ops: RMSNorm (alone, or after the residual add), SiLU-and-mul and
the rotary embedding, under vLLM's names and semantics.

Where the tensors are on the CPU and the extension has them, each runs one C++ pass
(``torch.ops.cbatch.rms_norm``, ``fused_add_rms_norm``, ``silu_and_mul``,
``rotary_embedding``: csrc/cpu/layernorm.cpp, activation.cpp, pos_encoding.cpp) instead of
several torch ops and their temporaries; elsewhere (CUDA, a build without the extension, or
autograd recording) the torch formulas below run.  :func:`runs_kernel` is the one rule.

The kernels round where the formulas round, so their outputs are the formulas' bit for bit,
except that RMSNorm's fp32 sum of squares runs in another order (a few fp32 ulps of the sum,
which can move an output by one ulp of its dtype) and SiLU's e^-x is another fp32 polynomial
(an ulp or two of fp32 before the rounding to the dtype).  Rows are independent either way, so
batch invariance holds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cbatch.ops import compiled
from cbatch.ops.checks import check_no_meta_mix

_HAS_KERNELS: list[bool] = []  # (not functools.cache: torch.compile warns about it)


def kernels_available() -> bool:
    """Whether the C++ CPU kernels of these ops are compiled in (an extension built from older
    sources lacks them)."""
    if not _HAS_KERNELS:
        _HAS_KERNELS.append("cpu" in compiled.compiled_backends()
                            and hasattr(torch.ops.cbatch, "fused_add_rms_norm"))
    return _HAS_KERNELS[0]


def runs_kernel(*tensors: torch.Tensor) -> bool:
    """The one rule: the C++ kernel runs when every tensor is on the CPU, the kernels are
    compiled, and autograd is not recording through them (they are in-place and have no
    backward)."""
    # (a loop over is_cpu: a generator over t.device costs ~5 µs for three tensors, and every
    # layer of a decode step asks four times)
    for t in tensors:
        if not t.is_cpu:
            return False
    if not kernels_available():
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Hugging Face's LlamaRMSNorm: normalize in fp32, cast back, then scale in weight's dtype
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim.

    x: ``[rows, n]`` or ``[T, H, n]`` (a dense last dim); weight: ``[n]``.  Returns a new
    tensor of x's shape (in the promoted dtype when weight's differs, as the formula's)."""
    if (weight.dtype == x.dtype and x.dim() in (2, 3) and x.stride(-1) == 1
            and runs_kernel(x, weight)):
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        torch.ops.cbatch.rms_norm(out, x, weight, eps)
        return out
    return rms_norm_torch(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual; x = rms_norm(residual)``: returns ``(x, residual)``.

    x, residual: ``[T, n]``; weight: ``[n]``.  On the CPU kernel both are updated in place
    (vLLM's semantics; the caller gives up its x and residual), elsewhere new tensors."""
    if (weight.dtype == x.dtype and x.dim() == 2 and x.stride(-1) == 1
            and residual.stride(-1) == 1 and runs_kernel(x, residual, weight)):
        torch.ops.cbatch.fused_add_rms_norm(x, residual, weight, eps)
        return x, residual
    residual = x + residual
    return rms_norm_torch(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for x ``[T, 2d]``: a new ``[T, d]``."""
    if x.dim() == 2 and x.stride(-1) == 1 and runs_kernel(x):
        out = x.new_empty((x.shape[0], x.shape[1] // 2))
        torch.ops.cbatch.silu_and_mul(out, x)
        return out
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x * [cos, cos] + rotate_half(x) * [sin, sin], as transformers writes it, half by half
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[T, H, D]`` and k ``[T, H_kv, D]`` rotated in place (rotate-half) by their tokens'
    positions ``[T]`` (int64), from cos_sin_cache ``[P, D]`` (cos, then sin, in q's dtype).
    The CPU kernel only: see :meth:`cbatch.layers.rotary_embedding.RotaryEmbedding.angles`."""
    torch.ops.cbatch.rotary_embedding(positions, q, k, q.shape[-1], cos_sin_cache, True)
    return q, k


if "cpu" in compiled.compiled_backends() and kernels_available():  # for torch.compile

    @torch.library.register_fake("cbatch::rms_norm")
    def _(result, input, weight, epsilon):
        check_no_meta_mix("cbatch::rms_norm", result=result, input=input, weight=weight)

    @torch.library.register_fake("cbatch::fused_add_rms_norm")
    def _(input, residual, weight, epsilon):
        check_no_meta_mix("cbatch::fused_add_rms_norm", input=input, residual=residual,
                          weight=weight)

    @torch.library.register_fake("cbatch::silu_and_mul")
    def _(result, input):
        check_no_meta_mix("cbatch::silu_and_mul", result=result, input=input)

    @torch.library.register_fake("cbatch::rotary_embedding")
    def _(positions, query, key, head_size, cos_sin_cache, is_neox):
        check_no_meta_mix("cbatch::rotary_embedding", positions=positions, query=query,
                          key=key, cos_sin_cache=cos_sin_cache)
