"""What the block decoders share: a type's sizes, and the fields of its bytes read as torch
tensors (fp16 scalars, nibbles, bit planes), each for all blocks at once."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

# blocks uint8 [B, type_size] -> (levels [B, block_size] uint8 or int8, scales fp32 [B, S],
# zeros int8 [B, S] or mins fp32 [B, S]), S = block_size / group_size
Unpacker = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class BlockFormat(NamedTuple):
    """A quantized type: ``block_size`` elements in ``type_size`` bytes, a scale for every
    ``group_size`` of them, levels of ``bits`` bits, and the function that unpacks it."""

    block_size: int
    type_size: int
    group_size: int
    bits: int
    unpack: Unpacker


def fp16(field: torch.Tensor) -> torch.Tensor:
    """fp32 ``[B, 1]`` from an fp16 field ``[B, 2]`` (uint8, little-endian) of each block."""
    return field.contiguous().view(torch.float16).float()


def nibbles(qs: torch.Tensor, chunk: int) -> torch.Tensor:
    """uint8 ``[B, 2 * n]`` from ``qs [B, n]``: in each run of ``chunk`` bytes, their low
    nibbles, then their high nibbles (the order all of GGUF's 4-bit fields use)."""
    B, n = qs.shape
    shifts = torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
    return ((qs.view(B, n // chunk, 1, chunk) >> shifts) & 0x0F).reshape(B, 2 * n)


def bit_planes(qh: torch.Tensor, chunk: int, bits: int = 1) -> torch.Tensor:
    """uint8 ``[B, n * 8 / bits]`` from ``qh [B, n]``: in each run of ``chunk`` bytes, the
    lowest ``bits`` of each byte, then the next ``bits``, up to the top of the byte."""
    B, n = qh.shape
    planes = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8).view(1, 1, planes, 1)
    mask = (1 << bits) - 1
    return ((qh.view(B, n // chunk, 1, chunk) >> shifts) & mask).reshape(B, n * planes)


def constant(B: int, S: int, value: int) -> torch.Tensor:
    """int8 ``[B, S]`` filled with ``value``: a type's fixed zero point."""
    return torch.full((B, S), value, dtype=torch.int8)
