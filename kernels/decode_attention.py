"""Paged decode attention in Triton: one query token per sequence, ragged contexts.

One program handles one (head, sequence, KV partition).  Grouped-query attention (a cache
of H_kv < H heads, query head h reading KV head ``h // (H // H_kv)``) runs the kernel of
:mod:`cbatch.kernels.grouped_decode_attention` instead, one program per KV head.  Each
sequence's context is cut into partitions of :data:`PARTITION_SIZE` tokens, a size fixed in tokens
(never derived from the batch), so a sequence's reduction order depends on its own length
only and its output is bitwise the same whatever it is batched with.  Each program writes
its partial output and log-sum-exp and ``_merge_kernel`` combines them in partition order;
programs past a sequence's real length exit at once, so short sequences cost nothing extra.
When no block table can hold more than one partition the merge is skipped: merging a single
partition is exact (its weight is exp(0) = 1), so that changes no bit either.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cbatch.kernels._utils import autotuning, configs, paged_offsets, upcast
from cbatch.kernels.grouped_decode_attention import block_g, grouped_decode_launch

TILE_N_SPACE = [32, 64, 128]
PARTITION_SIZE = 256  # tokens; a multiple of every TILE_N, so tiles never straddle partitions



@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, partial_out_ptr, partial_lse_ptr,
    scale, num_splits, partition,
    stride_q_t, stride_q_h,
    stride_c_block, stride_c_tok, stride_c_head,
    stride_bt, stride_o_t, stride_o_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    SPLIT: tl.constexpr, TILE_N: tl.constexpr,
):
    head = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * partition
    if start >= seq_len:
        return
    end = tl.minimum(start + partition, seq_len)

    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_q_t + head * stride_q_h + offs_d, mask=mask_d, other=0.0)
    q = q.to(tl.float32) * scale  # [BLOCK_D]

    m_i = tl.zeros([], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for tile in range(start, end, TILE_N):
        offs_n = tile + tl.arange(0, TILE_N)
        mask_n = offs_n < end
        row = (paged_offsets(table, offs_n, mask_n, PAGE_SIZE, stride_c_block, stride_c_tok)
               + head * stride_c_head)
        mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :], mask=mask, other=0.0)
        s = tl.sum(k.to(tl.float32) * q[None, :], axis=1)  # [TILE_N]
        s = tl.where(mask_n, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=mask, other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new

    if SPLIT:
        part = (seq * tl.num_programs(0) + head) * num_splits + split
        tl.store(partial_out_ptr + part * HEAD_DIM + offs_d, acc / l_i, mask=mask_d)
        tl.store(partial_lse_ptr + part, m_i + tl.log(l_i))
    else:
        o = out_ptr + seq * stride_o_t + head * stride_o_h + offs_d
        tl.store(o, (acc / l_i).to(out_ptr.dtype.element_ty), mask=mask_d)


# Opt-in (CBATCH_TRITON_AUTOTUNE=1): the same kernel, tuned per key.  SPLIT is not in the
# key: the split and unsplit variants must share TILE_N (the same summation order).
_paged_decode_autotuned = triton.autotune(
    configs=configs([{"TILE_N": n} for n in TILE_N_SPACE], [2, 4, 8]),
    key=["HEAD_DIM", "PAGE_SIZE"])(_paged_decode_kernel)


def decode_config(head_dim: int) -> dict:
    """The decode kernel's tile and warps for a shape class, chosen without tuning.

    Each iteration loads a [TILE_N, head_dim] tile of K and one of V and reduces it in fp32
    registers; about 4096 elements per tile (TILE_N 64 at D=64, 32 at D=128) keeps 64-80
    registers per thread at 4 warps without spills (benchmarks/NOTES.md, ptxas) and gives
    every thread 16-byte loads.  The rest of the shape class does not enter: not the dtype
    (the maths is fp32 after the load), not the page size (each token's block is looked up
    on its own, so tiles need not align with pages), not split-KV (partitions are >= 256
    tokens, several tiles each).  A prediction, not a measurement: benchmarks/NOTES.md.
    """
    tile_n = max(16, min(128, 4096 // triton.next_power_of_2(head_dim)))
    return {"TILE_N": tile_n, "num_warps": 4}


def decode_launch(head_dim: int):
    """The decode kernel to launch and its meta-parameters: the autotuner under
    CBATCH_TRITON_AUTOTUNE=1 (it picks them), else the plain kernel and
    :func:`decode_config`."""
    if autotuning():
        return _paged_decode_autotuned, {}
    return _paged_decode_kernel, decode_config(head_dim)


@triton.jit
def _merge_kernel(
    partial_out_ptr, partial_lse_ptr, seq_lens_ptr, out_ptr,
    num_splits, partition, stride_o_t, stride_o_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One partition at a time, in order: a tree reduction over a block of partitions would
    # pair them differently for different block widths, i.e. for different batches.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    used = tl.cdiv(seq_len, partition)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    base = (seq * tl.num_programs(1) + head) * num_splits
    max_lse = tl.load(partial_lse_ptr + base)
    for s in range(1, used):
        max_lse = tl.maximum(max_lse, tl.load(partial_lse_ptr + base + s))
    o = tl.zeros([BLOCK_D], dtype=tl.float32)
    sum_w = tl.zeros([], dtype=tl.float32)
    for s in range(0, used):
        w = tl.exp(tl.load(partial_lse_ptr + base + s) - max_lse)
        o += w * tl.load(partial_out_ptr + (base + s) * HEAD_DIM + offs_d, mask=mask_d, other=0.0)
        sum_w += w
    tl.store(out_ptr + seq * stride_o_t + head * stride_o_h + offs_d,
             (o / sum_w).to(out_ptr.dtype.element_ty), mask=mask_d)


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    partition_size: int | None = PARTITION_SIZE,
) -> torch.Tensor:
    """``query [S, H, D]`` over the paged cache ``[num_blocks, page, H_kv, D]`` →
    ``[S, H, D]``; see ``cbatch.ops``.

    ``partition_size``: tokens per KV partition (a multiple of 128; tests vary it), None for
    one pass over the whole context.
    """
    S, H, D = query.shape
    page = key_cache.shape[1]
    max_context = block_tables.shape[1] * page
    if partition_size is not None and partition_size % 128:
        raise ValueError(f"partition_size must be a multiple of 128, got {partition_size}")
    H_kv = key_cache.shape[2]
    out = torch.empty((S, H, D), dtype=query.dtype, device=query.device)
    if out.numel() == 0:  # no sequences, no heads or an empty head: no grid to launch
        return out
    split = partition_size is not None and max_context > partition_size
    partition = partition_size if split else max_context
    num_splits = triton.cdiv(max_context, partition)
    if split:
        partial_out = torch.empty((S, H, num_splits, D), dtype=torch.float32, device=query.device)
        partial_lse = torch.empty((S, H, num_splits), dtype=torch.float32, device=query.device)
    else:
        partial_out = partial_lse = out  # unused
    block_d = triton.next_power_of_2(D)
    strides = (query.stride(0), query.stride(1),
               key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
               block_tables.stride(0), out.stride(0), out.stride(1))
    if H_kv == H:
        kernel, meta = decode_launch(D)
        kernel[(H, S, num_splits)](
            query, key_cache, value_cache, block_tables, seq_lens,
            out, partial_out, partial_lse, scale, num_splits, partition, *strides,
            HEAD_DIM=D, BLOCK_D=block_d, PAGE_SIZE=page, SPLIT=split, **meta,
        )
    else:  # grouped-query attention: one program per KV head serves its query heads
        kernel, meta = grouped_decode_launch(D)
        kernel[(H_kv, S, num_splits)](
            query, key_cache, value_cache, block_tables, seq_lens,
            out, partial_out, partial_lse, scale, num_splits, partition, H // H_kv, *strides,
            HEAD_DIM=D, BLOCK_D=max(16, block_d), PAGE_SIZE=page, BLOCK_G=block_g(H // H_kv),
            UPCAST=upcast(query.dtype),
            PRECISION="ieee" if query.dtype == torch.float32 else "tf32", SPLIT=split, **meta,
        )
    if split:
        _merge_kernel[(S, H)](
            partial_out, partial_lse, seq_lens, out,
            num_splits, partition, out.stride(0), out.stride(1),
            HEAD_DIM=D, BLOCK_D=block_d,
        )
    return out
