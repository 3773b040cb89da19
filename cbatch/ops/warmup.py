"""Compile every kernel a model will call at start-up instead of in the first request."""

from __future__ import annotations

import torch

from cbatch.ops.backends import bind_kernels


def warmup(dtype: torch.dtype, head_dim: int, block_size: int, device: torch.device | str,
           backend: str | None = None, num_heads: int = 1, num_kv_heads: int | None = None
           ) -> dict[str, str]:
    """Run every kernel a model of this shape class will call, once, on tiny inputs, so
    that compilation (Triton's JIT; its autotuning under CBATCH_TRITON_AUTOTUNE=1) happens
    at start-up and not in the first request's step.

    It runs the kernels :func:`~cbatch.ops.backends.bind_kernels` gives a model.  Covers
    ``write_kv_cache``, ``paged_decode_attention`` (with the Triton backend on CUDA:
    the single-pass and the split-KV variants) and ``paged_prefill_attention``, each for
    block tables of a width divisible by 16 and of one that is not (Triton specializes on
    that), with ``num_heads`` query heads over ``num_kv_heads`` KV heads (default: as many;
    Triton specializes a group of one).  Returns ``{op: backend}``, the backend each op
    resolved to.
    """
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    device = torch.device(device)
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    if min(head_dim, block_size, num_heads, num_kv_heads) < 1 or num_heads % num_kv_heads:
        raise ValueError(f"head_dim, block_size and num_heads must be >= 1, num_heads a "
                         f"multiple of num_kv_heads, got {head_dim}, {block_size}, "
                         f"{num_heads}, {num_kv_heads}")
    num_blocks = 4
    kc = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype,
                     device=device)
    vc = torch.zeros_like(kc)
    new_kv = torch.randn(2, num_kv_heads, head_dim, device=device).to(dtype)
    new = torch.randn(2, num_heads, head_dim, device=device).to(dtype)  # queries
    slots = torch.tensor([0, 1], device=device)
    kernels = bind_kernels(device, head_dim, backend)
    cu_seqlens_q = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    for width in (3, 32):  # max blocks per sequence: one not divisible by 16, one that is
        tables = (torch.arange(2 * width, device=device) % num_blocks).to(torch.int32)
        tables = tables.view(2, width)
        seq_lens = torch.tensor([1, width * block_size], dtype=torch.int32, device=device)
        kernels.write_kv_cache(new_kv, new_kv, kc, vc, slots)
        kernels.decode(new, kc, vc, tables, seq_lens, 1.0)
        kernels.prefill(new, kc, vc, tables, cu_seqlens_q, seq_lens, 1.0, 1)
        triton_decode = kernels.backends["paged_decode_attention"] == "triton"
        if triton_decode and device.type == "cuda":  # split-KV is chosen per batch
            from cbatch.kernels import decode_attention

            decode_attention.paged_decode_attention(new, kc, vc, tables, seq_lens, 1.0,
                                                    partition_size=128)
    return dict(kernels.backends)
