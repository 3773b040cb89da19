"""The block formats of 32 elements (llama.cpp's first quantizations): Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1.  Each block is one group: one fp16 scale ``d`` (and for the ``_1`` types an fp16
offset ``m``), then the levels.  Byte layouts, fields in order (fp16 little-endian):

- **Q8_0** (34 bytes): ``d``, 32 int8 levels ``q``.  ``W = d * q``.
- **Q4_0** (18 bytes): ``d``, 16 bytes of nibbles: element ``j < 16`` is byte ``j``'s low
  nibble, element ``16 + j`` its high one.  ``W = d * (q - 8)``.
- **Q4_1** (20 bytes): ``d``, ``m``, 16 bytes of nibbles as Q4_0.  ``W = d * q + m``.
- **Q5_0** (22 bytes): ``d``, 4 bytes ``qh`` (a little-endian uint32 whose bit ``j`` is element
  ``j``'s fifth bit), 16 bytes of nibbles as Q4_0 (the low four bits).  ``W = d * (q - 16)``.
- **Q5_1** (24 bytes): ``d``, ``m``, ``qh``, nibbles, as Q5_0.  ``W = d * q + m``.

In the unpacked form (:class:`cbatch.models.gguf.blocks.UnpackedBlocks`) ``scales = d``;
``zeros`` 0, 8 or 16; for the ``_1`` types ``mins = -m`` (``d * q - (-m)`` is ``d * q + m``
exactly, as gguf-py computes it).
"""

from __future__ import annotations

import torch

from cbatch.models.gguf.block_format import BlockFormat, constant, fp16, nibbles


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """uint8 ``[B, 32]``: bit ``j`` of the little-endian uint32 ``qh [B, 4]``."""
    shifts = torch.arange(8, dtype=torch.uint8).view(1, 1, 8)
    return ((qh.reshape(-1, 4, 1) >> shifts) & 1).reshape(-1, 32)


def _q8_0(blocks: torch.Tensor):
    q = blocks[:, 2:].contiguous().view(torch.int8)
    return q, fp16(blocks[:, :2]), constant(len(blocks), 1, 0)


def _q4_0(blocks: torch.Tensor):
    return nibbles(blocks[:, 2:], 16), fp16(blocks[:, :2]), constant(len(blocks), 1, 8)


def _q4_1(blocks: torch.Tensor):
    return nibbles(blocks[:, 4:], 16), fp16(blocks[:, :2]), -fp16(blocks[:, 2:4])


def _q5_0(blocks: torch.Tensor):
    q = nibbles(blocks[:, 6:], 16) | (_fifth_bits(blocks[:, 2:6]) << 4)
    return q, fp16(blocks[:, :2]), constant(len(blocks), 1, 16)


def _q5_1(blocks: torch.Tensor):
    q = nibbles(blocks[:, 8:], 16) | (_fifth_bits(blocks[:, 4:8]) << 4)
    return q, fp16(blocks[:, :2]), -fp16(blocks[:, 2:4])


FORMATS = {
    "Q8_0": BlockFormat(32, 34, 32, 8, _q8_0),
    "Q4_0": BlockFormat(32, 18, 32, 4, _q4_0),
    "Q4_1": BlockFormat(32, 20, 32, 4, _q4_1),
    "Q5_0": BlockFormat(32, 22, 32, 5, _q5_0),
    "Q5_1": BlockFormat(32, 24, 32, 5, _q5_1),
}
