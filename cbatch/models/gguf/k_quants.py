"""The K-quants: super-blocks of 256 elements with two levels of scales.  A super-block has an
fp16 scale ``d`` (and for Q4_K/Q5_K an fp16 ``dmin``) and a small integer scale (and min) per
sub-block; the unpacked form multiplies them out, one fp32 scale per sub-block, in the order
gguf-py's ``dequantize`` does, so that the floats come out bitwise the same.  Byte layouts,
fields in order (fp16 little-endian):

- **Q4_K** (144 bytes): ``d``, ``dmin``, 12 bytes of eight 6-bit scales ``sc`` and eight 6-bit
  mins ``m`` (one each per sub-block of 32), 128 bytes of nibbles.  The 12 bytes: bytes 0-3
  hold ``sc[0..3]`` in their low 6 bits, bytes 4-7 ``m[0..3]``; bytes 8-11 hold the low 4 bits
  of ``sc[4..7]`` (low nibble) and ``m[4..7]`` (high nibble), whose top 2 bits are the top
  bits of bytes 0-3 and 4-7.  The nibbles come in four runs of 32 bytes: run ``c``'s low
  nibbles are sub-block ``2c``, its high nibbles sub-block ``2c + 1``.
  ``W = (d * sc) * q - (dmin * m)``, ``q`` in 0..15.
- **Q5_K** (176 bytes): ``d``, ``dmin``, the 12 scale bytes as Q4_K, 32 bytes ``qh``, 128
  bytes of nibbles as Q4_K (the low four bits).  Bit ``s`` of ``qh[i]`` is the fifth bit of
  element ``i`` of sub-block ``s``.  ``W = (d * sc) * q - (dmin * m)``, ``q`` in 0..31.
- **Q6_K** (210 bytes): 128 bytes ``ql`` (low four bits), 64 bytes ``qh`` (top two bits), 16
  int8 scales ``sc`` (one per sub-block of 16), ``d``.  Element ``128 h + r`` (``h`` in 0..1,
  ``r`` in 0..127) is nibble ``r // 64`` of ``ql[64 h + r % 64]`` with bits ``2 (r // 32)``
  and up of ``qh[32 h + r % 32]`` above it.  ``W = (d * sc) * (q - 32)``, ``q`` in 0..63.

Unpacked: ``scales = d * sc`` (fp32); Q4_K/Q5_K ``mins = dmin * m``, Q6_K ``zeros`` 32.
"""

from __future__ import annotations

import torch

from cbatch.models.gguf.block_format import BlockFormat, bit_planes, constant, fp16, nibbles


def _scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 ``[B, 8]`` each: the 6-bit ``sc`` and ``m`` of Q4_K's and Q5_K's 12 bytes."""
    d, m, low = packed.reshape(-1, 3, 4).unbind(1)  # [B, 4] each
    sc = torch.cat([d & 0x3F, (low & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q4_k(blocks: torch.Tensor):
    sc, mn = _scales_and_mins(blocks[:, 4:16])
    q = nibbles(blocks[:, 16:], 32)
    return q, fp16(blocks[:, :2]) * sc.float(), fp16(blocks[:, 2:4]) * mn.float()


def _q5_k(blocks: torch.Tensor):
    sc, mn = _scales_and_mins(blocks[:, 4:16])
    q = nibbles(blocks[:, 48:], 32) | (bit_planes(blocks[:, 16:48], 32) << 4)
    return q, fp16(blocks[:, :2]) * sc.float(), fp16(blocks[:, 2:4]) * mn.float()


def _q6_k(blocks: torch.Tensor):
    q = nibbles(blocks[:, :128], 64) | (bit_planes(blocks[:, 128:192], 32, bits=2) << 4)
    sc = blocks[:, 192:208].contiguous().view(torch.int8)
    return q, fp16(blocks[:, 208:]) * sc.float(), constant(len(blocks), 16, 32)


FORMATS = {
    "Q4_K": BlockFormat(256, 144, 32, 4, _q4_k),
    "Q5_K": BlockFormat(256, 176, 32, 5, _q5_k),
    "Q6_K": BlockFormat(256, 210, 16, 6, _q6_k),
}
