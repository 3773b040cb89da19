"""The Triton launchers of ``cbatch.kernels`` as ``torch.library.custom_op`` s (namespace
``cbatch_triton``), so torch.compile traces through them without graph breaks.

They are registered here, not in ``kernels/__init__.py``: a checkout's ``kernels/``
folder is also importable as a top-level ``kernels`` when the repository root is on sys.path,
and transformers imports a top-level ``kernels`` when it finds one; registering the ops from
there would register them twice and leave dangling schemas behind.
"""

from __future__ import annotations

import torch

from cbatch.kernels import (cache, decode_attention, prefill_attention, quant_matmul,
                            sample as sample_kernel)
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


@torch.library.custom_op("cbatch_triton::quantized_linear", mutates_args=())
def quantized_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     zeros: torch.Tensor | None, bits: int, group_size: int, out_features: int,
                     bias: torch.Tensor | None, mins: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """W8A16 / W4A16 (``kernels/quant_matmul.py``): ``cbatch::quantized_linear``'s contract,
    mins included, x fp16, bf16 or fp32."""
    return quant_matmul.wna16_linear(x, qweight, scales, zeros, bits, group_size, out_features,
                                     bias, mins)


@quantized_linear.register_fake
def _(x, qweight, scales, zeros, bits, group_size, out_features, bias, mins=None):
    check_no_meta_mix("cbatch_triton::quantized_linear", x=x, qweight=qweight, scales=scales,
                      zeros=zeros, bias=bias, mins=mins)
    return x.new_empty((x.shape[0], out_features))


@torch.library.custom_op("cbatch_triton::scaled_int8_quant", mutates_args=())
def scaled_int8_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token int8 quantization: ``(x_q int8 [M, K], scale fp32 [M, 1])``, the
    values of ``cbatch.ops.reference.quantize_per_token``."""
    return quant_matmul.scaled_int8_quant(x)


@scaled_int8_quant.register_fake
def _(x):
    check_no_meta_mix("cbatch_triton::scaled_int8_quant", x=x)
    return (x.new_empty(x.shape, dtype=torch.int8),
            x.new_empty((x.shape[0], 1), dtype=torch.float32))


@torch.library.custom_op("cbatch_triton::w8a8_linear", mutates_args=())
def w8a8_linear(x_q: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor,
                scales: torch.Tensor, out_features: int, bias: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
    """W8A8 on ``pack_w8a8``'s layout: int8 x int8 with int32 sums, scaled by the weight's
    and ``x_scale`` (``kernels/quant_matmul.py``)."""
    return quant_matmul.w8a8_linear(x_q, x_scale, qweight, scales, out_features, bias,
                                    out_dtype)


@w8a8_linear.register_fake
def _(x_q, x_scale, qweight, scales, out_features, bias, out_dtype):
    check_no_meta_mix("cbatch_triton::w8a8_linear", x_q=x_q, x_scale=x_scale, qweight=qweight,
                      scales=scales, bias=bias)
    return x_q.new_empty((x_q.shape[0], out_features), dtype=out_dtype)
