"""Argument checks of the public ops: a wrong tensor gets a sentence naming the argument."""

from __future__ import annotations

import torch

def check_no_meta_mix(op: str, **tensors: torch.Tensor | None) -> None:
    """For an op's fake (meta) implementation: ValueError when meta tensors come with real
    ones.  The dispatcher sends such a call to the fake, which computes shapes only, so the
    op would return uninitialised memory or write nothing; all-meta calls (shape inference)
    and fake tensors under ``torch.compile`` (they report a real device) pass."""
    meta = [name for name, t in tensors.items() if t is not None and t.device.type == "meta"]
    real = {name: t.device for name, t in tensors.items()
            if t is not None and t.device.type != "meta"}
    if meta and real:
        name, device = next(iter(real.items()))
        raise ValueError(f"{op}: {', '.join(meta)} on the meta device but "
                         f"{name} on {device}: a meta tensor holds no data, so the op would "
                         "compute nothing; put every tensor on one device")


def check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.dim() != 4:
        raise ValueError(f"key_cache must be [num_blocks, block_size, H, D], got shape "
                         f"{tuple(key_cache.shape)}")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache shape {tuple(value_cache.shape)} must equal key_cache shape "
                         f"{tuple(key_cache.shape)}")
    if value_cache.dtype != key_cache.dtype:
        raise TypeError(f"value_cache dtype {value_cache.dtype} must equal key_cache dtype "
                        f"{key_cache.dtype}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache and value_cache must be contiguous")
    if value_cache.device != key_cache.device:
        raise ValueError("key_cache and value_cache must be on the same device")


def check_same_device(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the cache is on {device}")


def check_write_args(key, value, key_cache, value_cache, slot_mapping) -> None:
    check_cache(key_cache, value_cache)
    H, D = key_cache.shape[2:]
    if not (key.dim() == 3 and key.shape[1:] == (H, D)):
        raise ValueError(f"key must be [T, {H}, {D}] to match the cache, got {tuple(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} must equal key shape "
                         f"{tuple(key.shape)}")
    if not (key.dtype == value.dtype == key_cache.dtype):
        raise TypeError(f"key, value and the cache must share a dtype, got {key.dtype}, "
                        f"{value.dtype}, {key_cache.dtype}")
    if slot_mapping.dtype != torch.int64:
        raise TypeError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    if slot_mapping.shape != key.shape[:1]:
        raise ValueError(f"slot_mapping must be [T={key.shape[0]}], got "
                         f"{tuple(slot_mapping.shape)}")
    for name, t in (("key", key), ("value", value)):
        if not (t.stride(2) == 1 and t.stride(1) == D):
            raise ValueError(f"{name} must have dense [H, D] rows per token, got strides "
                             f"{t.stride()}")
    check_same_device(key_cache.device, key=key, value=value, slot_mapping=slot_mapping)


def check_attention_args(query, key_cache, value_cache, block_tables, seq_lens) -> None:
    check_cache(key_cache, value_cache)
    H_kv, D = key_cache.shape[2:]
    # grouped-query attention: each of the cache's H_kv heads serves H / H_kv query heads
    if not (query.dim() == 3 and query.shape[2] == D and H_kv > 0
            and query.shape[1] % H_kv == 0):
        raise ValueError(f"query must be [*, H, {D}] with H a multiple of {H_kv} to match the "
                         f"cache's heads and head_dim, got {tuple(query.shape)}")
    if query.dtype != key_cache.dtype:
        raise TypeError(f"query dtype {query.dtype} must equal the cache dtype {key_cache.dtype}")
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"query dtype must be float32, float16 or bfloat16, got {query.dtype}")
    if not (block_tables.dtype == seq_lens.dtype == torch.int32):
        raise TypeError(f"block_tables and seq_lens must be int32, got {block_tables.dtype} and "
                        f"{seq_lens.dtype}")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [S, max_blocks], got {tuple(block_tables.shape)}")
    S = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if S < 1:
        raise ValueError(f"seq_lens must be a non-empty [S] tensor, got {tuple(seq_lens.shape)}")
    if block_tables.shape[0] != S:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {S} sequences")
    if not (block_tables.is_contiguous() and seq_lens.is_contiguous()):
        raise ValueError("block_tables and seq_lens must be contiguous")
    check_same_device(key_cache.device, query=query, block_tables=block_tables,
                       seq_lens=seq_lens)


def check_seq_lens_fit(seq_lens: torch.Tensor, block_tables: torch.Tensor,
                       block_size: int, num_blocks: int | None = None) -> None:
    """Host-side check that every ``seq_len`` fits its block table (and block ids are in range).

    It reads ``seq_lens`` (and ``block_tables``) on the host, so the ops call it only when
    asked (``check_bounds=True``); the engine builds its batches to satisfy it.
    """
    capacity = block_tables.shape[1] * block_size
    lens = seq_lens.tolist()
    for s, n in enumerate(lens):
        if not (0 < n <= capacity):
            raise ValueError(f"seq_lens[{s}] = {n} is outside [1, {capacity}] (block_tables holds "
                             f"{block_tables.shape[1]} blocks of {block_size})")
    if num_blocks is not None:
        for s, n in enumerate(lens):
            used = block_tables[s, : -(-n // block_size)]
            bad = (used < 0) | (used >= num_blocks)
            if bool(bad.any()):
                raise ValueError(f"block_tables[{s}] holds block ids outside [0, {num_blocks}): "
                                 f"{used[bad].tolist()}")


def check_prefill_args(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                       check_bounds: bool = False, max_query_len: int | None = None) -> None:
    """The checks of ``paged_prefill_attention`` (those reading lengths on the host only with
    ``check_bounds``)."""
    check_attention_args(query, key_cache, value_cache, block_tables, seq_lens)
    if cu_seqlens_q.dtype != torch.int32:
        raise TypeError(f"cu_seqlens_q must be int32, got {cu_seqlens_q.dtype}")
    if cu_seqlens_q.shape != (seq_lens.shape[0] + 1,):
        raise ValueError(f"cu_seqlens_q must be [S + 1 = {seq_lens.shape[0] + 1}], got "
                         f"{tuple(cu_seqlens_q.shape)}")
    check_same_device(key_cache.device, cu_seqlens_q=cu_seqlens_q)
    if check_bounds:
        check_seq_lens_fit(seq_lens, block_tables, key_cache.shape[1], key_cache.shape[0])
        cu = cu_seqlens_q.tolist()
        if not (cu[0] == 0 and cu[-1] == query.shape[0]):
            raise ValueError(f"cu_seqlens_q must run from 0 to T = {query.shape[0]}, got {cu[0]} … "
                             f"{cu[-1]}")
        for s, n in enumerate(seq_lens.tolist()):
            if not (0 <= cu[s + 1] - cu[s] <= n):
                raise ValueError(f"sequence {s} has {cu[s + 1] - cu[s]} new tokens but "
                                 f"seq_lens[{s}] = {n}")
            if max_query_len is not None and cu[s + 1] - cu[s] > max_query_len:
                raise ValueError(f"sequence {s} has {cu[s + 1] - cu[s]} new tokens > max_query_len "
                                 f"{max_query_len}")
