"""Quantized weights: cbatch's packed representation (:mod:`.weight`), the linear layer that
runs on it (:mod:`.linear`), and online quantization at load (:func:`quantize_model`).

``quantization="int8"``: every linear layer of the decoder layers int8, per output channel,
symmetric; ``"int4"``: int4 in groups of 128 along k, symmetric; ``"w8a8"``: int8 as
``"int8"``, and the layers' inputs quantized to int8 per token on every call (W8A8, as vLLM
runs compressed-tensors' int8 checkpoints; vLLM has no online name for it); ``"w4a8"``: int4
as ``"int4"``, and the inputs quantized to int8 per token and per group of 128 k (W4A8,
llama.cpp's Q4_0 x Q8_0 route; CPU only).

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

from cbatch import config
from cbatch.config import check_quantization
from cbatch.layers.embedding import tied_embeddings, weight_holders
from cbatch.layers.linear import Linear
from cbatch.layers.quantization.linear import QuantizedLinear
from cbatch.layers.quantization.weight import QuantizedWeight, pack, quantize

# method (config.QUANTIZATION_METHODS) -> (bits, group_size; None: one per output channel,
# act_bits; None: x as it is)
QUANTIZATION_METHODS = {"int8": (8, None, None), "int4": (4, 128, None), "w8a8": (8, None, 8),
                        "w4a8": (4, 128, 8)}
assert tuple(QUANTIZATION_METHODS) == config.QUANTIZATION_METHODS
# method -> the lm_head's (bits, group_size, act_bits), where it is quantized too
QUANTIZED_HEADS = {"w4a8": (8, None, 8)}

__all__ = ["QUANTIZATION_METHODS", "QUANTIZED_HEADS", "QuantizedLinear", "QuantizedWeight",
           "check_quantization", "pack", "quantize", "quantize_head", "quantize_model"]


def quantize_model(model: nn.Module, method: str) -> int:
    """Replace every :class:`Linear` of ``model`` except the lm_head (and any layer whose
    weight another module shares) with a :class:`QuantizedLinear` of ``method``, and the
    lm_head too where :data:`QUANTIZED_HEADS` names ``method`` (:func:`quantize_head`); the
    number replaced."""
    bits, group_size, act_bits = QUANTIZATION_METHODS[check_quantization(method)]
    head = getattr(model, "lm_head", None)
    holders = weight_holders(model)
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear) and child is not head \
                    and len(holders[id(child.weight)]) == 1:
                setattr(parent, name, QuantizedLinear.from_linear(child, bits, group_size,
                                                                       act_bits))
                count += 1
    return count + quantize_head(model, method)


def quantize_head(model: nn.Module, method: str) -> int:
    """Where :data:`QUANTIZED_HEADS` names ``method``, quantize ``model``'s lm_head to it if it
    has no bias and shares its weight with nothing but embeddings (which then read the head's
    rows); 1 if it did, else 0."""
    head = getattr(model, "lm_head", None)
    if method not in QUANTIZED_HEADS or not isinstance(head, Linear) or head.bias is not None:
        return 0
    tied = tied_embeddings(weight_holders(model), head)
    if tied is None:
        return 0
    model.lm_head = QuantizedLinear.from_linear(head, *QUANTIZED_HEADS[method])
    for embedding in tied:
        embedding.tie_quantized(model.lm_head)
    return 1
