"""Paged decode attention in Triton for grouped-query attention: one program serves every
query head of one KV head.

One program handles one (KV head, sequence, KV partition): it loads each [TILE_N, D] tile of
its KV head's keys and values once, for all ``kv_group`` query heads that read them, stacked
as the rows of a ``tl.dot`` (padded to at least 16 rows, the smallest dot).  So a step reads
the cache's bytes once, not once per query head: KV bandwidth shrinks by the group size, as
its memory does.  Partitions, the merge kernel and the batch-invariance argument are
:mod:`cbatch.kernels.decode_attention`'s (a sequence's summation order depends on its own
length only).
"""

from __future__ import annotations

import triton
import triton.language as tl

from cbatch.kernels._utils import autotuning, configs, paged_offsets


@triton.jit
def _paged_decode_grouped_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, partial_out_ptr, partial_lse_ptr,
    scale, num_splits, partition, kv_group,
    stride_q_t, stride_q_h,
    stride_c_block, stride_c_tok, stride_c_head,
    stride_bt, stride_o_t, stride_o_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    SPLIT: tl.constexpr, TILE_N: tl.constexpr,
):
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * partition
    if start >= seq_len:
        return
    end = tl.minimum(start + partition, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    mask_g = offs_g < kv_group
    heads = kv_head * kv_group + offs_g  # the query heads of this KV head (rows past the
    offs_d = tl.arange(0, BLOCK_D)       # group are zeros: finite scores, never stored)
    mask_d = offs_d < HEAD_DIM
    mask_q = mask_g[:, None] & mask_d[None, :]
    q = tl.load(q_ptr + seq * stride_q_t + heads[:, None] * stride_q_h + offs_d[None, :],
                mask=mask_q, other=0.0)  # [BLOCK_G, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.zeros([BLOCK_G], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for tile in range(start, end, TILE_N):
        offs_n = tile + tl.arange(0, TILE_N)
        mask_n = offs_n < end
        row = (paged_offsets(table, offs_n, mask_n, PAGE_SIZE, stride_c_block, stride_c_tok)
               + kv_head * stride_c_head)
        mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :], mask=mask, other=0.0)
        v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_G, TILE_N]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    o = acc / l_i[:, None]
    if SPLIT:
        part = (seq * (tl.num_programs(0) * kv_group) + heads) * num_splits + split  # [BLOCK_G]
        tl.store(partial_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=mask_q)
        tl.store(partial_lse_ptr + part, m_i + tl.log(l_i), mask=mask_g)
    else:
        rows = out_ptr + seq * stride_o_t + heads[:, None] * stride_o_h + offs_d[None, :]
        tl.store(rows, o.to(out_ptr.dtype.element_ty), mask=mask_q)


# Opt-in (CBATCH_TRITON_AUTOTUNE=1), as for the ungrouped kernel: SPLIT is not in the key.
_paged_decode_grouped_autotuned = triton.autotune(
    configs=configs([{"TILE_N": n} for n in (32, 64, 128)], [4, 8]),
    key=["HEAD_DIM", "PAGE_SIZE", "BLOCK_G", "UPCAST"])(_paged_decode_grouped_kernel)


def grouped_decode_config(head_dim: int) -> dict:
    """The grouped kernel's tile and warps without tuning: TILE_N keys per iteration as the
    ungrouped kernel takes (about 4096 elements of K per tile; the dots keep the products in
    the tensor-core accumulators, not in per-thread registers).  A prediction, not a
    measurement."""
    return {"TILE_N": max(16, min(128, 4096 // triton.next_power_of_2(head_dim))),
            "num_warps": 4}


def grouped_decode_launch(head_dim: int):
    """The grouped kernel to launch and its meta-parameters (see ``decode_launch``)."""
    if autotuning():
        return _paged_decode_grouped_autotuned, {}
    return _paged_decode_grouped_kernel, grouped_decode_config(head_dim)


def block_g(kv_group: int) -> int:
    """Rows of the dots: the group padded to a power of two, at least 16 (``tl.dot``'s
    smallest M)."""
    return max(16, triton.next_power_of_2(kv_group))
