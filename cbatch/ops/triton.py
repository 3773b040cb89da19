"""The Triton launchers of ``cbatch.kernels`` as ``torch.library.custom_op`` s (namespace
``cbatch_triton``), so torch.compile traces through them without graph breaks.

They are registered here, not in ``kernels/__init__.py``: a checkout's ``kernels/``
folder is also importable as a top-level ``kernels`` when the repository root is on sys.path,
and transformers imports a top-level ``kernels`` when it finds one; registering the ops from
there would register them twice and leave dangling schemas behind.
"""

from __future__ import annotations

import torch

from cbatch.kernels import cache, decode_attention, prefill_attention, sample as sample_kernel
from cbatch.ops.checks import check_no_meta_mix


@torch.library.custom_op("cbatch_triton::write_kv_cache",
                         mutates_args=("key_cache", "value_cache"))
def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    cache.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


@torch.library.custom_op("cbatch_triton::paged_decode_attention", mutates_args=())
def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    return decode_attention.paged_decode_attention(
        query, key_cache, value_cache, block_tables, seq_lens, scale)


@paged_decode_attention.register_fake
def _(query, key_cache, value_cache, block_tables, seq_lens, scale):
    check_no_meta_mix("cbatch_triton::paged_decode_attention", query=query, key_cache=key_cache,
                      value_cache=value_cache, block_tables=block_tables, seq_lens=seq_lens)
    return query.new_empty(query.shape)


@torch.library.custom_op("cbatch_triton::paged_prefill_attention", mutates_args=())
def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, block_tables: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                            scale: float, max_query_len: int = -1) -> torch.Tensor:
    """``max_query_len``: bound on the longest run (sizes the grid); -1 = unknown."""
    return prefill_attention.paged_prefill_attention(
        query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
        None if max_query_len < 0 else max_query_len)


@paged_prefill_attention.register_fake
def _(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
      max_query_len=-1):
    check_no_meta_mix("cbatch_triton::paged_prefill_attention", query=query, key_cache=key_cache,
                      value_cache=value_cache, block_tables=block_tables,
                      cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens)
    return query.new_empty(query.shape)


@torch.library.custom_op("cbatch_triton::sample", mutates_args=())
def sample(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor,
           top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
           uniform: torch.Tensor) -> torch.Tensor:
    return sample_kernel.sample(logits, rows, temperature, top_k, top_p, min_p, uniform)


@sample.register_fake
def _(logits, rows, temperature, top_k, top_p, min_p, uniform):
    check_no_meta_mix("cbatch_triton::sample", logits=logits, rows=rows, uniform=uniform)
    return rows.new_empty(rows.shape)
