"""Quantized Hugging Face checkpoints, read as vLLM reads them: config.json's
``quantization_config`` names the method (``quant_method``), and each quantized layer's tensors
become one :class:`~cbatch.layers.quantization.QuantizedLinear` on cbatch's packed form
(:func:`~cbatch.layers.quantization.pack`).  N is a layer's out_features, K its in_features,
G its groups of ``group_size`` consecutive k (the last may be shorter).

- ``gptq`` (bits 4 or 8): ``qweight`` int32 ``[K / p, N]`` (p = 32 / bits consecutive k per
  word, the first in the lowest bits), ``qzeros`` int32 ``[G, N / p]`` (consecutive n),
  ``scales`` fp16 ``[G, N]``, ``g_idx`` int32 ``[K]`` (each k's group).  The classic format
  (``checkpoint_format`` "gptq") stores each zero point minus one; "gptq_v2" stores it as it
  is.  With ``desc_act`` the groups are not k // group_size: k is sorted by group, the weight
  stored in that order and x gathered into it (QuantizedLinear's ``perm``).
- ``awq`` (``version`` "gemm", 4-bit, zero points): ``qweight`` int32 ``[K, N / 8]``, word c
  holding column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[j] in nibble j; ``qzeros`` int32 ``[G, N / 8]``
  alike; ``scales`` ``[G, N]``.
- ``compressed-tensors``, format ``pack-quantized`` (W4A16 / W8A16, symmetric, strategy
  group or channel): ``weight_packed`` int32 ``[N, ceil(K / p)]`` (consecutive k, each value
  stored plus 2^(bits - 1)), ``weight_scale`` ``[N, G]``, ``weight_shape`` ``[N, K]``;
  format ``int-quantized`` or ``naive-quantized`` W8A8 (int8 weights per channel or tensor,
  activations dynamic per token, symmetric): ``weight`` int8 ``[N, K]``, ``weight_scale``
  ``[N, 1]`` or ``[1]``, run as ``QuantizedLinear(..., act_bits=8)``.

Which layers are quantized is read from the tensors (a layer has ``qweight``,
``weight_packed`` or an int8 ``weight``); the others (the lm_head, ``ignore`` and
``modules_to_not_convert`` lists) load as float.  A method, bit width or option not listed
is refused by name.

``quantization="w4a8"`` / ``"w8a8"`` on such a checkpoint runs its own weights with int8
activations, on the W4A8 / W8A8 kernel (:func:`with_int8_activations`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from cbatch.layers.quantization import QuantizedLinear, pack
from cbatch.models.llama import STACKED

AWQ_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)  # natural column o of a word sits in nibble AWQ_COLUMN[o]


@dataclass(frozen=True)
class Layer:
    """One quantized layer unpacked: ``W[n, k] = scales[g_idx[k], n] * (q[n, k] -
    zeros[g_idx[k], n])`` (zeros None: 0 for bits 8, 8 for bits 4)."""

    q: torch.Tensor  # [N, K] int32: bits 8 -128..127, bits 4 0..15
    scales: torch.Tensor  # [G, N] fp32
    zeros: torch.Tensor | None  # [G, N] int32
    bits: int
    group_size: int
    g_idx: torch.Tensor | None = None  # [K] int64; None: k // group_size
    act_bits: int | None = None  # 8: x quantized per token too (W8A8)


def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their 32 / bits unsigned values along ``dim`` (lowest bits first)."""
    p, mask = 32 // bits, (1 << bits) - 1
    w = words.to(torch.int32)
    values = torch.stack([(w >> (bits * j)) & mask for j in range(p)], dim=dim + 1)
    shape = list(words.shape)
    shape[dim] *= p
    return values.reshape(shape)


def _pop(state: dict, name: str, where: Path) -> torch.Tensor:
    if name not in state:
        raise ValueError(f"{where}: quantized layer tensor {name} is missing")
    return state.pop(name)


def _refuse(where: Path, what: str) -> ValueError:
    return ValueError(f"{where}: {what} is not supported")


