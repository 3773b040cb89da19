"""write_kv_cache in Triton: one program copies one token's K and V rows into its slot."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_k_t, stride_v_t,
    ROW: tl.constexpr, BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(key_ptr + token * stride_k_t + offs, mask=mask)
    v = tl.load(value_ptr + token * stride_v_t + offs, mask=mask)
    tl.store(key_cache_ptr + slot * ROW + offs, k, mask=mask)
    tl.store(value_cache_ptr + slot * ROW + offs, v, mask=mask)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``key, value [T, H, D]`` into ``*_cache [num_blocks, block_size, H, D]``; see cbatch.ops."""
    T, H, D = key.shape
    if key.numel() == 0:  # no tokens, no heads or an empty head: nothing to copy
        return
    _write_kv_cache_kernel[(T,)](
        key, value, key_cache, value_cache, slot_mapping, key.stride(0), value.stride(0),
        ROW=H * D, BLOCK=triton.next_power_of_2(H * D),
    )
