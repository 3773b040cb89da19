"""compressed-tensors checkpoints (``quant_method`` "compressed-tensors"): format
``pack-quantized`` (W4A16 / W8A16, symmetric, strategy group or channel): ``weight_packed``
int32 ``[N, ceil(K / p)]`` (consecutive k, each value stored plus 2^(bits - 1)),
``weight_scale`` ``[N, G]``, ``weight_shape`` ``[N, K]``; format ``int-quantized`` or
``naive-quantized`` W8A8 (int8 weights per channel or tensor, activations dynamic per token,
symmetric): ``weight`` int8 ``[N, K]``, ``weight_scale`` ``[N, 1]`` or ``[1]``, run as
``QuantizedLinear(..., act_bits=8)``."""

from __future__ import annotations

from pathlib import Path

import torch

from cbatch.models.quantized_checkpoint.layer import (Layer, finite, groups, is_int, packed, pop,
                                                      refuse, scales_of, unpack_words)


def read_compressed_tensors(qc: dict, state: dict, where: Path) -> dict[str, Layer]:
    """Pop each compressed-tensors layer's tensors from ``state``; {layer name: Layer}."""
    config_groups = qc.get("config_groups") or {}
    if not isinstance(config_groups, dict) or len(config_groups) != 1:
        raise refuse(where, f"compressed-tensors with {len(config_groups)} config_groups "
                     "(cbatch reads one, targeting Linear)")
    (group_name, group), = config_groups.items()
    weights, acts = group.get("weights") or {}, group.get("input_activations")
    fmt = group.get("format") or qc.get("format")
    if group.get("targets") != ["Linear"]:
        raise refuse(where, f"compressed-tensors targets {group.get('targets')!r} (cbatch "
                     "reads [\"Linear\"])")
    if qc.get("kv_cache_scheme") or group.get("output_activations"):
        raise refuse(where, "compressed-tensors' quantized KV cache or outputs")
    if (qc.get("sparsity_config") or {}).get("format", "dense") != "dense":
        raise refuse(where, f"compressed-tensors sparsity {qc['sparsity_config']['format']!r}")
    if qc.get("quantization_status", "compressed") != "compressed":
        raise refuse(where, f"compressed-tensors status {qc['quantization_status']!r}")
    bits = weights.get("num_bits")
    if weights.get("type", "int") != "int" or not is_int(bits) or bits not in (4, 8):
        raise refuse(where, f"compressed-tensors {bits}-bit {weights.get('type')} weights "
                     "(cbatch reads int4 and int8)")
    if not weights.get("symmetric", True) or weights.get("dynamic"):
        raise refuse(where, "compressed-tensors asymmetric or dynamic weights")
    if weights.get("actorder") == "group":
        raise refuse(where, "compressed-tensors actorder 'group'")
    if acts is None and fmt == "pack-quantized":
        return _ct_packed(weights, state, where)
    w8a8 = acts is not None and (bits, acts.get("num_bits"), acts.get("type", "int")) == \
        (8, 8, "int") and fmt in ("int-quantized", "naive-quantized")
    if not w8a8:
        scheme = f"W{bits}A{(acts or {}).get('num_bits', 16)}"
        raise refuse(where, f"compressed-tensors {scheme} in format {fmt!r} ({group_name}; "
                     "cbatch reads pack-quantized W4A16/W8A16 and int-quantized or "
                      "naive-quantized W8A8)")
    if not (acts.get("dynamic") and acts.get("symmetric", True)
            and acts.get("strategy") == "token"):
        raise refuse(where, "compressed-tensors W8A8 with static or asymmetric activation "
                     "scales (cbatch quantizes them dynamically per token, symmetric)")
    return _ct_w8a8(weights, state, where)


def _ct_packed(weights: dict, state: dict, where: Path) -> dict[str, Layer]:
    """compressed-tensors pack-quantized (W4A16, W8A16)."""
    bits, strategy = weights["num_bits"], weights.get("strategy")
    if strategy not in ("group", "channel"):
        raise refuse(where, f"compressed-tensors weight strategy {strategy!r} (cbatch reads "
                     "group and channel)")
    gs = weights.get("group_size") if strategy == "group" else None
    if strategy == "group" and (not is_int(gs) or gs < 1 or (bits == 4 and gs % 2)):
        raise refuse(where, f"compressed-tensors group_size={gs!r}")
    layers = {}
    for name in [n for n in state if n.endswith(".weight_packed")]:
        prefix = name.removesuffix(".weight_packed")
        words = packed(state.pop(name), name, where)
        shape = pop(state, f"{prefix}.weight_shape", where)
        if shape.numel() != 2:
            raise ValueError(f"{where}: {prefix}.weight_shape holds {shape.tolist()}, not "
                             "[out_features, in_features]")
        N, K = (int(v) for v in shape.tolist())
        for extra in ("weight_zero_point", "weight_g_idx"):
            if f"{prefix}.{extra}" in state:
                raise refuse(where, f"compressed-tensors {extra} ({prefix})")
        q = unpack_words(words, bits, 1)[:, :K]
        if tuple(q.shape) != (N, K):
            raise ValueError(f"{where}: {name} unpacks to {tuple(q.shape)}, its weight_shape "
                             f"says {(N, K)}")
        group_size = K if gs is None else gs
        scales = pop(state, f"{prefix}.weight_scale", where)
        scales = scales_of(scales, (N, groups(K, group_size)), f"{prefix}.weight_scale",
                           where).t()
        layers[prefix] = Layer(q - 128 if bits == 8 else q, scales.contiguous(), None, bits,
                               group_size)
    return layers


def _ct_w8a8(weights: dict, state: dict, where: Path) -> dict[str, Layer]:
    """compressed-tensors W8A8 int8: ``weight`` int8 ``[N, K]``, ``weight_scale`` ``[N, 1]``
    (strategy channel) or one scale (tensor); x quantized per token at run time."""
    strategy = weights.get("strategy")
    if strategy not in ("channel", "tensor"):
        raise refuse(where, f"compressed-tensors W8A8 weight strategy {strategy!r} (cbatch "
                     "reads channel and tensor)")
    layers = {}
    for name in [n for n, t in state.items() if n.endswith(".weight") and t.dtype == torch.int8]:
        prefix = name.removesuffix(".weight")
        q = packed(state.pop(name), name, where).to(torch.int32)
        N, K = q.shape
        zero = state.pop(f"{prefix}.weight_zero_point", None)
        if zero is not None and bool(zero.ne(0).any()):
            raise refuse(where, f"compressed-tensors W8A8 zero points ({prefix})")
        scales = finite(pop(state, f"{prefix}.weight_scale", where).float().reshape(-1),
                        f"{prefix}.weight_scale", where)
        if scales.numel() not in (1, N):
            raise ValueError(f"{where}: {prefix}.weight_scale has {scales.numel()} values, "
                             f"expected {N} (per channel) or 1 (per tensor)")
        layers[prefix] = Layer(q, scales.expand(N).reshape(1, N).contiguous(), None, 8, K,
                               act_bits=8)
    return layers
