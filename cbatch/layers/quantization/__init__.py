"""Quantized weights: cbatch's packed representation (:mod:`.weight`), the linear layer that
runs on it (:mod:`.linear`), and online quantization at load (:func:`quantize_model`), which
does what a method's record (:mod:`cbatch.quantization`) says: each decoder linear to its
``scheme``, the lm_head to its ``head`` where it has one.

The lm_head stays in the model's dtype (as vLLM keeps it), so that its greedy screen keeps
working (:mod:`cbatch.ops.cpu`), except under ``"w4a8"``, which follows llama.cpp's route
there too: the lm_head is int8 per output channel with int8 activations (W8A8; llama.cpp's
``Q4_0`` files keep ``output.weight`` at 6 bits, OpenVINO's int4 the last layer and the
embeddings at int8), and a tied embedding reads its rows from the head's int8 weights
(:class:`cbatch.layers.embedding.Embedding`): the model's largest matrix once, at a byte per
weight, instead of a bf16 one plus its int8 screen.
"""

from __future__ import annotations

from torch import nn

from cbatch.layers.embedding import tied_embeddings, weight_holders
from cbatch.layers.linear import Linear
from cbatch.layers.quantization.linear import Place, QuantizedLinear
from cbatch.layers.quantization.weight import QuantizedWeight, pack, quantize
from cbatch.quantization import QuantizationMethod, Scheme

__all__ = ["Place", "QuantizedLinear", "QuantizedWeight", "pack", "quantize", "quantize_head",
           "quantize_model"]


def quantize_model(model: nn.Module, method: QuantizationMethod) -> int:
    """Replace every :class:`Linear` of ``model`` except the lm_head (and any layer whose
    weight another module shares) with a :class:`QuantizedLinear` of ``method.scheme``, and
    the lm_head too where the method has a ``head`` (:func:`quantize_head`); the number
    replaced."""
    head = getattr(model, "lm_head", None)
    holders = weight_holders(model)
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear) and child is not head \
                    and len(holders[id(child.weight)]) == 1:
                setattr(parent, name, QuantizedLinear.from_linear(child, method.scheme))
                count += 1
    return count + quantize_head(model, method.head)


def quantize_head(model: nn.Module, scheme: Scheme | None) -> int:
    """Quantize ``model``'s lm_head to ``scheme`` (None: leave it) if it has no bias and
    shares its weight with nothing but embeddings (which then read the head's rows); 1 if it
    did, else 0."""
    head = getattr(model, "lm_head", None)
    if scheme is None or not isinstance(head, Linear) or head.bias is not None:
        return 0
    tied = tied_embeddings(weight_holders(model), head)
    if tied is None:
        return 0
    model.lm_head = QuantizedLinear.from_linear(head, scheme)
    for embedding in tied:
        embedding.tie_quantized(model.lm_head)
    return 1
