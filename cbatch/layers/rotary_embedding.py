"""Rotary position embeddings (RoPE) as Llama-family checkpoints use them: the rotate-half
layout (the two halves of a head are the real and imaginary parts), with the frequency
scalings their configs name.

A config gives ``rope_theta`` and ``rope_scaling`` (``config.json`` written before
transformers 5) or one ``rope_parameters`` dict holding both (transformers 5);
:func:`rope_parameters` reads either.  Types: ``default``, ``linear`` (positions divided by
``factor``), ``dynamic`` (NTK-aware base, fixed for the longest context the model serves, as
vLLM does: Hugging Face's version rescales per batch, so a token's rotation would depend on
its batch-mates' lengths), ``llama3`` (per-frequency smoothing of Llama 3.1).  A GGUF file
states Llama 3.1's scaling as one divisor per rotated pair instead (llama.cpp's ``rope_freqs``
tensor): ``freq_factors``, a list of ``head_dim / 2`` numbers, divides the frequencies as
llama.cpp divides them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from cbatch.layers.module import Module
from cbatch.ops import layer_ops

ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


def rope_parameters(raw: dict) -> dict:
    """``{"rope_type", "rope_theta", ...}`` from a Hugging Face config dict, old or new style;
    ValueError for a type cbatch does not implement."""
    params = dict(raw.get("rope_parameters") or {})
    if not params:
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.pop("type", None) or params.get("rope_type") or "default"
    params["rope_type"] = rope_type
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; cbatch implements "
                         f"{', '.join(ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    return params


def max_positions(max_position_embeddings: int, params: dict) -> int:
    """The longest context the scaled embedding serves: linear and dynamic scaling stretch
    ``max_position_embeddings`` by ``factor`` (as vLLM counts it); llama3 configs already
    give the stretched length."""
    if params["rope_type"] in ("linear", "dynamic"):
        return int(max_position_embeddings * params["factor"])
    return max_position_embeddings


def inverse_frequencies(head_dim: int, params: dict, max_position_embeddings: int
                        ) -> torch.Tensor:
    """fp32 ``[head_dim / 2]``: the angle per position of each rotated pair, computed as
    transformers does (so the cos/sin tables are bitwise theirs)."""
    base = params["rope_theta"]
    rope_type = params["rope_type"]
    if rope_type == "dynamic":
        factor = params["factor"]
        longest = max_positions(max_position_embeddings, params)
        base = base * ((factor * longest / max_position_embeddings) - (factor - 1)) ** (
            head_dim / (head_dim - 2))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    inv_freq = 1.0 / (base ** exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3(inv_freq, params)
    if "freq_factors" in params:
        inv_freq = inv_freq / torch.tensor(params["freq_factors"], dtype=torch.float32)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, the band between blended.
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryAngles(NamedTuple):
    """A step's rotation, gathered once for every layer: on the CPU kernel the positions
    ``[T]`` and the table ``cos_sin_cache`` ``[max_positions, D]`` (cos, then sin) it reads in
    place; elsewhere cos and sin ``[T, 1, D / 2]`` for the torch formula."""

    positions: torch.Tensor
    cos_sin_cache: torch.Tensor | None
    cos: torch.Tensor | None
    sin: torch.Tensor | None


class RotaryEmbedding(Module):
    """Rotates q ``[T, H, D]`` and k ``[T, H_kv, D]`` by their tokens' positions ``[T]``.

    The cos/sin tables ``[max_positions, D / 2]`` are computed in fp32 on first use on a
    device and cast to the activations' dtype (as transformers casts them), then kept: one
    table per model.  :meth:`angles` gathers a step's rows once; every layer then calls
    :meth:`forward` with them.  Every token is rotated on its own, so the result is
    independent of the batch.  On the CPU the rotation is one in-place C++ pass over q and k
    (:func:`cbatch.ops.layer_ops.rotary_embedding`), rounded as the torch formula rounds.
    """

    def __init__(self, head_dim: int, max_position_embeddings: int, params: dict):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        self.params = params
        self.max_positions = max_positions(max_position_embeddings, params)
        # (device, dtype) -> (cos, sin); ("cos_sin", device, dtype) -> the two side by side
        self._tables: dict[tuple, tuple[torch.Tensor, ...] | torch.Tensor] = {}

    def tables(self, device: torch.device, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device, dtype)
        if key not in self._tables:
            inv_freq = inverse_frequencies(self.head_dim, self.params,
                                           self.max_position_embeddings)
            positions = torch.arange(self.max_positions, dtype=torch.int64).float()
            freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2], as transformers'
            self._tables[key] = tuple(t.to(device=device, dtype=dtype)
                                      for t in (freqs.cos(), freqs.sin()))
        return self._tables[key]

    def cos_sin_cache(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """``[max_positions, D]``: the cos table, then the sin table (vLLM's layout)."""
        key = ("cos_sin", device, dtype)
        if key not in self._tables:
            self._tables[key] = torch.cat(self.tables(device, dtype), dim=-1)
        return self._tables[key]

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryAngles:
        """What every layer's :meth:`forward` reads for the step's ``positions`` ``[T]``."""
        if layer_ops.runs_kernel(positions):
            return RotaryAngles(positions, self.cos_sin_cache(positions.device, dtype),
                                None, None)
        cos, sin = self.tables(positions.device, dtype)
        return RotaryAngles(positions, None, cos[positions][:, None, :],
                            sin[positions][:, None, :])

    def forward(self, angles: RotaryAngles, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if angles.cos_sin_cache is not None and q.dtype == angles.cos_sin_cache.dtype \
                and runs_on_kernel(q, k):
            return layer_ops.rotary_embedding(angles.positions, q, k, angles.cos_sin_cache)
        if angles.cos is None:  # gathered for the kernel, which these q and k cannot take
            cos, sin = (t[angles.positions][:, None, :] for t in
                        angles.cos_sin_cache.chunk(2, dim=-1))
        else:
            cos, sin = angles.cos, angles.sin
        return layer_ops.rotate_torch(q, cos, sin), layer_ops.rotate_torch(k, cos, sin)


def runs_on_kernel(q: torch.Tensor, k: torch.Tensor) -> bool:
    # the kernel's layout: [T, H, D] with dense heads, and no autograd through the in-place op
    return (q.dim() == 3 and k.dim() == 3 and q.stride(-1) == 1 and k.stride(-1) == 1
            and layer_ops.runs_kernel(q, k))
