"""A step's Llama-family decoder layers in one C++ call on the CPU.

:class:`~cbatch.models.llama.LlamaForCausalLM` runs its layers as a Python loop of ops, ten a
layer.  At batch 1 each op's Python, module calls and dispatch cost about as much as its
work: on a 32-layer model about 8 ms of a 23 ms W4A8 decode step (benchmarks/NOTES.md, "One
call for a step's decoder layers").  ``cbatch::decoder_layers`` (csrc/cpu/decoder_layers.cpp)
calls the same C++ kernels in the same order on the same tensors, so the hidden states are the
loop's bit for bit; only the Python around them is gone.

:func:`bind` gathers a model's layer tensors once, after a CPU model runner packed and placed
its weights, and only where every op of the loop would run a C++ kernel: every linear layer
packed for cbatch's route or quantized for one of cbatch's quantized kernels, the norms in the
activations' dtype, cbatch's CPU attention.  Anything else (a GPTQ ``desc_act`` permutation,
oneDNN-packed weights, the pure-torch reference) keeps the loop; :func:`bind` says why.
``$CBATCH_CPU_LAYERS=0`` keeps the loop too (for A/B runs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cbatch import envs
from cbatch.layers.kv_cache import KVCache
from cbatch.layers.linear import Linear
from cbatch.layers.quantization import QuantizedLinear
from cbatch.layers.stacked_linear import StackedLinear
from cbatch.layers.step_batch import StepBatch
from cbatch.ops import cpu, layer_ops, quantized

# a linear layer's kind, as csrc/cpu/decoder_layers.cpp numbers them
PACKED, QUANTIZED, W8A8, W4A8 = 0, 1, 2, 3
KINDS = {"w8a16": QUANTIZED, "w4a16": QUANTIZED, "w8a8": W8A8, "w4a8": W4A8,
         "w8a8g": W4A8}  # W8A8 per group: W4A8's op on an int8 qweight


@dataclass
class BoundLayers:
    """What one ``cbatch::decoder_layers`` call reads besides the step batch: per layer the
    norms' weights and each linear's tensors (``tensors``), and each linear's number of parts
    (several for a :class:`StackedLinear`) and each part's kind, sizes and switches
    (``ints``), laid out as csrc/cpu/decoder_layers.cpp says."""

    tensors: list[torch.Tensor | None]
    ints: list[int]
    final_norm: torch.Tensor
    w4a8: bool  # W4A8 (or W8A8 per group) layers: their kernel needs AVX2 at every call
    # (CBATCH_CPU_ISA may cap)


def linear_slots(module) -> tuple[list, list[int]] | str:
    """One linear layer's 5 tensor slots (weight, scales, zeros, bias, mins) and 5 ints (kind,
    out_features, bits, group_size, amx), or why its forward would not run a C++ kernel."""
    if isinstance(module, QuantizedLinear):
        buffers, bias = module._buffers, module._parameters.get("bias")
        if buffers["perm"] is not None:
            return "a GPTQ desc_act permutation"
        if not quantized.available(module.kind):
            return f"{module.kind.upper()} runs the pure-torch reference here"
        kind = KINDS[module.kind]
        zeros, mins = (None, None) if kind == W8A8 else (buffers["zeros"], buffers["mins"])
        group_size = 0 if kind == W8A8 else module.group_size
        return ([buffers["qweight"], buffers["scales"], zeros, bias, mins],
                [kind, module.out_features, module.bits, group_size, 0])
    if isinstance(module, Linear):
        packed = module.packed_weight
        if packed is None or packed.is_mkldnn:
            return "a linear layer not packed for cbatch's kernel"
        return ([packed, None, None, module.bias, None],
                [PACKED, module.out_features, 0, 0, int(cpu.may_use_amx(module.batch_invariant))])
    return f"a {type(module).__name__} linear layer"


def unavailable() -> str | None:
    """Why no model's layers bind here (a phrase), or None."""
    if not envs.CBATCH_CPU_LAYERS:
        return "off (CBATCH_CPU_LAYERS=0)"
    if not layer_ops.kernels_available() or not hasattr(torch.ops.cbatch, "decoder_layers"):
        return "the C++ CPU kernels are not here"
    return None


def bind(model) -> BoundLayers | str:
    """``model``'s layers gathered for ``cbatch::decoder_layers``, or why they cannot be (a
    phrase).  Call after the weights are packed and placed: the call reads these tensors."""
    why = unavailable()
    if why or model.device.type != "cpu":
        return why or f"the model is on {model.device}"
    if set(model.kernels(model.device).backends.values()) != {"cpu"}:
        return "attention runs another backend than cbatch's CPU kernels"
    dtype = model.dtype
    tensors, ints, w4a8 = [], [], False
    for layer in model.model.layers:
        attn = layer.self_attn
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [attn.q_norm, attn.k_norm] if attn.qk_norm else []
        if any(n.weight.dtype != dtype for n in norms):
            return "a norm's weight is not in the activations' dtype"
        tensors += [n.weight for n in norms] + [None] * (4 - len(norms))
        for linear in (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            parts = list(linear.parts) if isinstance(linear, StackedLinear) else [linear]
            ints.append(len(parts))
            for part in parts:
                slots = linear_slots(part)
                if isinstance(slots, str):
                    return slots
                tensors += slots[0]
                ints += slots[1]
                w4a8 |= slots[1][0] == W4A8
    return BoundLayers(tensors, ints, model.model.norm.weight, w4a8)


def run(model, bound: BoundLayers, hidden: torch.Tensor, batch: StepBatch, kv_cache: KVCache,
        decode: bool) -> torch.Tensor:
    """The layers and the final norm on the embeddings ``hidden`` ``[T, hidden_size]`` →
    ``[T, hidden_size]`` (``hidden`` is left as it was); ``decode``: the decode attention
    kernel (the layers' :meth:`~cbatch.layers.attention.PagedAttention.kernel_for`)."""
    config, attn = model.config, model.model.layers[0].self_attn
    cos_sin = model.model.rotary.cos_sin_cache(hidden.device, hidden.dtype)
    return torch.ops.cbatch.decoder_layers(
        hidden, bound.tensors, bound.ints, kv_cache.flat_layers, bound.final_norm,
        config.num_attention_heads, config.num_key_value_heads, config.head_dim,
        config.rms_norm_eps, attn.attn.scale, batch.positions, cos_sin, batch.slot_mapping,
        batch.block_tables, batch.seq_lens, batch.cu_seqlens_q, decode)


def usable(bound: BoundLayers | str | None) -> bool:
    """Whether this call may take the bound layers: bound, no autograd recording, and W4A8's
    kernel still allowed its ISA."""
    return (isinstance(bound, BoundLayers) and not torch.is_grad_enabled()
            and (not bound.w4a8 or quantized.available("w4a8")))