def _groups(K: int, group_size: int) -> int:
    return -(-K // group_size)


def _check_scales(scales: torch.Tensor, shape: tuple, name: str, where: Path) -> torch.Tensor:
    if tuple(scales.shape) != shape:
        raise ValueError(f"{where}: {name} has shape {tuple(scales.shape)}, its layer's "
                         f"qweight and group size say {shape}")
    return scales.float()


def read_gptq(qc: dict, state: dict, where: Path) -> dict[str, Layer]:
    bits = qc.get("bits")
    if bits not in (4, 8):
        raise _refuse(where, f"GPTQ bits={bits!r} (cbatch runs 4 and 8)")
    fmt = "marlin" if qc.get("is_marlin_format") else qc.get("checkpoint_format") or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(where, f"GPTQ checkpoint_format {fmt!r} (cbatch reads gptq and gptq_v2)")
    if qc.get("dynamic"):
        raise _refuse(where, "GPTQ's per-module overrides (dynamic)")
    if qc.get("lm_head"):
        raise _refuse(where, "a GPTQ-quantized lm_head (lm_head: true)")
    gs = qc.get("group_size", -1)
    if not isinstance(gs, int) or gs == 0 or gs < -1 or (bits == 4 and gs > 0 and gs % 2):
        raise _refuse(where, f"GPTQ group_size={gs!r} (cbatch runs -1 and even sizes)")
    p, top, offset = 32 // bits, (1 << bits) - 1, 0 if fmt == "gptq_v2" else 1
    layers = {}
    for name in [n for n in state if n.endswith(".qweight")]:
        prefix = name.removesuffix(".qweight")
        qweight = state.pop(name)
        N, K = qweight.shape[1], qweight.shape[0] * p
        group_size = K if gs == -1 else gs
        G = _groups(K, group_size)
        q = _unpack(qweight, bits, 0).t()  # [N, K]
        zeros = _unpack(_pop(state, f"{prefix}.qzeros", where), bits, 1)[:, :N] + offset
        if tuple(zeros.shape) != (G, N):
            raise ValueError(f"{where}: {prefix}.qzeros unpacks to {tuple(zeros.shape)}, "
                             f"expected {(G, N)}")
        if int(zeros.max()) > top:
            raise ValueError(f"{where}: {prefix} has a zero point of {top + 1} (a stored "
                             f"{top} plus one), which {bits}-bit weights cannot hold: GPTQ's "
                             "classic format cannot store a zero of 0 (gptq_v2 can)")
        scales = _check_scales(_pop(state, f"{prefix}.scales", where), (G, N),
                               f"{prefix}.scales", where)
        g_idx = state.pop(f"{prefix}.g_idx", None)
        if g_idx is not None:
            g_idx = g_idx.long()
            if tuple(g_idx.shape) != (K,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= G:
                raise ValueError(f"{where}: {prefix}.g_idx must be [{K}] groups in [0, {G})")
        if bits == 8:  # uint8 -> int8, as the packed form holds 8-bit weights
            q, zeros = q - 128, zeros - 128
        default = 8 if bits == 4 else 0
        layers[prefix] = Layer(q, scales, None if bool((zeros == default).all()) else zeros,
                               bits, group_size, g_idx)
    return layers


def read_awq(qc: dict, state: dict, where: Path) -> dict[str, Layer]:
    bits = qc.get("bits", qc.get("w_bit"))
    gs = qc.get("group_size", qc.get("q_group_size"))
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(where, f"AWQ version {version!r} (cbatch reads gemm)")
    if bits != 4:
        raise _refuse(where, f"AWQ bits={bits!r} (cbatch reads 4)")
    if not qc.get("zero_point", True):
        raise _refuse(where, "AWQ without zero points (zero_point: false)")
    if not isinstance(gs, int) or gs < 1 or gs % 2:
        raise _refuse(where, f"AWQ group_size={gs!r} (cbatch reads even sizes)")
    layers = {}
    for name in [n for n in state if n.endswith(".qweight")]:
        prefix = name.removesuffix(".qweight")
        qweight = state.pop(name)
        K, N = qweight.shape[0], qweight.shape[1] * 8
        G = _groups(K, gs)
        q = _unpack(qweight, 4, 1).view(K, -1, 8)[:, :, AWQ_COLUMN].reshape(K, N).t()
        zeros = _unpack(_pop(state, f"{prefix}.qzeros", where), 4, 1)
        if tuple(zeros.shape) != (G, N):
            raise ValueError(f"{where}: {prefix}.qzeros unpacks to {tuple(zeros.shape)}, "
                             f"expected {(G, N)}")
        zeros = zeros.view(G, -1, 8)[:, :, AWQ_COLUMN].reshape(G, N)
        scales = _check_scales(_pop(state, f"{prefix}.scales", where), (G, N),
                               f"{prefix}.scales", where)
        layers[prefix] = Layer(q.contiguous(), scales, zeros, 4, gs)
    return layers


def read_compressed_tensors(qc: dict, state: dict, where: Path) -> dict[str, Layer]:
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse(where, f"compressed-tensors with {len(groups)} config_groups (cbatch "
                      "reads one, targeting Linear)")
    (group_name, group), = groups.items()
    weights, acts = group.get("weights") or {}, group.get("input_activations")
    fmt = group.get("format") or qc.get("format")
    if group.get("targets") != ["Linear"]:
        raise _refuse(where, f"compressed-tensors targets {group.get('targets')!r} (cbatch "
                      "reads [\"Linear\"])")
    if qc.get("kv_cache_scheme") or group.get("output_activations"):
        raise _refuse(where, "compressed-tensors' quantized KV cache or outputs")
    if (qc.get("sparsity_config") or {}).get("format", "dense") != "dense":
        raise _refuse(where, f"compressed-tensors sparsity {qc['sparsity_config']['format']!r}")
    if qc.get("quantization_status", "compressed") != "compressed":
        raise _refuse(where, f"compressed-tensors status {qc['quantization_status']!r}")
    bits = weights.get("num_bits")
    if weights.get("type", "int") != "int" or bits not in (4, 8):
        raise _refuse(where, f"compressed-tensors {bits}-bit {weights.get('type')} weights "
                      "(cbatch reads int4 and int8)")
    if not weights.get("symmetric", True) or weights.get("dynamic"):
        raise _refuse(where, "compressed-tensors asymmetric or dynamic weights")
    if weights.get("actorder") == "group":
        raise _refuse(where, "compressed-tensors actorder 'group'")
    if acts is None and fmt == "pack-quantized":
        return _ct_packed(weights, state, where)
    w8a8 = acts is not None and (bits, acts.get("num_bits"), acts.get("type", "int")) == \
        (8, 8, "int") and fmt in ("int-quantized", "naive-quantized")
    if not w8a8:
        scheme = f"W{bits}A{(acts or {}).get('num_bits', 16)}"
        raise _refuse(where, f"compressed-tensors {scheme} in format {fmt!r} ({group_name}; "
                      "cbatch reads pack-quantized W4A16/W8A16 and int-quantized or "
                      "naive-quantized W8A8)")
    if not (acts.get("dynamic") and acts.get("symmetric", True)
            and acts.get("strategy") == "token"):
        raise _refuse(where, "compressed-tensors W8A8 with static or asymmetric activation "
                      "scales (cbatch quantizes them dynamically per token, symmetric)")
    return _ct_w8a8(weights, state, where)


def _ct_packed(weights: dict, state: dict, where: Path) -> dict[str, Layer]:
    """compressed-tensors pack-quantized (W4A16, W8A16)."""
    bits, strategy = weights["num_bits"], weights.get("strategy")
    if strategy not in ("group", "channel"):
        raise _refuse(where, f"compressed-tensors weight strategy {strategy!r} (cbatch reads "
                      "group and channel)")
    gs = weights.get("group_size") if strategy == "group" else None
    if strategy == "group" and (not isinstance(gs, int) or gs < 1 or (bits == 4 and gs % 2)):
        raise _refuse(where, f"compressed-tensors group_size={gs!r}")
    layers = {}
    for name in [n for n in state if n.endswith(".weight_packed")]:
        prefix = name.removesuffix(".weight_packed")
        packed = state.pop(name)
        N, K = (int(v) for v in _pop(state, f"{prefix}.weight_shape", where).tolist())
        for extra in ("weight_zero_point", "weight_g_idx"):
            if f"{prefix}.{extra}" in state:
                raise _refuse(where, f"compressed-tensors {extra} ({prefix})")
        q = _unpack(packed, bits, 1)[:, :K]
        if tuple(q.shape) != (N, K):
            raise ValueError(f"{where}: {name} unpacks to {tuple(q.shape)}, its weight_shape "
                             f"says {(N, K)}")
        group_size = K if gs is None else gs
        scales = _pop(state, f"{prefix}.weight_scale", where)
        scales = _check_scales(scales, (N, _groups(K, group_size)), f"{prefix}.weight_scale",
                               where).t()
        layers[prefix] = Layer(q - 128 if bits == 8 else q, scales.contiguous(), None, bits,
                               group_size)
    return layers


def _ct_w8a8(weights: dict, state: dict, where: Path) -> dict[str, Layer]:
    """compressed-tensors W8A8 int8: ``weight`` int8 ``[N, K]``, ``weight_scale`` ``[N, 1]``
    (strategy channel) or one scale (tensor); x quantized per token at run time."""
    strategy = weights.get("strategy")
    if strategy not in ("channel", "tensor"):
        raise _refuse(where, f"compressed-tensors W8A8 weight strategy {strategy!r} (cbatch "
                      "reads channel and tensor)")
    layers = {}
    for name in [n for n, t in state.items() if n.endswith(".weight") and t.dtype == torch.int8]:
        prefix = name.removesuffix(".weight")
        q = state.pop(name).to(torch.int32)
        N, K = q.shape
        zero = state.pop(f"{prefix}.weight_zero_point", None)
        if zero is not None and bool(zero.ne(0).any()):
            raise _refuse(where, f"compressed-tensors W8A8 zero points ({prefix})")
        scales = _pop(state, f"{prefix}.weight_scale", where).float().reshape(-1)
        if scales.numel() not in (1, N):
            raise ValueError(f"{where}: {prefix}.weight_scale has {scales.numel()} values, "
                             f"expected {N} (per channel) or 1 (per tensor)")
        layers[prefix] = Layer(q, scales.expand(N).reshape(1, N).contiguous(), None, 8, K,
                               act_bits=8)
    return layers


READERS = {"gptq": read_gptq, "awq": read_awq, "compressed-tensors": read_compressed_tensors}


def quant_method(raw_config: dict, where: Path) -> str | None:
    """The ``quant_method`` of config.json's ``quantization_config``, lower-cased as vLLM
    reads it (None: a float checkpoint); a method cbatch does not read is refused by name."""
    qc = raw_config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if isinstance(method, str) and method.lower() in READERS:
        return method.lower()
    raise ValueError(f"{where}: quantization_config's quant_method {method!r} is not supported; "
                     f"cbatch loads {', '.join(READERS)} checkpoints (and quantizes float ones "
                     "online: quantization='int8', 'int4', 'w8a8' or 'w4a8')")


def read_layers(raw_config: dict, state: dict[str, torch.Tensor], where: Path
                ) -> dict[str, Layer]:
    """Pop each quantized layer's tensors from ``state`` (a checkpoint's, Hugging Face names);
    {layer name: Layer}.  A quantized lm_head or embedding is refused."""
    method = quant_method(raw_config, where)
    layers = READERS[method](raw_config["quantization_config"], state, where)
    for name in layers:
        if name.split(".")[-1] in ("lm_head", "embed_tokens"):
            raise _refuse(where, f"a quantized {name} ({method})")
    return layers


def _fuse(name: str, shards: list[Layer], where: Path) -> Layer:
    """The shards of one fused projection (q/k/v, gate/up) as one layer, stacked along N."""
    first = shards[0]
    if any((s.bits, s.group_size, s.act_bits) != (first.bits, first.group_size, first.act_bits)
           for s in shards):
        raise ValueError(f"{where}: the shards of {name} differ in bits, group size or "
                         "activation bits")
    if any((s.g_idx is None) != (first.g_idx is None)
           or (s.g_idx is not None and not torch.equal(s.g_idx, first.g_idx)) for s in shards):
        raise ValueError(f"{where}: the shards of {name} have different g_idx (desc_act "
                         "orders); cbatch fuses them into one matmul over one order of k")
    zeros = None
    if any(s.zeros is not None for s in shards):
        default = 8 if first.bits == 4 else 0
        zeros = torch.cat([s.zeros if s.zeros is not None
                           else torch.full_like(s.scales, default, dtype=torch.int32)
                           for s in shards], dim=1)
    return replace(first, q=torch.cat([s.q for s in shards]), zeros=zeros,
                   scales=torch.cat([s.scales for s in shards], dim=1))


def _module(layer: Layer, name: str, bias: torch.Tensor | None, where: Path
            ) -> QuantizedLinear:
    q, perm = layer.q, None
    if layer.g_idx is not None:
        K = q.shape[1]
        perm = torch.argsort(layer.g_idx, stable=True)
        if not torch.equal(layer.g_idx[perm], torch.arange(K) // layer.group_size):
            raise _refuse(where, f"{name}'s g_idx: its groups, sorted, are not all "
                          f"{layer.group_size} k long (ragged desc_act groups)")
        if torch.equal(perm, torch.arange(K)):
            perm = None
        else:
            q = q[:, perm]
    return QuantizedLinear(pack(q, layer.scales, layer.zeros, layer.bits, layer.group_size),
                           bias, layer.act_bits, perm)


def int8_activation_kernel(layer: Layer) -> str | None:
    """The kernel that runs ``layer``'s own weights with int8 activations (``"w4a8"``: int4
    in groups of a multiple of 32 k, with zero points or without; ``"w8a8"``: symmetric int8
    with one scale per output channel), or None."""
    if layer.bits == 4 and layer.group_size % 32 == 0:
        return "w4a8"
    if layer.bits == 8 and layer.group_size >= layer.q.shape[1] and layer.zeros is None:
        return "w8a8"
    return None


def suggested_kernel(layers: dict[str, Layer]) -> str | None:
    """The int8-activation kernel that runs every one of ``layers`` where none takes int8
    activations already (:func:`int8_activation_kernel`), or None."""
    kinds = {None if one.act_bits == 8 else int8_activation_kernel(one) for one in layers.values()}
    return kinds.pop() if len(kinds) == 1 else None


def with_int8_activations(layer: Layer, name: str, kernel: str, where: Path) -> Layer:
    """``layer`` run by ``kernel`` (``"w4a8"`` or ``"w8a8"``): its own weights, x quantized to
    int8 at every call; refused by name where the weights are not what that kernel takes."""
    takes = "int4 in groups of a multiple of 32 k" if kernel == "w4a8" else \
        "symmetric int8 with one scale per output channel"
    if int8_activation_kernel(layer) != kernel:
        has = f"{layer.bits}-bit weights in groups of {layer.group_size} k of " \
            f"{layer.q.shape[1]}" + (" with zero points" if layer.zeros is not None else "")
        raise ValueError(f"{where}: quantization={kernel!r} runs {takes}; {name} holds {has} "
                         "(leave quantization unset to run them as they are)")
    return replace(layer, act_bits=8)


def install(model: nn.Module, layers: dict[str, Layer], state: dict[str, torch.Tensor],
            where: Path, device, dtype, kernel: str | None = None) -> int:
    """Replace each quantized layer's :class:`Linear` in ``model`` (Hugging Face names in
    ``layers``; q/k/v and gate/up fused as the model fuses them) by a QuantizedLinear, its
    bias taken from ``state`` (our names); the number replaced.  ``kernel`` (``"w4a8"``,
    ``"w8a8"``): each layer's inputs quantized to int8 (:func:`with_int8_activations`)."""
    fused: dict[str, dict[int, Layer]] = {}
    for name, layer in layers.items():
        parts = name.split(".")
        stacked = next((p for p in parts if p in STACKED), None)
        target, index = (name, 0) if stacked is None else \
            (".".join(STACKED[stacked][0] if p == stacked else p for p in parts),
             STACKED[stacked][1])
        fused.setdefault(target, {})[index] = layer
    for target, shards in fused.items():
        count = 3 if target.endswith("qkv_proj") else 2 if target.endswith("gate_up_proj") \
            else 1
        if sorted(shards) != list(range(count)):
            raise ValueError(f"{where}: only some shards of {target} are quantized; cbatch "
                             "fuses them into one layer of one kind")
        layer = _fuse(target, [shards[i] for i in range(count)], where)
        if kernel is not None:
            layer = with_int8_activations(layer, target, kernel, where)
        try:
            linear = model.get_submodule(target)
        except AttributeError:
            raise ValueError(f"{where}: the checkpoint quantizes {target}, which "
                             f"{type(model).__name__} does not have") from None
        if tuple(layer.q.shape) != (linear.out_features, linear.in_features):
            raise ValueError(f"{where}: quantized {target} is {tuple(layer.q.shape)}, the "
                             f"config expects {(linear.out_features, linear.in_features)}")
        bias = state.pop(f"{target}.bias", None)
        if (bias is None) != (linear.bias is None):
            raise ValueError(f"{where}: {target}'s bias is "
                             f"{'missing' if bias is None else 'unexpected'} (the config "
                             f"{'has' if bias is None else 'has no'} one)")
        if bias is not None:
            bias = bias.to(device=device, dtype=dtype)
        parent, _, child = target.rpartition(".")
        setattr(model.get_submodule(parent), child, _module(layer, target, bias, where))
    return len(fused)
