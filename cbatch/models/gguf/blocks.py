"""GGUF's block-quantized tensors in an unpacked form, and their dequantization.

A GGUF tensor of shape ``[N, K]`` (``N`` rows of ``K``; a 1-D tensor is one row) is stored row
after row, each row as ``K / block_size`` blocks of bytes.  :func:`unpack` turns the blocks of
a quantized type into :class:`UnpackedBlocks`: integer levels ``q [N, K]`` and per-group fp32
``scales [G, N]`` (``G = K / group_size``) with either integer ``zeros`` or fp32 ``mins``:

    W[n, k] = scales[g, n] * (q[n, k] - zeros[g, n])      (zeros: Q8_0, Q4_0, Q5_0, Q6_K)
    W[n, k] = scales[g, n] * q[n, k] - mins[g, n]         (mins: Q4_1, Q5_1, Q4_K, Q5_K)

with ``g = k // group_size``: the layout of cbatch's quantized weights
(:mod:`cbatch.layers.quantization.weight`), groups along k, scales ``[G, N]``.  A K-quant's two
levels of scales (a super-block's fp16 ``d`` times a sub-block's 6- or 8-bit scale) are
multiplied out into one fp32 scale per sub-block, in the order gguf-py's ``dequantize``
multiplies them, so that :meth:`UnpackedBlocks.dequantize` is bitwise ``gguf.quants.dequantize``.

The block layouts are in :mod:`cbatch.models.gguf.legacy_quants` (blocks of 32) and
:mod:`cbatch.models.gguf.k_quants` (super-blocks of 256).  F32, F16 and BF16 are plain floats:
:func:`dequantize_tensor` reads them as they are.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from cbatch.ops import cpu
from cbatch.models.gguf import k_quants, legacy_quants
from cbatch.models.gguf.block_format import BlockFormat

# the plain float types: name -> torch dtype
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# the block-quantized types: name -> BlockFormat (sizes, group, bits, unpacker)
BLOCK_TYPES: dict[str, BlockFormat] = {**legacy_quants.FORMATS, **k_quants.FORMATS}
SUPPORTED_TYPES = tuple(FLOAT_TYPES) + tuple(BLOCK_TYPES)


@dataclass(frozen=True)
class UnpackedBlocks:
    """One GGUF quantized tensor, unpacked (see the module docstring for the formula).

    Attributes
    ----------
    qtype : str
        The GGUF type it came from (``"Q4_K"``).
    bits : int
        Bits per level: ``q`` is in ``[0, 2**bits)``, or for Q8_0 in ``[-128, 128)``.
    group_size : int
        Consecutive k sharing a scale: 32, or 16 for Q6_K's sub-blocks.
    q : torch.Tensor
        uint8 ``[N, K]`` (int8 for Q8_0): the levels.
    scales : torch.Tensor
        fp32 ``[G, N]``, ``G = K / group_size``.
    zeros : torch.Tensor or None
        int8 ``[G, N]``: the level that stands for 0 (8 for Q4_0, 16 for Q5_0, 32 for Q6_K,
        0 for Q8_0); None where ``mins`` is given.
    mins : torch.Tensor or None
        fp32 ``[G, N]``: subtracted after scaling; None where ``zeros`` is given.
    """

    qtype: str
    bits: int
    group_size: int
    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None
    mins: torch.Tensor | None = None

    def __post_init__(self) -> None:
        N, K = self.q.shape
        shape = (K // self.group_size, N)
        if K % self.group_size or tuple(self.scales.shape) != shape:
            raise ValueError(f"{self.qtype}: scales {tuple(self.scales.shape)} do not fit q "
                             f"[{N}, {K}] in groups of {self.group_size}")
        if (self.zeros is None) == (self.mins is None):
            raise ValueError(f"{self.qtype}: exactly one of zeros and mins is given")
        offset = self.zeros if self.zeros is not None else self.mins
        if tuple(offset.shape) != shape:
            raise ValueError(f"{self.qtype}: zeros/mins {tuple(offset.shape)} are not [G, N] "
                             f"= {list(shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        """fp32 ``[N, K]``, bitwise ``gguf.quants.dequantize`` of the blocks it came from."""
        N, K = self.q.shape
        G = K // self.group_size
        q = self.q.view(N, G, self.group_size).float()
        scales = self.scales.t()[:, :, None]  # [N, G, 1]
        if self.zeros is not None:  # (q - zero) is an exact small integer in fp32
            w = scales * (q - self.zeros.t()[:, :, None].float())
        else:
            w = scales * q - self.mins.t()[:, :, None]
        return w.reshape(N, K)


def unpack(raw: torch.Tensor, qtype: str, shape: tuple[int, ...]) -> UnpackedBlocks:
    """The blocks of a quantized tensor as :class:`UnpackedBlocks`.

    Parameters
    ----------
    raw : torch.Tensor
        uint8, the tensor's bytes (any shape; ``N * K / block_size * type_size`` of them).
    qtype : str
        A name of :data:`BLOCK_TYPES`.
    shape : tuple of int
        The tensor's shape, rows last (``[N, K]``, or ``[K]``: one row).

    Returns
    -------
    UnpackedBlocks
        ``q [N, K]`` with ``N`` the product of the leading dimensions.
    """
    if qtype not in BLOCK_TYPES:
        raise ValueError(f"{qtype} is not a block-quantized type cbatch unpacks; those are "
                         f"{', '.join(BLOCK_TYPES)}")
    _check_size(raw, qtype, shape)
    fmt = BLOCK_TYPES[qtype]
    K = shape[-1]
    N = int(np.prod(shape[:-1], dtype=np.int64))
    blocks = raw.contiguous().reshape(-1, fmt.type_size)  # [B, type_size], row after row
    levels, scales, offset = unpack_blocks(blocks, qtype)  # [B, block_size], [B, S], [B, S]

    def per_group(x: torch.Tensor) -> torch.Tensor:  # [B, S] -> [G, N]
        return x.reshape(N, K // fmt.group_size).t().contiguous()

    zeros, mins = (per_group(offset), None) if offset.dtype == torch.int8 else \
        (None, per_group(offset))
    return UnpackedBlocks(qtype, fmt.bits, fmt.group_size, levels.reshape(N, K),
                          per_group(scales), zeros, mins)


def unpack_blocks(blocks: torch.Tensor, qtype: str, kernel: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks uint8 ``[B, type_size]`` of ``qtype`` → levels ``[B, block_size]``, scales fp32
    ``[B, S]``, zero points int8 or mins fp32 ``[B, S]`` (:data:`block_format.Unpacker`):
    cbatch's C++ unpacker (one pass over the bytes, the counter ``gguf_unpack.cpu``) where
    the extension is built and ``kernel``, else the type's torch unpacker (its module's,
    which documents the bytes); the same bits either way."""
    if kernel and cpu.load_kernels(blocks):
        return torch.ops.cbatch.gguf_unpack(blocks, qtype)
    return BLOCK_TYPES[qtype].unpack(blocks)


