"""Packing a CPU model's linear layers for this CPU's route, once, when its runner is built.

The packed weight replaces the dense one (the same bytes, plus at most 15 padding columns).
A weight shared with another module is replaced for both where the other is a token
embedding (:class:`cbatch.layers.embedding.Embedding`, a ``lm_head`` tied to it) and the
layout is cbatch's: the embedding gathers its rows from the packed weight.  Else (oneDNN's
opaque layout) the dense weight stays for its other user and gets a packed copy beside it.
The lm_head also gets its greedy screen (:class:`cbatch.ops.cpu.GreedyScreen`) where one runs
here.  Checkpoints saved from a packed model hold the dense layout (:class:`Linear`).
Quantized layers (:mod:`cbatch.layers.quantization`) are packed at load; their packed weights
only move to the runner's huge pages (:func:`place_quantized`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from cbatch.layers.embedding import Embedding, tied_embeddings, weight_holders
from cbatch.layers.linear import Linear
from cbatch.layers.quantization import QuantizedLinear
from cbatch.ops import cpu


def pack_linears(model: nn.Module, batch_invariant: bool = False,
                 place: Callable[[torch.Tensor], torch.Tensor] | None = None) -> bool:
    """Pack every :class:`Linear` of a CPU model for its dtype's route on this CPU (see
    :func:`cbatch.ops.cpu.cpu_linear_route`; ``"torch"`` packs nothing); idempotent.

    ``batch_invariant``: only the ``"cbatch"`` route, whose kernel sums a row alike for every
    row count, keeps packed weights; with another route the dense weights come back
    (:func:`~cbatch.layers.linear.batch_invariant_linear` pads their rows).  ``place``: where
    each packed weight (and greedy screen) goes, a copy of it in other memory (the model
    runner's huge pages); one at a time, so the dense weight it replaces is freed before the
    next is packed.  Returns whether the weights are packed."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    if not layers or layers[0].weight.device.type != "cpu":
        return False
    dtype = layers[0].weight.dtype
    route = cpu.cpu_linear_route(dtype)
    if batch_invariant and route != "cbatch" and dtype == torch.bfloat16 and cpu.has_amx():
        raise ValueError(
            f"batch-invariant bf16 needs cbatch's CPU kernel on this CPU (the {route!r} route "
            "runs oneDNN's bf16 GEMM on AMX, whose sums of a row change with the number of "
            "rows); unset CBATCH_CPU_LINEAR, or use float32")
    if batch_invariant and any(layer.packed_weight is not None and layer.packed_weight.is_mkldnn
                               for layer in layers):
        unpack_linears(model)
    if route == "torch" or (batch_invariant and route != "cbatch"):
        return False
    holders = weight_holders(model)
    # The lm_head gets a greedy screen (cpu.GreedyScreen) where cbatch's kernel runs it: the
    # screen is exact for the logits of cbatch's kernel alone (benchmarks/NOTES.md, "The
    # lm_head's greedy screen").
    head = getattr(model, "lm_head", None)
    screened = route == "cbatch" and isinstance(head, Linear) and head.bias is None \
        and head.in_features % 2 == 0 and cpu.screen_available(dtype)
    with torch.no_grad():
        for layer in layers:
            if layer.packed_weight is not None:
                continue
            if route == "cbatch" and dtype == torch.bfloat16 and layer.in_features % 2:
                continue  # vdpbf16ps takes pairs of k
            if layer is head and screened:
                screen = cpu.pack_screen(layer.weight)
                layer.greedy_screen = dataclasses.replace(screen, weight=place(screen.weight)) \
                    if place else screen
            packed = cpu.pack(layer.weight, route)
            if place and not packed.is_mkldnn:  # oneDNN's opaque tensors stay where they are
                packed = place(packed)
            tied = tied_embeddings(holders, layer)
            if tied is None or (tied and packed.is_mkldnn):
                layer.packed_weight = packed  # the dense weight stays for its other user
                continue
            weight = nn.Parameter(packed, requires_grad=False)
            for user in (layer, *tied):  # a tied embedding gathers from it: one copy for both
                user.weight = weight
            layer.packed_weight = weight.detach()  # a tensor, not a 2nd parameter
    return True


def place_quantized(model: nn.Module, place: Callable[[torch.Tensor], torch.Tensor]) -> int:
    """Move each :class:`QuantizedLinear`'s packed tensors (packed at load) to ``place``'s
    memory (the model runner's huge pages) where the loader has not already
    (:meth:`QuantizedLinear.place`); the number of layers moved."""
    return sum(layer.place(place) for layer in model.modules()
               if isinstance(layer, QuantizedLinear))


def unpack_linears(model: nn.Module) -> None:
    """Give every packed :class:`Linear` its dense weight back (one weight again for a
    tied embedding and lm_head)."""
    dense: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (Linear, Embedding)) and module.weight is not None \
                    and cpu.is_packed(module.weight):
                rows = module.out_features if isinstance(module, Linear) \
                    else module.num_embeddings
                if id(module.weight) not in dense:
                    dense[id(module.weight)] = nn.Parameter(cpu.unpack(module.weight, rows))
                module.weight = dense[id(module.weight)]
            if isinstance(module, Linear):
                module.packed_weight = None
                module.greedy_screen = None
