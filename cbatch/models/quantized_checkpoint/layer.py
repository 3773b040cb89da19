"""One quantized layer as a checkpoint's reader hands it over (:class:`Layer`), and the checks
every reader makes of the tensors it unpacks: each names the tensor and the file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from cbatch.quantization import Scheme


@dataclass(frozen=True)
class Layer:
    """One quantized layer unpacked: ``W[n, k] = scales[g_idx[k], n] * (q[n, k] -
    zeros[g_idx[k], n])`` (zeros None: 0 for bits 8, 8 for bits 4), or, with ``mins``,
    ``W[n, k] = scales[g, n] * q[n, k] - mins[g, n]`` (no zero point; GGUF's K-quants)."""

    q: torch.Tensor  # [N, K] integers: bits 8 -128..127, bits 4 0..15
    scales: torch.Tensor  # [G, N] fp32
    zeros: torch.Tensor | None  # [G, N] integers
    bits: int
    group_size: int
    g_idx: torch.Tensor | None = None  # [K] int64; None: k // group_size
    act_bits: int | None = None  # 8: x quantized per token too (W8A8)
    mins: torch.Tensor | None = None  # [G, N] fp32; only with zeros None

    @property
    def scheme(self) -> Scheme:
        return Scheme.of(self.bits, self.group_size, self.act_bits, self.q.shape[1])

    @property
    def form(self) -> tuple:
        """What shards must share to be fused into one weight: the scheme, mins or none, the
        order of k."""
        return (self.scheme, self.mins is not None,
                None if self.g_idx is None else tuple(self.g_idx.tolist()))


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def refuse(where: Path, what: str) -> ValueError:
    return ValueError(f"{where}: {what} is not supported")


def groups(K: int, group_size: int) -> int:
    return -(-K // group_size)


def pop(state: dict, name: str, where: Path) -> torch.Tensor:
    if name not in state:
        raise ValueError(f"{where}: quantized layer tensor {name} is missing")
    return state.pop(name)


def packed(tensor: torch.Tensor, name: str, where: Path, ndim: int = 2) -> torch.Tensor:
    """``tensor`` if it holds integers in ``ndim`` dimensions, as packed weights do; a float
    one would load as other numbers."""
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise ValueError(f"{where}: {name} is {str(tensor.dtype).removeprefix('torch.')}; "
                         "packed quantized weights are integers (int32 words, or int8)")
    if tensor.dim() != ndim:
        raise ValueError(f"{where}: {name} has {tensor.dim()} dimensions "
                         f"{tuple(tensor.shape)}, expected {ndim}")
    return tensor


def unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their 32 / bits unsigned values along ``dim`` (lowest bits first)."""
    p, mask = 32 // bits, (1 << bits) - 1
    w = words.to(torch.int32)
    values = torch.stack([(w >> (bits * j)) & mask for j in range(p)], dim=dim + 1)
    shape = list(words.shape)
    shape[dim] *= p
    return values.reshape(shape)


def scales_of(scales: torch.Tensor, shape: tuple, name: str, where: Path) -> torch.Tensor:
    """``scales`` as fp32, checked: the shape its layer's weight says, every value finite."""
    if tuple(scales.shape) != shape:
        raise ValueError(f"{where}: {name} has shape {tuple(scales.shape)}, its layer's "
                         f"qweight and group size say {shape}")
    return finite(scales.float(), name, where)


def finite(scales: torch.Tensor, name: str, where: Path) -> torch.Tensor:
    """``scales`` itself where every value is finite, else ValueError naming the first bad
    value, ``name`` and ``where``."""
    if scales.is_floating_point() and bool(torch.isfinite(scales.sum())):
        # a NaN or inf makes the sum one: one vectorised pass with nothing allocated (a
        # float64 sum took 17x as long; finite values that overflow the sum fall through to
        # the exact check below)
        return scales
    bad = ~torch.isfinite(scales)
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{where}: {name} holds {int(bad.sum())} values that are not finite "
                         f"(the first at {first}: {float(scales[first])}); the layer's output "
                         "would be NaN")
    return scales
