"""cbatch's one quantized-weight representation, packed for its CPU kernel.

A weight ``W [N, K]`` (``out_features``, ``in_features``) is stored as integers ``q`` with
scales (and, optionally, zero points) per group of ``group_size`` consecutive k of a column:

    W[n, k] = scales[g, n] * (q[n, k] - zeros[g, n]),   g = k // group_size

- ``bits=8``: ``q`` signed int8; ``zeros`` None (symmetric: 0) or int8.  Per output channel
  is ``group_size = K`` (one group).
- ``bits=4``: ``q`` unsigned, 0..15; ``zeros`` None (symmetric: 8) or int8 in 0..15;
  ``group_size`` even (or K), so that the two k of a byte share a group.

Or, with float **mins** instead of zero points (llama.cpp's Q4_K / Q5_K ``d sc q - dmin m``,
Q4_1 / Q5_1 ``d q + m``; ``zeros`` None, and no zero point applies, not even int4's 8):

    W[n, k] = scales[g, n] * q[n, k] - mins[g, n]

dequantized as ``fl(fl(scales * q) - mins)`` in fp32, which is gguf's own dequantization bit
for bit when scales and mins are its fp32 products.

Packed as the dense CPU linear packs (:func:`cbatch.ops.cpu.pack`): blocks of 16 output
columns, N padded to a multiple of 16 (``N16``), each block its rows of k one after the other:

- ``qweight``: bits 8, int8 ``[N16 / 16, K, 16]``; bits 4, uint8 ``[N16 / 16, ceil(K / 2),
  16]``, byte ``[b, i, j]`` holding column ``16 b + j``'s ``q`` of k = 2i in its low nibble and
  of k = 2i + 1 in its high one (0 past K);
- ``scales``: fp32 ``[G, N16]``, ``G = ceil(K / group_size)``; ``zeros``: int8 ``[G, N16]``
  or None; ``mins``: fp32 ``[G, N16]`` or None.  Padded columns have scale 0 (and min 0).

A decode step reads one byte (int8) or half a byte (int4) per weight, plus 4 (and 1) bytes per
group and column.  :func:`quantize` makes one from a float weight (online quantization);
checkpoint loaders (GPTQ, AWQ, compressed-tensors) convert their integers, scales and zero
points into the same form with :func:`pack`: GPTQ's and AWQ's uint4 with zero points map to
bits 4 as they are (their ``qzeros`` unpacked, GPTQ's stored zero minus one added back),
8-bit GPTQ's uint8 to int8 by subtracting 128 from ``q`` and zeros, compressed-tensors'
int8 per-channel to bits 8 with ``zeros`` None.  Not represented: a permutation of k
(GPTQ's ``desc_act`` ``g_idx``), which a loader must either apply to the weight's rows with
its inverse on x or refuse.

W8A8 (``QuantizedLinear(..., act_bits=8)``: x quantized to int8 per token, int8 dot products
in int32) takes symmetric int8 with one group per column, repacked (:func:`pack_w8a8`) for
the kernel's 4-byte dot products (``vpdpbusd``'s u8 x s8 quads; AVX2's ``vpmaddubsw`` on the
signed q, the top bit flipped back): uint8 ``[N16 / 16, ceil(K / 4), 64]``, byte ``[b, i, 4 j +
t]`` holding ``q[16 b + j, 4 i + t] + 128`` (128 past K), so that each 4-byte lane is one
column's four k.  For ``vpdpbusd`` the weight is unsigned and x signed: ``sum (q + 128) x = sum
q x + 128 sum x``, and the kernel subtracts 128 times each row's sum of x, one number per row
(no per-column correction).  :func:`unpack_w8a8`
gives the :class:`QuantizedWeight` back (bitwise).

W4A8 (``QuantizedLinear(..., act_bits=8)`` on int4: x quantized to int8 per token and per
group, int4 x int8 dot products in int32 per group) takes int4 in groups of a multiple of 32 k,
symmetric, with zero points or with mins (kept as they are, beside it), repacked
(:func:`pack_w4a8`) for AVX2's ``vpmaddubsw`` (u8 x s8 pairs): uint8 ``[N16 / 16, 8 ceil(K /
32), 32]``, byte ``[b, i, 4 j + t]`` holding ``q[16 b + j, 4 i + t]`` (0..15; zero point 8 or
``zeros``) in its low nibble and ``q[16 b + 8 + j, 4 i + t]`` in its high one (8 past K, to a
multiple of 32 k): one 32-byte load is 16 columns x 4 k, whose low nibbles are columns 0..7 and
high nibbles columns 8..15, each column's 4 k in a 4-byte lane.  ``sum q x = sum (q - 8) x + 8
sum x``: the kernel subtracts 8 times each row's sum of x per group (``zeros[g, n]`` times it
where there are zero points; with mins nothing, and ``mins[g, n]`` times the row's dequantized
sum of x over the group instead).  Half a byte per weight, as int4's own layout.
:func:`unpack_w4a8` gives the :class:`QuantizedWeight` back (bitwise; zeros and mins stay
beside it as they are).

W8A8 per group (``QuantizedLinear(..., act_bits=8)`` on int8 in groups; llama.cpp's Q8_0 x Q8_0
route, run by W4A8's kernel) takes int8 in groups of a multiple of 16 k, symmetric, with zero
points or with mins, x quantized per token and per group alike, repacked (:func:`pack_w8a8g`):
int8 ``[N16 / 16, 8 ceil(K / 32), 64]``, byte ``[b, i, 32 half + 4 j + t]`` holding ``q[16 b + 8
half + j, 4 i + t]`` (0 past K, to a multiple of 32 k): a quad's 64 bytes (one cache line) are
columns 0..7 then 8..15, each column's 4 k in a 4-byte lane, the integers as they are (the
kernel forms each product as ``|q| sign(x, q)``).  :func:`unpack_w8a8g` gives the
:class:`QuantizedWeight` back (bitwise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cbatch.ops import cpu, reference

BLOCK = 16  # output columns per packed block


def _pad(t: torch.Tensor, pads: tuple[int, ...], value: int = 0) -> torch.Tensor:
    """``F.pad(t, pads, value=value)``, or ``t`` itself where every pad is 0 (``F.pad`` copies
    even then: a load's largest tensors)."""
    return F.pad(t, pads, value=value) if any(pads) else t


@dataclass(frozen=True)
class QuantizedWeight:
    """A packed quantized weight (see the module docstring for the layout)."""

    bits: int
    group_size: int
    out_features: int
    in_features: int
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None
    mins: torch.Tensor | None = None

    def __post_init__(self) -> None:
        N, K = self.out_features, self.in_features
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.bits == 4 and self.groups > 1 and self.group_size % 2:
            raise ValueError(f"int4 groups hold pairs of k: group_size must be even, got "
                             f"{self.group_size}")
        blocks = -(-N // BLOCK)
        rows = K if self.bits == 8 else -(-K // 2)
        dtype = torch.int8 if self.bits == 8 else torch.uint8
        if self.qweight.dtype != dtype or tuple(self.qweight.shape) != (blocks, rows, BLOCK):
            raise ValueError(f"a {self.bits}-bit qweight of {N} x {K} is {dtype} "
                             f"[{blocks}, {rows}, {BLOCK}], got {self.qweight.dtype} "
                             f"{list(self.qweight.shape)}")
        shape = (self.groups, blocks * BLOCK)
        if self.scales.dtype != torch.float32 or tuple(self.scales.shape) != shape:
            raise ValueError(f"scales must be float32 {list(shape)}, got {self.scales.dtype} "
                             f"{list(self.scales.shape)}")
        if self.zeros is not None and (self.zeros.dtype != torch.int8
                                       or tuple(self.zeros.shape) != shape):
            raise ValueError(f"zeros must be int8 {list(shape)}, got {self.zeros.dtype} "
                             f"{list(self.zeros.shape)}")
        if self.mins is not None:
            if self.zeros is not None:
                raise ValueError("a weight has zeros or mins, not both")
            if self.mins.dtype != torch.float32 or tuple(self.mins.shape) != shape:
                raise ValueError(f"mins must be float32 {list(shape)}, got {self.mins.dtype} "
                                 f"{list(self.mins.shape)}")

    @property
    def groups(self) -> int:
        return -(-self.in_features // self.group_size)

    def dequantize(self) -> torch.Tensor:
        """The fp32 ``[N, K]`` weight this stands for."""
        return reference.dequantize(self.qweight, self.scales, self.zeros, self.bits,
                                    self.group_size, self.out_features, self.in_features,
                                    self.mins)


def pack(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
         group_size: int, mins: torch.Tensor | None = None, kernel: bool = True
         ) -> QuantizedWeight:
    """A :class:`QuantizedWeight` from unpacked integers: ``q [N, K]`` (bits 8: -128..127;
    bits 4: 0..15), ``scales [G, N]`` (any float dtype), ``zeros [G, N]`` or None, ``mins
    [G, N]`` (any float dtype, taken as fp32) or None (with ``zeros`` None).  int8 (bits 8)
    and uint8 (bits 4) ``q`` go through cbatch's C++ packer unless ``kernel`` is False."""
    N, K = q.shape
    pad = -N % BLOCK
    blocks = (N + pad) // BLOCK
    if bits in (4, 8) and q.dtype == (torch.int8 if bits == 8 else torch.uint8) \
            and kernel and cpu.load_kernels(q):
        qweight = torch.ops.cbatch.pack_levels(q.contiguous(), bits)
    elif bits == 8:
        if int(q.min()) < -128 or int(q.max()) > 127:
            raise ValueError("8-bit q must be in [-128, 127]")
        qp = _pad(q.to(torch.int8), (0, 0, 0, pad))
        qweight = qp.reshape(blocks, BLOCK, K).permute(0, 2, 1).contiguous()
    elif bits == 4:
        if int(q.min()) < 0 or int(q.max()) > 15:
            raise ValueError("4-bit q must be in [0, 15]")
        qp = _pad(q.to(torch.uint8), (0, K % 2, 0, pad))
        bytes_ = qp[:, 0::2] | (qp[:, 1::2] << 4)  # [N16, ceil(K / 2)]
        qweight = bytes_.view(blocks, BLOCK, -1).permute(0, 2, 1).contiguous()
    else:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    scales = F.pad(scales.float(), (0, pad)).contiguous()
    low, high = (-128, 127) if bits == 8 else (0, 15)
    if zeros is not None and (int(zeros.min()) < low or int(zeros.max()) > high):
        raise ValueError(f"{bits}-bit zero points must be in [{low}, {high}]")
    if zeros is not None:
        zeros = F.pad(zeros.to(torch.int8), (0, pad)).contiguous()
    if mins is not None:
        mins = F.pad(mins.float(), (0, pad)).contiguous()
    return QuantizedWeight(bits, group_size, N, K, qweight, scales, zeros, mins)


def quantize(weight: torch.Tensor, bits: int, group_size: int | None = None
             ) -> QuantizedWeight:
    """Symmetric round-to-nearest quantization of a float ``[N, K]`` weight (online
    quantization): per group (``group_size``; None: one group, per output channel) the scale
    is the largest magnitude over 127 (int8) or 7 (int4; q = round(w / s) + 8 in 0..15, zero
    point 8), 1 for an all-zero group."""
    w = weight.detach().float()
    N, K = w.shape
    gs = K if group_size is None else group_size
    G = -(-K // gs)
    padded = F.pad(w, (0, G * gs - K)).view(N, G, gs)
    top = padded.abs().amax(dim=2)  # [N, G]
    levels = 127 if bits == 8 else 7
    scales = torch.where(top > 0, top / levels, torch.ones_like(top))  # [N, G]
    q = (padded / scales[:, :, None]).round().clamp(-levels - (bits == 4), levels)
    q = q.view(N, G * gs)[:, :K]
    if bits == 4:
        q = q + 8
    return pack(q.to(torch.int16), scales.t(), None, bits, gs)


def pack_w8a8(weight: QuantizedWeight) -> torch.Tensor:
    """``weight``'s integers in the W8A8 layout (the module docstring); ``weight`` symmetric
    int8 with one group per output channel."""
    if weight.bits != 8 or weight.groups != 1 or weight.zeros is not None \
            or weight.mins is not None:
        raise ValueError(f"W8A8 takes symmetric int8 weights with one group per output "
                         f"channel, got bits={weight.bits}, group_size={weight.group_size} "
                         f"of K={weight.in_features}, zeros={weight.zeros is not None}, "
                         f"mins={weight.mins is not None}")
    blocks, K, _ = weight.qweight.shape
    quads = -(-K // 4)
    q = F.pad(weight.qweight, (0, 0, 0, 4 * quads - K)).to(torch.int16) + 128  # [b, 4i+t, j]
    q = q.to(torch.uint8).view(blocks, quads, 4, BLOCK).permute(0, 1, 3, 2)  # [b, i, j, t]
    return q.reshape(blocks, quads, 4 * BLOCK).contiguous()


def unpack_w8a8(qweight: torch.Tensor, scales: torch.Tensor, out_features: int,
                in_features: int) -> QuantizedWeight:
    """The :class:`QuantizedWeight` whose :func:`pack_w8a8` is ``qweight``."""
    blocks = qweight.shape[0]
    q = reference.unpack_w8a8(qweight, blocks * BLOCK, in_features).to(torch.int8)
    q = q.view(blocks, BLOCK, in_features).permute(0, 2, 1).contiguous()
    return QuantizedWeight(8, in_features, out_features, in_features, q, scales)


def pack_w4a8(weight: QuantizedWeight, kernel: bool = True) -> torch.Tensor:
    """``weight``'s integers in the W4A8 layout (the module docstring); ``weight`` int4 in
    groups of a multiple of 32 k (its zero points or mins, if any, stay beside it in
    ``zeros`` or ``mins``).  ``kernel``: cbatch's C++ packer where it is built."""
    if weight.bits != 4 or weight.group_size % 32:
        raise ValueError(f"W4A8 takes int4 weights in groups of a multiple of 32 k, got "
                         f"bits={weight.bits}, group_size={weight.group_size}")
    if kernel and cpu.load_kernels(weight.qweight):
        return torch.ops.cbatch.pack_w4a8(weight.qweight.contiguous(), weight.in_features)
    blocks, pairs, _ = weight.qweight.shape
    K = weight.in_features
    quads = -(-K // 32) * 8
    packed = weight.qweight  # uint8 [b, i, j]: k = 2 i (low nibble), 2 i + 1 (in bytes
    # throughout: a load's largest tensors, 4x smaller than in int32)
    q = torch.stack((packed & 15, packed >> 4), dim=2).view(blocks, 2 * pairs, BLOCK)[:, :K]
    q = _pad(q, (0, 0, 0, 4 * quads - K), value=8)  # [b, k, j]
    q = q.view(blocks, quads, 4, 2, 8).permute(0, 1, 4, 2, 3)  # [b, i, j, t, half]
    return (q[..., 0] | (q[..., 1] << 4)).reshape(blocks, quads, 2 * BLOCK)


def unpack_w4a8(qweight: torch.Tensor, scales: torch.Tensor, group_size: int,
                out_features: int, in_features: int, zeros: torch.Tensor | None = None,
                mins: torch.Tensor | None = None) -> QuantizedWeight:
    """The :class:`QuantizedWeight` whose :func:`pack_w4a8` is ``qweight`` (with ``zeros`` or
    ``mins``)."""
    blocks = qweight.shape[0]
    q = reference.unpack_w4a8(qweight, blocks * BLOCK, in_features) + 8  # [N16, K], 0..15
    q = F.pad(q, (0, in_features % 2)).to(torch.uint8)
    bytes_ = q[:, 0::2] | (q[:, 1::2] << 4)  # [N16, ceil(K / 2)]
    packed = bytes_.view(blocks, BLOCK, -1).permute(0, 2, 1).contiguous()
    return QuantizedWeight(4, group_size, out_features, in_features, packed, scales, zeros,
                           mins)


def pack_w8a8g(weight: QuantizedWeight, kernel: bool = True) -> torch.Tensor:
    """``weight``'s integers in the layout of W8A8 per group (the module docstring); ``weight``
    int8 in groups of a multiple of 16 k (zero points or mins, if any, stay beside it).
    ``kernel``: cbatch's C++ packer where it is built."""
    if weight.bits != 8 or weight.group_size % 16:
        raise ValueError(f"W8A8 per group takes int8 weights in groups of a multiple of 16 k, "
                         f"got bits={weight.bits}, group_size={weight.group_size}")
    if kernel and cpu.load_kernels(weight.qweight):
        return torch.ops.cbatch.pack_w8a8g(weight.qweight.contiguous(), weight.in_features)
    blocks, K, _ = weight.qweight.shape
    quads = -(-K // 32) * 8
    q = _pad(weight.qweight, (0, 0, 0, 4 * quads - K))  # [b, k, j], 0 past K
    q = q.view(blocks, quads, 4, 2, 8).permute(0, 1, 3, 4, 2)  # [b, i, half, j, t]
    return q.reshape(blocks, quads, 4 * BLOCK).contiguous()


def unpack_w8a8g(qweight: torch.Tensor, scales: torch.Tensor, group_size: int,
                 out_features: int, in_features: int, zeros: torch.Tensor | None = None,
                 mins: torch.Tensor | None = None) -> QuantizedWeight:
    """The :class:`QuantizedWeight` whose :func:`pack_w8a8g` is ``qweight`` (with ``zeros`` or
    ``mins``)."""
    blocks = qweight.shape[0]
    q = reference.unpack_w8a8g(qweight, blocks * BLOCK, in_features).to(torch.int8)
    q = q.view(blocks, BLOCK, in_features).permute(0, 2, 1).contiguous()
    return QuantizedWeight(8, group_size, out_features, in_features, q, scales, zeros, mins)
