"""The token embedding, which can read its rows from a tied lm_head's packed weight.

A tied model (GPT-2, SmolLM2, Qwen2.5-0.5B, Llama 3.2-1B) holds one ``[vocab, hidden]``
matrix for two uses: the embedding gathers a row per token, the lm_head multiplies every row.
On the CPU the lm_head runs from a packed layout (:func:`cbatch.ops.cpu.pack`); rather than
keep the dense matrix beside it for the lookup (SmolLM2-360M in bf16: 94 MB), the CPU model
runner hands the embedding the packed weight too (:func:`cbatch.core.cpu.packing.pack_linears`)
and the lookup gathers from it (:func:`cbatch.ops.cpu.packed_rows`: the same values, bitwise).
Quantized with ``quantization="w4a8"``, the lm_head is int8 (W8A8) and the embedding drops its
weight: its rows are the head's dequantized ones (:meth:`QuantizedLinear.rows`), as llama.cpp
and OpenVINO read a quantized ``token_embd``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cbatch.layers.module import DirectCall
from cbatch.ops import cpu


class Embedding(DirectCall, nn.Embedding):
    """``nn.Embedding`` whose ``weight`` may be the tied lm_head's packed weight, or None with
    the rows read from a quantized lm_head (:meth:`tie_quantized`).

    ``forward(ids)``: ids ``[T]`` (int64) → ``[T, embedding_dim]``.  Checkpoints hold the dense
    layout whichever the weight is in.
    """

    def reset_parameters(self) -> None:
        """nn.Embedding's random init, skipped on the meta device where a checkpoint's
        weights will be assigned (its ``normal_`` there runs torch's Python reference, whose
        first call imports torch._dynamo: 1.8 s of a cold start)."""
        if not self.weight.is_meta:
            super().reset_parameters()

    def tie_quantized(self, head: nn.Module, dtype: torch.dtype | None = None) -> None:
        """Read the rows from ``head`` (a :class:`~cbatch.layers.quantization.QuantizedLinear`
        holding this embedding's tied weight, quantized) from now on, in ``dtype`` (None: this
        weight's); the weight is dropped."""
        self.__dict__["quantized_head"] = head  # a reference, not a child module
        self.__dict__["rows_dtype"] = dtype or self.weight.dtype
        self.weight = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            return self.quantized_head.rows(ids).to(self.rows_dtype)
        if cpu.is_packed(self.weight):
            return cpu.packed_rows(self.weight, ids)
        return F.embedding(ids, self.weight)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.weight is not None and cpu.is_packed(self.weight):  # saved dense
            destination[prefix + "weight"] = cpu.unpack(self.weight, self.num_embeddings)


def weight_holders(model: nn.Module) -> dict[int, list[nn.Module]]:
    """{id of a parameter: the modules that hold it} (more than one: a tied weight)."""
    holders: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            holders.setdefault(id(p), []).append(module)
    return holders


def tied_embeddings(holders: dict[int, list[nn.Module]], layer: nn.Module
                    ) -> list[Embedding] | None:
    """The other holders of ``layer``'s weight (``holders``: :func:`weight_holders`) when
    every one is an :class:`Embedding` (none: an empty list), else None: the weight may then
    change form for all of them (packed, quantized) with the lookup following it."""
    others = [m for m in holders[id(layer.weight)] if m is not layer]
    return others if all(isinstance(m, Embedding) for m in others) else None
