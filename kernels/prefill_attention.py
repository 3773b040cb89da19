"""Paged prefill attention in Triton: chunks of new tokens, causal over cache + chunk.

One program handles BLOCK_M query rows of one (sequence, query head).  It walks the
sequence's paged keys in tiles of BLOCK_N tokens up to its last row's position, with an
online softmax in fp32; the causal mask only bites in the tiles that overlap the chunk.
Grouped-query attention: the cache holds H_kv heads and query head h reads KV head
``h // (H // H_kv)`` in place (no copy of KV heads), as FlashAttention does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cbatch.kernels._utils import autotuning, configs, paged_offsets, upcast



@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_ptr, seq_lens_ptr, out_ptr,
    scale, kv_group,
    stride_q_t, stride_q_h,
    stride_c_block, stride_c_tok, stride_c_head,
    stride_bt, stride_o_t, stride_o_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    m_tile = tl.program_id(2)
    q_start = tl.load(cu_seqlens_ptr + seq)
    num_new = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    if m_tile * BLOCK_M >= num_new:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    num_cached = seq_len - num_new

    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < num_new
    pos_m = num_cached + offs_m  # absolute position of each query row
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q_rows = q_ptr + (q_start + offs_m)[:, None] * stride_q_t + head * stride_q_h
    q = tl.load(q_rows + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq * stride_bt
    kv_head = head // kv_group  # kv_group query heads share each KV head
    kv_end = tl.minimum(seq_len, num_cached + (m_tile + 1) * BLOCK_M)
    for start_n in range(0, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        row = (paged_offsets(table, offs_n, mask_n, PAGE_SIZE, stride_c_block, stride_c_tok)
               + kv_head * stride_c_head)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_M, BLOCK_N]
        causal = (offs_n[None, :] <= pos_m[:, None]) & mask_n[None, :]
        s = tl.where(causal, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    o = acc / l_i[:, None]
    o_rows = out_ptr + (q_start + offs_m)[:, None] * stride_o_t + head * stride_o_h
    tl.store(o_rows + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_d[None, :])


# Opt-in (CBATCH_TRITON_AUTOTUNE=1): the same kernel, tuned per key.
_paged_prefill_autotuned = triton.autotune(
    configs=configs([{"BLOCK_M": m, "BLOCK_N": n} for m in (16, 32, 64) for n in (32, 64)],
                    [4, 8]),
    key=["HEAD_DIM", "PAGE_SIZE", "UPCAST"])(_paged_prefill_kernel)


def prefill_config(dtype: torch.dtype, head_dim: int) -> dict:
    """The prefill kernel's tiles and warps for a shape class, chosen without tuning.

    BLOCK_M 64 query rows x BLOCK_N 64 keys (the Triton flash-attention tutorial's tiles,
    rows halved because chunks are often short); fp32 inputs (ieee dots, twice the bytes
    per operand) take BLOCK_N 32.  head_dim >= 128 takes 8 warps: at 4 warps ptxas gives
    196 registers per thread against 140 at 8 (benchmarks/NOTES.md).  The page size does
    not enter (tokens are looked up one by one).  A prediction, not a measurement: see
    benchmarks/NOTES.md.
    """
    block_n = 32 if dtype == torch.float32 else 64
    return {"BLOCK_M": 64, "BLOCK_N": block_n, "num_warps": 8 if head_dim >= 128 else 4}


def prefill_launch(dtype: torch.dtype, head_dim: int):
    """The prefill kernel to launch and its meta-parameters (see ``decode_launch``)."""
    if autotuning():
        return _paged_prefill_autotuned, {}
    return _paged_prefill_kernel, prefill_config(dtype, head_dim)


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """``query [T, H, D]`` (runs given by ``cu_seqlens_q``) over the paged cache
    ``[num_blocks, page, H_kv, D]`` → ``[T, H, D]``; see ``cbatch.ops``.

    ``max_query_len`` (the longest run, when the caller knows it) sizes the grid; without it
    the grid covers T rows per sequence and the surplus programs exit at once (no sync).
    """
    T, H, D = query.shape
    S = seq_lens.shape[0]
    out = torch.empty((T, H, D), dtype=query.dtype, device=query.device)
    if out.numel() == 0:  # no new tokens, no heads or an empty head: no grid to launch
        return out
    rows = T if max_query_len is None else max_query_len
    grid = lambda meta: (S, H, triton.cdiv(rows, meta["BLOCK_M"]))  # noqa: E731
    kernel, meta = prefill_launch(query.dtype, D)
    kernel[grid](
        query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, out,
        scale, H // key_cache.shape[2],
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)), PAGE_SIZE=key_cache.shape[1],
        UPCAST=upcast(query.dtype), PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        **meta,
    )
    return out
