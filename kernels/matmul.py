"""A batch-invariant matmul in Triton: ``y = x @ weight.T + bias`` with one fixed configuration.

cuBLAS (and an autotuned Triton matmul) pick tile shapes and split-K from the problem's
shape, so a row of ``x`` can be summed in a different order when the number of rows M
changes.  Here there is one configuration and no split-K: every output element is the same
loop over K in steps of BLOCK_K, whatever M is and whichever tile the row lands in, and M is
kept out of Triton's integer specialization so that every M runs the same compiled code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cbatch.kernels._utils import upcast

# One configuration for every shape (never autotuned: a second one would change the order).
BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 64, 64, 32, 4, 3


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_x_m, stride_w_n, stride_o_m,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = (k0 + offs_k) < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_x_m + (k0 + offs_k)[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + offs_n[:, None] * stride_w_n + (k0 + offs_k)[None, :],
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_o_m + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T + bias[N]`` → ``[M, N]`` in x's dtype (fp32 accumulation).

    Rows of x and of weight must be dense (stride 1 along K).  fp32 runs in IEEE fp32 (as
    torch does by default), fp16/bf16 on the tensor cores.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(f"x, weight and bias must share a dtype, got {x.dtype}, "
                        f"{weight.dtype}, {None if bias is None else bias.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"x and weight must have dense rows, got strides {x.stride()} and "
                         f"{weight.stride()}")
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _matmul_kernel[grid](
        x, weight, weight if bias is None else bias, out,
        M, N, K,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, UPCAST=upcast(x.dtype),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return out
