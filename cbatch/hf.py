"""Hugging Face transformers integration: ``attn_implementation="cbatch"``.

>>> import cbatch.hf
>>> cbatch.hf.register()
>>> # AutoModelForCausalLM.from_pretrained(path, attn_implementation="cbatch")

Any model that calls attention through transformers' ``AttentionInterface`` (GPT-2, Llama,
…) then runs cbatch's paged kernels.  The mask function registered beside it hands the
attention the plain 2-D padding mask; the attention packs each row's real keys into a paged
cache and each row's real queries into one ragged batch, so padded positions cost nothing
in the kernel.  Grouped-query attention (fewer KV heads) runs natively: the paged cache
holds the KV heads only and the kernels map each query head to its KV head.
Transformers keeps its own dense KV cache here: the paged cache is rebuilt per call.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from cbatch import ops

NAME = "cbatch"
BLOCK_SIZE = 16
_backend: str | None = None


def register(name: str = NAME, backend: str | None = None) -> None:
    """Register cbatch with transformers' AttentionInterface and AttentionMaskInterface.

    ``backend`` pins a cbatch backend ("cuda", "triton", "cpu", "torch"); None picks the
    fastest for the tensors' device.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    global _backend
    _backend = backend
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)


def padding_mask(batch_size: int, q_length: int | None = None, kv_length: int | None = None,
                 attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """The 2-D padding mask ``[B, kv_length]`` (True = real token), or None without padding."""
    if attention_mask is None:
        return None
    if kv_length is not None:
        attention_mask = attention_mask[:, -kv_length:]
    return attention_mask.bool()


@dataclass
class _Layout:
    """Where each row's real keys and queries go; shared by all layers of one forward."""

    slot_mapping: torch.Tensor  # int64 [B * Lk]: cache slot of each key, -1 for padding
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    seq_lens: torch.Tensor  # int32 [B]: real keys per row
    cu_seqlens_q: torch.Tensor  # int32 [B + 1]: real queries per row, packed
    query_valid: torch.Tensor | None  # bool [B, L]; None = every query is real
    num_blocks: int
    is_decode: bool


_cache: tuple[weakref.ref | None, tuple, _Layout] | None = None


def _layout(mask: torch.Tensor | None, B: int, L: int, Lk: int, device) -> _Layout:
    global _cache
    key = (B, L, Lk, str(device))
    if _cache is not None and _cache[1] == key and (
            (mask is None and _cache[0] is None)
            or (mask is not None and _cache[0] is not None and _cache[0]() is mask)):
        return _cache[2]
    if mask is None:
        valid = torch.ones(B, Lk, dtype=torch.bool, device=device)
    else:
        if mask.shape != (B, Lk):
            raise ValueError(f"cbatch attention expects a [batch, kv_length] = {(B, Lk)} "
                             f"padding mask, got {tuple(mask.shape)}")
        valid = mask.to(device=device, dtype=torch.bool)
    lens = valid.sum(1).clamp(min=1)  # a row of pure padding still gets one block
    blocks = (lens + BLOCK_SIZE - 1) // BLOCK_SIZE
    starts = blocks.cumsum(0) - blocks
    blocks_host = blocks.tolist()  # the one host sync of this forward pass
    max_blocks = max(blocks_host)
    tables = starts[:, None] + torch.arange(max_blocks, device=device)[None, :]
    rank = valid.long().cumsum(1) - 1
    slots = torch.where(valid, starts[:, None] * BLOCK_SIZE + rank, -1)
    query_valid = valid[:, Lk - L:]
    num_new = query_valid.sum(1)
    cu = torch.zeros(B + 1, dtype=torch.int32, device=device)
    cu[1:] = num_new.cumsum(0)
    all_real = mask is None or bool(valid.all())
    layout = _Layout(
        slot_mapping=slots.reshape(-1), block_tables=tables.to(torch.int32).contiguous(),
        seq_lens=lens.to(torch.int32), cu_seqlens_q=cu,
        query_valid=None if all_real else query_valid, num_blocks=sum(blocks_host),
        is_decode=L == 1 and all_real,
    )
    _cache = (None if mask is None else weakref.ref(mask), key, layout)
    return layout


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """``[B, L, H, D]`` → ``[B * L, H, D]`` with each token's ``[H, D]`` dense, as the ops want:
    a view when the layout allows (the fused qkv projection's), else a copy (for B = 1 a
    plain reshape of a transposed ``[1, H, L, D]`` is a view whose rows are not dense)."""
    tokens = x.reshape(-1, *x.shape[2:])
    if tokens.stride(2) == 1 and tokens.stride(1) == x.shape[3]:
        return tokens
    return tokens.contiguous()


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      scaling: float | None = None, dropout: float = 0.0, **kwargs
                      ) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``query [B, H, L, D]``, ``key/value [B, Hkv, Lk, D]``
    → ``([B, L, H, D], None)``; causal, with ``attention_mask`` from :func:`padding_mask`."""
    if dropout and module.training:
        raise NotImplementedError("cbatch attention is for inference: dropout is not supported")
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        raise NotImplementedError("cbatch attention is causal only")
    if kwargs.get("sliding_window"):
        raise NotImplementedError("cbatch attention has no sliding window")
    B, H, L, D = query.shape
    Hkv, Lk = key.shape[1], key.shape[2]
    if H % Hkv:
        raise ValueError(f"{H} query heads cannot share {Hkv} KV heads")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError("cbatch attention needs the 2-D padding mask of its mask function; "
                         "load the model with attn_implementation='cbatch' after "
                         "cbatch.hf.register()")
    scale = D ** -0.5 if scaling is None else scaling
    lay = _layout(attention_mask, B, L, Lk, query.device)
    # The paged cache of this call: each row's real keys, block-aligned.
    k_tok = _tokens(key.transpose(1, 2))
    v_tok = _tokens(value.transpose(1, 2))
    key_cache = key.new_empty(lay.num_blocks, BLOCK_SIZE, Hkv, D)  # each serves H // Hkv
    value_cache = value.new_empty(lay.num_blocks, BLOCK_SIZE, Hkv, D)
    ops.write_kv_cache(k_tok, v_tok, key_cache, value_cache, lay.slot_mapping, backend=_backend)
    q = query.transpose(1, 2)  # [B, L, H, D]
    q_packed = _tokens(q) if lay.query_valid is None else q[lay.query_valid]
    if lay.is_decode:
        o = ops.paged_decode_attention(q_packed, key_cache, value_cache, lay.block_tables,
                                       lay.seq_lens, scale, backend=_backend)
    else:
        o = ops.paged_prefill_attention(q_packed, key_cache, value_cache, lay.block_tables,
                                        lay.cu_seqlens_q, lay.seq_lens, scale,
                                        backend=_backend, max_query_len=L)
    if lay.query_valid is None:
        return o.view(B, L, H, D), None
    out = query.new_zeros(B, L, H, D)
    out[lay.query_valid] = o
    return out, None
