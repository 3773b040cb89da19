"""Quantized Hugging Face checkpoints, read as vLLM reads them: config.json's
``quantization_config`` names the method (``quant_method``), one reader per method turns each
quantized layer's tensors into a :class:`~.layer.Layer` (:mod:`.gptq`, :mod:`.awq`,
:mod:`.compressed_tensors`), and :func:`install` makes each one
:class:`~cbatch.layers.quantization.QuantizedLinear` on cbatch's packed form, q/k/v and
gate/up fused as the model fuses them.  N is a layer's out_features, K its in_features, G its
groups of ``group_size`` consecutive k (the last may be shorter).

Which layers are quantized is read from the tensors (a layer has ``qweight``,
``weight_packed`` or an int8 ``weight``); the others (the lm_head, ``ignore`` and
``modules_to_not_convert`` lists) load as float.  A method, bit width or option not listed is
refused by name, and so is a tensor that cannot be what its name says (a float ``qweight``,
scales that are not finite, a layer's tensors without its ``qweight``), naming it and the file.

An online method that ``runs_checkpoints`` (:mod:`cbatch.quantization`: ``"w4a8"``,
``"w8a8"``) runs the checkpoint's own weights on its kernel, x quantized to int8
(:func:`with_int8_activations`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from cbatch import quantization as quant
from cbatch.layers.quantization import Place, QuantizedLinear, pack
from cbatch.layers.stacked_linear import StackedLinear
from cbatch.models.llama import fuse_shards
from cbatch.models.quantized_checkpoint.awq import read_awq
from cbatch.models.quantized_checkpoint.compressed_tensors import read_compressed_tensors
from cbatch.models.quantized_checkpoint.gptq import read_gptq
from cbatch.models.quantized_checkpoint.layer import Layer, refuse

READERS = {"gptq": read_gptq, "awq": read_awq, "compressed-tensors": read_compressed_tensors}
assert set(READERS) == set(quant.CHECKPOINT) - {"gguf"}  # GGUF: cbatch.models.gguf
# what a quantized layer holds beside its packed weight, in every format read here
_LAYER_TENSORS = ("qzeros", "scales", "g_idx", "weight_scale", "weight_zero_point",
                  "weight_shape", "weight_g_idx")


def quant_method(raw_config: dict, where: Path) -> str | None:
    """The ``quant_method`` of config.json's ``quantization_config``, lower-cased as vLLM
    reads it (None: a float checkpoint, with no ``quantization_config``); a method cbatch
    does not read, or none, is refused by name."""
    if "quantization_config" not in raw_config or raw_config["quantization_config"] is None:
        return None
    qc = raw_config["quantization_config"]
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if isinstance(method, str) and method.lower() in READERS:
        return method.lower()
    what = "names no quant_method" if method is None else \
        f"'s quant_method {method!r} is not supported"
    raise ValueError(f"{where}: quantization_config {what}; cbatch loads "
                     f"{', '.join(READERS)} checkpoints (and quantizes float ones online: "
                     f"quantization={' or '.join(map(repr, quant.ONLINE))})")


def read_layers(raw_config: dict, state: dict[str, torch.Tensor], where: Path
                ) -> dict[str, Layer]:
    """Pop each quantized layer's tensors from ``state`` (a checkpoint's, Hugging Face names);
    {layer name: Layer}.  A quantized lm_head or embedding is refused, and so is a layer's
    tensor left without its packed weight."""
    method = quant_method(raw_config, where)
    qc = raw_config["quantization_config"]
    layers = READERS[method](qc, state, where)
    for name in layers:
        if name.split(".")[-1] in ("lm_head", "embed_tokens"):
            raise refuse(where, f"a quantized {name} ({method})")
    stray = sorted(n for n in state if n.rpartition(".")[2] in _LAYER_TENSORS)
    if stray:
        layer = stray[0].rpartition(".")[0]
        raise ValueError(f"{where}: {layer}'s packed weight ({layer}.qweight, .weight_packed "
                         f"or an int8 .weight) is missing, but {stray[0]} is there "
                         f"({len(stray)} such tensors)")
    return layers


def _runs(shards: list[Layer]) -> list[list[Layer]]:
    """``shards`` cut into runs of consecutive shards of one :attr:`Layer.form`."""
    runs = [[shards[0]]]
    for shard in shards[1:]:
        if shard.form == runs[-1][-1].form:
            runs[-1].append(shard)
        else:
            runs.append([shard])
    return runs


def _fuse(shards: list[Layer]) -> Layer:
    """Shards of one form (:func:`_runs`) as one layer, stacked along N."""
    first = shards[0]
    if len(shards) == 1:
        return first
    zeros = None
    if any(s.zeros is not None for s in shards):
        default = 8 if first.bits == 4 else 0
        zeros = torch.cat([s.zeros if s.zeros is not None
                           else torch.full_like(s.scales, default, dtype=torch.int32)
                           for s in shards], dim=1)
    mins = None if first.mins is None else torch.cat([s.mins for s in shards], dim=1)
    return replace(first, q=torch.cat([s.q for s in shards]), zeros=zeros, mins=mins,
                   scales=torch.cat([s.scales for s in shards], dim=1))


def _module(layer: Layer, name: str, bias: torch.Tensor | None, where: Path
            ) -> QuantizedLinear:
    q, perm = layer.q, None
    if layer.g_idx is not None:
        K = q.shape[1]
        perm = torch.argsort(layer.g_idx, stable=True)
        if not torch.equal(layer.g_idx[perm], torch.arange(K) // layer.group_size):
            raise refuse(where, f"{name}'s g_idx: its groups, sorted, are not all "
                         f"{layer.group_size} k long (ragged desc_act groups)")
        if torch.equal(perm, torch.arange(K)):
            perm = None
        else:
            q = q[:, perm]
    weight = pack(q, layer.scales, layer.zeros, layer.bits, layer.group_size) \
        if layer.mins is None else \
        pack(q, layer.scales, None, layer.bits, layer.group_size, mins=layer.mins)
    return QuantizedLinear(weight, bias, layer.act_bits, perm)


def _int8_kernel(layer: Layer) -> quant.QuantizationMethod | None:
    """The method whose kernel runs ``layer``'s own weights with int8 activations, or None
    (W8A8 per group is no method's: ``"w8a8"`` takes int8 per output channel)."""
    int8 = replace(layer, act_bits=8).scheme
    return next((m for m in quant.METHODS.values() if m.runs_checkpoints
                 and m.scheme.kind == int8.kind
                 and int8.refusal(layer.q.shape[1], layer.zeros is not None) is None), None)


def suggested_kernel(layers: dict[str, Layer]) -> str | None:
    """The name of the method whose int8-activation kernel runs every one of ``layers`` where
    none takes int8 activations already, or None."""
    kinds = {None if one.act_bits == 8 else _int8_kernel(one) for one in layers.values()}
    kind = kinds.pop() if len(kinds) == 1 else None
    return kind.name if kind else None


def with_int8_activations(layer: Layer, name: str, kernel: quant.QuantizationMethod,
                          where: Path) -> Layer:
    """``layer`` run by ``kernel``'s kernel (a method that ``runs_checkpoints``): its own
    weights, x quantized to int8 at every call; refused by name where the weights are not
    what that kernel takes."""
    if _int8_kernel(layer) is not kernel:
        has = f"{layer.bits}-bit weights in groups of {layer.group_size} k of " \
            f"{layer.q.shape[1]}" + (" with zero points" if layer.zeros is not None else "")
        raise ValueError(f"{where}: quantization={kernel.name!r} runs "
                         f"{kernel.scheme.requirement}; {name} holds {has} (leave "
                         "quantization unset to run them as they are)")
    return replace(layer, act_bits=8)


def install(model: nn.Module, layers: dict[str, Layer], state: dict[str, torch.Tensor],
            where: Path, device, dtype, kernel: quant.QuantizationMethod | None = None,
            place: Place | None = None) -> int:
    """Replace each quantized layer's :class:`Linear` in ``model`` (Hugging Face names in
    ``layers``; q/k/v and gate/up fused as the model fuses them) by a QuantizedLinear, its
    bias taken from ``state`` (our names); the number replaced.  ``kernel``: a method whose
    kernel runs each layer, its inputs quantized to int8 (:func:`with_int8_activations`).

    ``layers`` is consumed (emptied): each layer's unpacked integers are freed once its
    module is made, and ``place`` (where the model runner keeps weights: a CPU runner's huge
    pages, :func:`cbatch.core.worker.weight_place`) moves its packed tensors there right away
    (:meth:`QuantizedLinear.place`, which the runner would do later), so that the memory a
    layer frees is reused by the next instead of every layer's unpacked, packed and placed
    copies being alive at once (benchmarks/NOTES.md, "Loading a model: cold start and memory
    after load")."""
    try:
        fused = fuse_shards(layers)
    except ValueError as e:
        raise ValueError(f"{where}: quantized {e}; cbatch fuses the shards of a projection "
                         "into one layer of one kind") from None
    layers.clear()
    count = len(fused)
    for target in list(fused):
        found = fused.pop(target)
        runs = _runs(found) if isinstance(found, list) else [[found]]
        del found
        shards = [_fuse(run) for run in runs]
        if kernel is not None:
            shards = [with_int8_activations(one, target, kernel, where) for one in shards]
        try:
            linear = model.get_submodule(target)
        except AttributeError:
            raise ValueError(f"{where}: the checkpoint quantizes {target}, which "
                             f"{type(model).__name__} does not have") from None
        N = sum(one.q.shape[0] for one in shards)
        if (N, shards[0].q.shape[1]) != (linear.out_features, linear.in_features):
            raise ValueError(f"{where}: quantized {target} is {(N, shards[0].q.shape[1])}, "
                             f"the config expects {(linear.out_features, linear.in_features)}")
        bias = state.pop(f"{target}.bias", None)
        if (bias is None) != (linear.bias is None):
            raise ValueError(f"{where}: {target}'s bias is "
                             f"{'missing' if bias is None else 'unexpected'} (the config "
                             f"{'has' if bias is None else 'has no'} one)")
        biases = [None] * len(shards) if bias is None else \
            bias.to(device=device, dtype=dtype).split([one.q.shape[0] for one in shards])
        modules = [_module(one, target, b, where) for one, b in zip(shards, biases)]
        del shards, runs
        parent, _, child = target.rpartition(".")
        module = modules[0] if len(modules) == 1 else StackedLinear(modules)
        if place is not None:
            for layer in modules:
                layer.place(place)
        setattr(model.get_submodule(parent), child, module)
    return count
