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
