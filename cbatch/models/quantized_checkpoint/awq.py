"""AWQ checkpoints (``quant_method`` "awq", ``version`` "gemm", 4-bit, zero points):
``qweight`` int32 ``[K, N / 8]``, word c holding column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[j] in
nibble j; ``qzeros`` int32 ``[G, N / 8]`` alike; ``scales`` ``[G, N]``."""

from __future__ import annotations

from pathlib import Path

from cbatch.models.quantized_checkpoint.layer import (Layer, groups, is_int, packed, pop, refuse,
                                                      scales_of, unpack_words)

AWQ_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)  # natural column o of a word sits in nibble AWQ_COLUMN[o]


def read_awq(qc: dict, state: dict, where: Path) -> dict[str, Layer]:
    """Pop each AWQ layer's tensors from ``state``; {layer name: Layer}."""
    bits = qc.get("bits", qc.get("w_bit"))
    gs = qc.get("group_size", qc.get("q_group_size"))
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise refuse(where, f"AWQ version {version!r} (cbatch reads gemm)")
    if not is_int(bits) or bits != 4:
        raise refuse(where, f"AWQ bits={bits!r} (cbatch reads 4)")
    if not qc.get("zero_point", True):
        raise refuse(where, "AWQ without zero points (zero_point: false)")
    if not is_int(gs) or gs < 1 or gs % 2:
        raise refuse(where, f"AWQ group_size={gs!r} (cbatch reads even sizes)")
    layers = {}
    for name in [n for n in state if n.endswith(".qweight")]:
        prefix = name.removesuffix(".qweight")
        qweight = packed(state.pop(name), name, where)
        K, N = qweight.shape[0], qweight.shape[1] * 8
        G = groups(K, gs)
        q = unpack_words(qweight, 4, 1).view(K, -1, 8)[:, :, AWQ_COLUMN].reshape(K, N).t()
        qzeros = packed(pop(state, f"{prefix}.qzeros", where), f"{prefix}.qzeros", where)
        zeros = unpack_words(qzeros, 4, 1)
        if tuple(zeros.shape) != (G, N):
            raise ValueError(f"{where}: {prefix}.qzeros unpacks to {tuple(zeros.shape)}, "
                             f"expected {(G, N)}")
        zeros = zeros.view(G, -1, 8)[:, :, AWQ_COLUMN].reshape(G, N)
        scales = scales_of(pop(state, f"{prefix}.scales", where), (G, N),
                           f"{prefix}.scales", where)
        layers[prefix] = Layer(q.contiguous(), scales, zeros, 4, gs)
    return layers
