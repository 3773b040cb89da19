"""Random quantized weights for the quantized kernels' tests (the CPU kernel's and the Triton
GEMMs'), and the float64 weight that the oracle multiplies by."""

from __future__ import annotations

import torch

from cbatch.layers.quantization import QuantizedWeight, pack


def random_quantized(N: int, K: int, bits: int, group_size: int, zeros: bool,
                     gen: torch.Generator) -> tuple[QuantizedWeight, tuple]:
    """A packed weight of random integers, scales and (maybe) zero points, and its unpacked
    parts (q [N, K], scales [G, N], zeros [G, N] or None)."""
    G = -(-K // group_size)
    if bits == 8:
        q = torch.randint(-128, 128, (N, K), generator=gen)
        z = torch.randint(-20, 21, (G, N), generator=gen) if zeros else None
    else:
        q = torch.randint(0, 16, (N, K), generator=gen)
        z = torch.randint(0, 16, (G, N), generator=gen) if zeros else None
    s = torch.rand(G, N, generator=gen) * 0.02 + 1e-3
    return pack(q, s, z, bits, group_size), (q, s, z)


def unpacked_weight(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, bits: int,
                    group_size: int) -> torch.Tensor:
    """W = s * (q - z) from the unpacked integers, in float64: the oracle's own weight."""
    K = q.shape[1]
    g = torch.arange(K) // group_size
    zero = (8 if bits == 4 else 0) if z is None else z[g].t().double()
    return s[g].t().double() * (q.double() - zero)


def random_with_mins(N: int, K: int, bits: int, group_size: int, gen: torch.Generator
                     ) -> tuple[QuantizedWeight, tuple]:
    """A packed weight of random integers, scales and float mins (``W = s q - m``, no zero
    point; mins of either sign, as large as a group's s q, so that a dropped or misapplied
    one shows), and its unpacked parts (q [N, K], scales [G, N], mins [G, N])."""
    G = -(-K // group_size)
    q = torch.randint(-128, 128, (N, K), generator=gen) if bits == 8 else \
        torch.randint(0, 16, (N, K), generator=gen)
    s = torch.rand(G, N, generator=gen) * 0.02 + 1e-3
    m = (torch.rand(G, N, generator=gen) - 0.3) * 0.2
    return pack(q, s, None, bits, group_size, mins=m), (q, s, m)


def weight_with_mins(q: torch.Tensor, s: torch.Tensor, m: torch.Tensor,
                     group_size: int) -> torch.Tensor:
    """W = s q - m from the unpacked parts, in float64 (exact: s q has at most 32 bits)."""
    g = torch.arange(q.shape[1]) // group_size
    return s[g].t().double() * q.double() - m[g].t().double()


def quantize_with_mins(weight: torch.Tensor, bits: int, group_size: int) -> QuantizedWeight:
    """Min-max (asymmetric) round-to-nearest quantization with float mins, as llama.cpp's Q4_1
    makes them: per group ``d = (max - min) / levels``, ``q = round((w - min) / d)`` and
    ``W = d q - mins`` (bits 8: q less 128, the min moved to keep W)."""
    w = weight.detach().float()
    N, K = w.shape
    G = -(-K // group_size)
    padded = torch.nn.functional.pad(w, (0, G * group_size - K)).view(N, G, group_size)
    lo, hi = padded.amin(dim=2), padded.amax(dim=2)  # [N, G]
    levels = 15 if bits == 4 else 255
    d = torch.where(hi > lo, (hi - lo) / levels, torch.ones_like(lo))
    q = ((padded - lo[:, :, None]) / d[:, :, None]).round().clamp(0, levels)
    q = q.view(N, G * group_size)[:, :K]
    mins = -lo
    if bits == 8:
        q, mins = q - 128, -(lo + 128 * d)
    return pack(q.to(torch.int16), d.t(), None, bits, group_size, mins=mins.t())
