"""cbatch's attention and cache ops, behind one function each with backend selection (the
sampler's kernels are :mod:`cbatch.ops.sampling`'s, the CPU-only ops :mod:`cbatch.ops.cpu`'s).

Backends:

- ``"cuda"``   C++/CUDA kernels compiled into ``cbatch._C`` (CUDA tensors)
- ``"triton"`` Triton kernels in ``cbatch.kernels`` (CUDA tensors; CPU under TRITON_INTERPRET=1)
- ``"cpu"``    C++ kernels compiled into ``cbatch._C`` (CPU tensors)
- ``"torch"``  the pure-torch reference in ``cbatch.ops.reference`` (any device; slow)

``backend=None`` picks the fastest one available for the tensors' device; the environment
variable ``CBATCH_ATTENTION_BACKEND`` overrides that choice.
"""

from __future__ import annotations

import math

import torch

from cbatch.ops import cpu  # noqa: F401  (the CPU-only ops and their fakes)
from cbatch.ops import sampling  # noqa: F401  (the sampler's kernels and their fakes)
from cbatch.ops.backends import (BACKENDS, BackendStatus, BoundKernels, available_backends,
                                 bind_kernels, impl_of, resolve_backend)
from cbatch.ops.checks import (check_attention_args, check_prefill_args, check_seq_lens_fit,
                               check_write_args)
from cbatch.ops.warmup import warmup

__all__ = ["BACKENDS", "BackendStatus", "BoundKernels", "available_backends", "bind_kernels",
           "check_seq_lens_fit", "paged_decode_attention", "paged_prefill_attention",
           "resolve_backend", "warmup", "write_kv_cache"]


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str | None = None,
) -> None:
    """Scatter each new token's key and value into its slot of the paged cache, in place.

    Parameters
    ----------
    key, value : Tensor, ``[T, H, D]``, the cache's dtype
        New keys/values.  Each token's ``[H, D]`` row must be dense; the token stride is
        free, so views of a fused qkv projection are accepted without a copy.
    key_cache, value_cache : Tensor, ``[num_blocks, block_size, H, D]``, contiguous
        The layer's paged cache (modified in place).
    slot_mapping : Tensor, int64 ``[T]``
        ``block_id * block_size + offset`` for each token; ``-1`` writes nothing
        (padding slots of a CUDA graph, tokens whose K/V are already cached).
    backend : {None, "cuda", "triton", "cpu", "torch"}
        None picks the fastest available one (see :func:`available_backends`).

    Backends: all four, for float32, float16 and bfloat16 and any H, D.
    """
    check_write_args(key, value, key_cache, value_cache, slot_mapping)
    impl_of("write_kv_cache", resolve_backend("write_kv_cache", key_cache.device, backend))(
        key, value, key_cache, value_cache, slot_mapping)



def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    backend: str | None = None,
    check_bounds: bool = False,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged KV cache.

    Parameters
    ----------
    query : Tensor, ``[S, H, D]``, float32/float16/bfloat16
        The query of each sequence's newest token (its K/V already written to the cache).
    key_cache, value_cache : Tensor, ``[num_blocks, block_size, H_kv, D]``, query's dtype
        H is a multiple of H_kv: query head h reads KV head ``h // (H // H_kv)``.
    block_tables : Tensor, int32 ``[S, max_blocks]``
        Physical block ids; only the first ``ceil(seq_lens[s] / block_size)`` are read.
    seq_lens : Tensor, int32 ``[S]``
        Context length of each sequence, the new token included: it attends to
        positions ``[0, seq_lens[s])``.
    scale : float, optional
        Softmax scale; default ``1 / sqrt(D)``.
    out : Tensor, ``[S, H, D]``, optional
        Written in place and returned when given.
    backend : {None, "cuda", "triton", "cpu", "torch"}
        "cuda": head_dim 64 and 128 (None falls back to "triton" for others), split-KV
        in partitions of 256 tokens, no host sync (CUDA-graph safe).  "triton": any
        head_dim, split-KV likewise.  "cpu": any head_dim, checks lengths and block ids
        itself.  "torch": the reference, a Python loop over sequences.  The "cuda",
        "triton" and "cpu" kernels sum each (sequence, head) in an order fixed by that
        sequence's length alone: its output is bitwise the same whatever the batch.
    check_bounds : bool
        Also check on the host that every sequence fits its block table and that block
        ids are in range (a device sync; off on the hot path).

    Returns
    -------
    Tensor, ``[S, H, D]`` in query's dtype (accumulation in float32).
    """
    check_attention_args(query, key_cache, value_cache, block_tables, seq_lens)
    if query.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"query has {query.shape[0]} tokens for {seq_lens.shape[0]} sequences; "
                         f"decode takes exactly one token per sequence")
    if check_bounds:
        check_seq_lens_fit(seq_lens, block_tables, key_cache.shape[1], key_cache.shape[0])
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    impl = impl_of("paged_decode_attention",
                   resolve_backend("paged_decode_attention", query.device, backend,
                                   query.shape[-1]))
    result = impl(query, key_cache, value_cache, block_tables, seq_lens, scale)
    if out is None:
        return result
    out.copy_(result)
    return out


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    backend: str | None = None,
    check_bounds: bool = False,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's chunk of new tokens over its paged KV cache.

    Sequence s owns query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``: its ``n_s`` newest
    tokens, at positions ``seq_lens[s] - n_s … seq_lens[s] - 1``.  The token at position p
    attends to positions ``[0, p]`` — the cached context plus the causal part of the chunk
    (chunked prefill).  A one-token chunk is a decode step, so any mix works.

    Parameters
    ----------
    query : Tensor, ``[T, H, D]``, float32/float16/bfloat16
    key_cache, value_cache : Tensor, ``[num_blocks, block_size, H_kv, D]``, query's dtype
        Must already hold the K/V of every new token.
    block_tables : Tensor, int32 ``[S, max_blocks]``
    cu_seqlens_q : Tensor, int32 ``[S + 1]``
        Offsets of each sequence's run of tokens in ``query``; ``cu_seqlens_q[-1] == T``.
    seq_lens : Tensor, int32 ``[S]``
        Each sequence's length after this step (cached + new), ``>= n_s``.
    scale, out, backend, check_bounds :
        As in :func:`paged_decode_attention`.
    max_query_len : int, optional
        An upper bound on the longest run ``n_s``, known on the host (the engine knows it).
        It sizes the Triton kernel's grid; without it the grid allows T rows per sequence
        and the surplus programs exit at once.  Other backends do not need it.

    Backends: "triton" (CUDA; any head_dim), "cpu", "torch"; there is no CUDA C++ prefill
    kernel yet, so None picks "triton" for CUDA tensors.

    Returns
    -------
    Tensor, ``[T, H, D]`` in query's dtype.
    """
    check_prefill_args(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                       check_bounds, max_query_len)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    name = resolve_backend("paged_prefill_attention", query.device, backend, query.shape[-1])
    args = (query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale)
    if name == "triton":  # the one backend whose grid depends on the longest run
        args += (-1 if max_query_len is None else int(max_query_len),)
    result = impl_of("paged_prefill_attention", name)(*args)
    if out is None:
        return result
    out.copy_(result)
    return out
