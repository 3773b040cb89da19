"""GPTQ checkpoints (``quant_method`` "gptq", bits 4 or 8): ``qweight`` int32 ``[K / p, N]``
(p = 32 / bits consecutive k per word, the first in the lowest bits), ``qzeros`` int32
``[G, N / p]`` (consecutive n), ``scales`` fp16 ``[G, N]``, ``g_idx`` int32 ``[K]`` (each k's
group).  The classic format (``checkpoint_format`` "gptq") stores each zero point minus one;
"gptq_v2" stores it as it is.  With ``desc_act`` the groups are not k // group_size: k is
sorted by group, the weight stored in that order and x gathered into it (QuantizedLinear's
``perm``)."""

from __future__ import annotations

from pathlib import Path


from cbatch.models.quantized_checkpoint.layer import (Layer, groups, is_int, packed, pop, refuse,
                                                      scales_of, unpack_words)


def read_gptq(qc: dict, state: dict, where: Path) -> dict[str, Layer]:
    """Pop each GPTQ layer's tensors from ``state``; {layer name: Layer}."""
    bits = qc.get("bits")
    if not is_int(bits) or bits not in (4, 8):
        raise refuse(where, f"GPTQ bits={bits!r} (cbatch runs 4 and 8)")
    fmt = "marlin" if qc.get("is_marlin_format") else qc.get("checkpoint_format") or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise refuse(where, f"GPTQ checkpoint_format {fmt!r} (cbatch reads gptq and gptq_v2)")
    if qc.get("dynamic"):
        raise refuse(where, "GPTQ's per-module overrides (dynamic)")
    if qc.get("lm_head"):
        raise refuse(where, "a GPTQ-quantized lm_head (lm_head: true)")
    gs = qc.get("group_size", -1)
    if not is_int(gs) or gs == 0 or gs < -1 or (bits == 4 and gs > 0 and gs % 2):
        raise refuse(where, f"GPTQ group_size={gs!r} (cbatch runs -1 and even sizes)")
    p, top, offset = 32 // bits, (1 << bits) - 1, 0 if fmt == "gptq_v2" else 1
    layers = {}
    for name in [n for n in state if n.endswith(".qweight")]:
        prefix = name.removesuffix(".qweight")
        qweight = packed(state.pop(name), name, where)
        N, K = qweight.shape[1], qweight.shape[0] * p
        group_size = K if gs == -1 else gs
        G = groups(K, group_size)
        q = unpack_words(qweight, bits, 0).t()  # [N, K]
        qzeros = packed(pop(state, f"{prefix}.qzeros", where), f"{prefix}.qzeros", where)
        zeros = unpack_words(qzeros, bits, 1)[:, :N] + offset
        if tuple(zeros.shape) != (G, N):
            raise ValueError(f"{where}: {prefix}.qzeros unpacks to {tuple(zeros.shape)}, "
                             f"expected {(G, N)}")
        if int(zeros.max()) > top:
            raise ValueError(f"{where}: {prefix} has a zero point of {top + 1} (a stored "
                             f"{top} plus one), which {bits}-bit weights cannot hold: GPTQ's "
                             "classic format cannot store a zero of 0 (gptq_v2 can)")
        scales = scales_of(pop(state, f"{prefix}.scales", where), (G, N),
                           f"{prefix}.scales", where)
        g_idx = state.pop(f"{prefix}.g_idx", None)
        if g_idx is not None:
            g_idx = packed(g_idx, f"{prefix}.g_idx", where, ndim=1).long()
            if tuple(g_idx.shape) != (K,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= G:
                raise ValueError(f"{where}: {prefix}.g_idx must be [{K}] groups in [0, {G})")
        if bits == 8:  # uint8 -> int8, as the packed form holds 8-bit weights
            q, zeros = q - 128, zeros - 128
        default = 8 if bits == 4 else 0
        layers[prefix] = Layer(q, scales, None if bool((zeros == default).all()) else zeros,
                               bits, group_size, g_idx)
    return layers
