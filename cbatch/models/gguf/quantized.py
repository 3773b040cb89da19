"""GGUF's quantized linear weights as cbatch's quantized layers, exactly.

Each block type maps onto cbatch's one quantized representation
(:mod:`cbatch.layers.quantization.weight`) without rounding anything, so that the weight a
layer runs is bitwise what ``gguf.quants.dequantize`` gives:

======  ==============================  =====================================
type    levels as cbatch stores them     form
======  ==============================  =====================================
Q4_0    int4 0..15, zero point 8         bits 4, groups of 32
Q8_0    int8                             bits 8, groups of 32
Q5_0    int8 q - 16                      bits 8, groups of 32
Q6_K    int8 q - 32                      bits 8, groups of 16 (its sub-blocks)
Q4_1    int4 0..15, mins                 bits 4, groups of 32, W = s q - m
Q4_K    int4 0..15, mins                 bits 4, groups of 32 (its sub-blocks)
Q5_1    int8 0..31, mins                 bits 8, groups of 32
Q5_K    int8 0..31, mins                 bits 8, groups of 32 (its sub-blocks)
======  ==============================  =====================================

A K-quant's two levels of scales are multiplied out into one fp32 scale (and min) per
sub-block at load (:mod:`cbatch.models.gguf.blocks`): the products are exact in fp32, so
``fl(s q) - m`` is gguf's own rounding.  The 5-bit and 6-bit types take a byte per weight,
more than the file's 5.5 or 6.6 bits.

The layers are the decoder's linears and an untied ``output`` (the lm_head) of the Llama
family; the embeddings, the norms, float tensors and every tensor of a GPT-2 file load as
float (:mod:`cbatch.models.gguf.loader`).
"""

from __future__ import annotations

import torch

from cbatch.models.gguf.blocks import BLOCK_TYPES, UnpackedBlocks, unpack
from cbatch.models.gguf.names import unpermute
from cbatch.models.gguf.reader import GGUFFile
from cbatch.models.quantized_checkpoint.layer import Layer

# GGUF layer parts that are linear weights cbatch runs quantized (besides the lm_head), each
# with the parts that cbatch fuses it with
LINEAR_PARTS = {"attn_q": ("attn_q", "attn_k", "attn_v"), "attn_output": ("attn_output",),
                "ffn_gate": ("ffn_gate", "ffn_up"), "ffn_down": ("ffn_down",)}
LINEAR_PARTS.update({p: fused for fused in tuple(LINEAR_PARTS.values()) for p in fused})


def is_quantized_linear(f: GGUFFile, name: str) -> bool:
    """Whether tensor ``name`` of ``f`` loads as a quantized layer (see the module
    docstring): a block type, and so are the shards cbatch fuses it with (a projection with a
    float shard loads as float)."""
    parts = name.split(".")
    if f.architecture == "gpt2" or parts[-1] != "weight":
        return False
    if parts[:-1] == ["output"]:
        return f.qtype(name) in BLOCK_TYPES
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in LINEAR_PARTS:
        return False
    shards = [f"blk.{parts[1]}.{p}.weight" for p in LINEAR_PARTS[parts[2]]]
    return all(s in f.tensor_names and f.qtype(s) in BLOCK_TYPES for s in shards)


def as_layer(blocks: UnpackedBlocks) -> Layer:
    """``blocks`` in cbatch's form (the module docstring's table), the same weight bitwise."""
    N, K = blocks.q.shape
    gs = blocks.group_size
    if blocks.mins is not None:
        q = blocks.q if blocks.bits == 4 else blocks.q.to(torch.int8)  # 5-bit: 0..31 as int8
        return Layer(q, blocks.scales, None, 4 if blocks.bits == 4 else 8, gs,
                     mins=blocks.mins)
    zero = int(blocks.zeros.flatten()[0])
    constant = bool((blocks.zeros == zero).all())  # every GGUF type's: 8, 16, 32 or 0
    if blocks.bits == 4 and constant and zero == 8:
        return Layer(blocks.q, blocks.scales, None, 4, gs)
    if constant and (blocks.bits < 8 or blocks.q.dtype == torch.int8):
        # levels below 128 (or int8) less one zero point: one pass in int8
        q = blocks.q.view(torch.int8)
        return Layer(q - zero if zero else q, blocks.scales, None, 8, gs)
    zeros = blocks.zeros.t().to(torch.int16)[:, :, None]  # [N, G, 1]
    q = (blocks.q.to(torch.int16).view(N, K // gs, gs) - zeros).view(N, K).to(torch.int8)
    return Layer(q, blocks.scales, None, 8, gs)


def read_layer(f: GGUFFile, name: str, num_heads: int, num_kv_heads: int) -> Layer:
    """GGUF tensor ``name`` as a :class:`Layer` in Hugging Face's row order (llama's q/k rows
    unpermuted, as :func:`cbatch.models.gguf.names.to_hf` does for float tensors)."""
    layer = as_layer(unpack(f.raw(name), f.qtype(name), f.shape(name)))
    part = name.split(".")[-2]
    if f.architecture != "llama" or part not in ("attn_q", "attn_k"):
        return layer
    heads = num_heads if part == "attn_q" else num_kv_heads

    def rows(t: torch.Tensor) -> torch.Tensor:  # [N, ...] -> the same rows, unpermuted
        return unpermute(t, heads).contiguous()

    def columns(t: torch.Tensor | None) -> torch.Tensor | None:  # [G, N]
        return None if t is None else rows(t.t()).t().contiguous()

    return Layer(rows(layer.q), columns(layer.scales), columns(layer.zeros), layer.bits,
                 layer.group_size, mins=columns(layer.mins))