def dequantize_tensor(raw: torch.Tensor, qtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """fp32 ``shape``: any type of :data:`SUPPORTED_TYPES` from its bytes ``raw`` (uint8),
    bitwise ``gguf.quants.dequantize``.  A new tensor (never a view of ``raw``)."""
    if qtype in FLOAT_TYPES:
        _check_size(raw, qtype, shape)
        dtype = FLOAT_TYPES[qtype]
        values = raw.contiguous().view(torch.uint8).reshape(-1).view(dtype)
        return (values.clone() if dtype == torch.float32 else values.float()).reshape(shape)
    return unpack(raw, qtype, shape).dequantize().reshape(shape)


def from_numpy(array: np.ndarray) -> torch.Tensor:
    """A read-only memory-mapped array (a GGUF file's tensor data) as a uint8 tensor over the
    same memory, without the warning torch gives for arrays it may not write (nothing here
    writes to it: every decoder makes new tensors)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(array).view(np.uint8))


def _check_size(raw: torch.Tensor, qtype: str, shape: tuple[int, ...]) -> None:
    block, size = (1, FLOAT_TYPES[qtype].itemsize) if qtype in FLOAT_TYPES else \
        BLOCK_TYPES[qtype][:2]
    if not shape or shape[-1] % block:
        raise ValueError(f"a {qtype} tensor's rows are whole blocks of {block}; shape "
                         f"{list(shape)} is not")
    count = int(np.prod(shape, dtype=np.int64)) // block * size
    if raw.dtype != torch.uint8 or raw.numel() != count:
        raise ValueError(f"a {qtype} tensor of shape {list(shape)} is {count} bytes (uint8); "
                         f"got {raw.numel()} of {raw.dtype}")
