"""Pure-torch definitions of cbatch's ops: slow, obvious, and the ground truth for tests.

Shapes follow docs/design.md: T new tokens, S sequences, H query heads, D head dim; caches are
``[num_blocks, block_size, H_kv, D]`` with H a multiple of H_kv (grouped-query attention:
query head h reads KV head ``h // (H // H_kv)``).  Attention accumulates in fp32.
"""

from __future__ import annotations

import math

import torch


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key[t]``/``value[t]`` (``[T, H_kv, D]``) into slot ``slot_mapping[t]``;
    -1 skips.

    Slots outside ``[-1, num_slots)`` raise, as the compiled kernels do (indexing would wrap
    a negative slot or skip it silently).
    """
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    bad = (slot_mapping < -1) | (slot_mapping >= num_slots)
    if bool(bad.any()):
        raise ValueError(f"slot_mapping holds slots outside [-1, {num_slots}): "
                         f"{slot_mapping[bad][:5].tolist()}")
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    key_cache.flatten(0, 1)[slots] = key[keep]  # a view: the cache is contiguous
    value_cache.flatten(0, 1)[slots] = value[keep]


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's first ``seq_len`` cached rows, ``[seq_len, H_kv, D]``, in position order."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            compute_dtype: torch.dtype) -> torch.Tensor:
    # q: [n, H, D] are the last n positions of a sequence whose keys are k, v: [L, H_kv, D].
    # One query row at a time, over exactly the keys it sees: a token's result is then the
    # same computation whatever chunk (or decode step) it comes in, so the reference is
    # batch-invariant too (one matmul over n rows sums a row differently for different n).
    # The query heads of a KV head are consecutive: q viewed as [n, H_kv, H / H_kv, D].
    n, H, D = q.shape
    L, H_kv = k.shape[0], k.shape[1]
    q = q.to(compute_dtype).reshape(n, H_kv, H // H_kv, D)
    k, v = k.to(compute_dtype), v.to(compute_dtype)
    rows = []
    for i in range(n):
        visible = L - n + i + 1
        scores = torch.einsum("kgd,lkd->kgl", q[i], k[:visible]) * scale
        rows.append(torch.einsum("kgl,lkd->kgd", scores.softmax(dim=-1), v[:visible]))
    return torch.stack(rows).reshape(n, H, D)


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached context; ``[T, H, D]``.

    ``query`` is ``[T, H, D]`` and the caches ``[num_blocks, block_size, H_kv, D]``, H a
    multiple of H_kv.  The new tokens of sequence s are
    ``query[cu_seqlens_q[s]:cu_seqlens_q[s+1]]`` and sit at the last positions of its
    ``seq_lens[s]`` tokens (whose K/V are already in the cache).  The maths runs in
    ``compute_dtype`` (tests use float64 for the truth and the input dtype for the error a
    plain implementation makes); the output is in query's dtype.
    """
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    bounds = cu_seqlens_q.tolist()
    num_blocks, block_size = key_cache.shape[:2]
    for s, seq_len in enumerate(seq_lens.tolist()):
        start, end = bounds[s], bounds[s + 1]
        if end == start:
            continue
        # the checks the compiled kernels make: indexing would wrap a block id of -1
        if not (end - start <= seq_len <= block_tables.shape[1] * block_size):
            raise ValueError(f"sequence {s}: seq_len {seq_len} must be in "
                             f"[{end - start} new tokens, {block_tables.shape[1] * block_size}] "
                             "(the block table's capacity)")
        used = block_tables[s, :-(-seq_len // block_size)]
        if bool(((used < 0) | (used >= num_blocks)).any()):
            raise ValueError(f"block_tables[{s}] holds block ids outside [0, {num_blocks}): "
                             f"{used.tolist()}")
        k = gather_kv(key_cache, block_tables[s], seq_len)
        v = gather_kv(value_cache, block_tables[s], seq_len)
        out[start:end] = _attend(query[start:end], k, v, scale, compute_dtype)
    return out


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """One query per sequence (``query: [S, H, D]``) over its ``seq_lens[s]`` cached tokens."""
    cu_seqlens_q = torch.arange(query.shape[0] + 1, dtype=torch.int32, device=query.device)
    return paged_prefill_attention(
        query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
        compute_dtype,
    )


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
               bits: int, group_size: int, out_features: int, in_features: int,
               mins: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 ``[N, K]`` weight of cbatch's packed quantized layout (``cbatch::
    quantized_linear``'s operands; :mod:`cbatch.layers.quantization.weight`):
    ``W[n, k] = scales[g, n] * (q[n, k] - zeros[g, n])``, ``g = k // group_size``, with
    ``q - zeros`` exact in integers, then one fp32 rounding; with ``mins`` (fp32 ``[G, N16]``,
    ``zeros`` None: no zero point, q as stored) ``W[n, k] = fl(fl(scales[g, n] * q[n, k]) -
    mins[g, n])``, two roundings in that order (gguf's dequantization)."""
    N, K = out_features, in_features
    blocks = qweight.shape[0]
    if bits == 8:  # [blocks, K, 16] int8
        q = qweight.permute(0, 2, 1).reshape(blocks * 16, K)
    else:  # [blocks, ceil(K / 2), 16] uint8, k = 2i in the low nibble, 2i + 1 in the high one
        pairs = qweight.permute(0, 2, 1).reshape(blocks * 16, -1).to(torch.int32)
        q = torch.stack((pairs & 15, pairs >> 4), dim=-1).flatten(1)[:, :K]
    group = torch.arange(K, device=q.device) // group_size  # [K]
    s = scales[group].t()  # [N16, K]
    if mins is not None:
        return (s * q.float() - mins[group].t())[:N]
    zero = 0 if bits == 8 else 8
    z = zeros.to(torch.int32)[group].t() if zeros is not None else zero  # [N16, K]
    return (s * (q.to(torch.int32) - z).float())[:N]


def quantized_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     zeros: torch.Tensor | None, bits: int, group_size: int, out_features: int,
                     bias: torch.Tensor | None, mins: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W`` :func:`dequantize`'s, in fp32, returned in x's dtype:
    what ``cbatch::quantized_linear`` computes (x ``[M, K]``; the kernel's roundings are its
    own: within a bound of this, not bitwise).  With ``mins`` the kernel computes
    ``sum_g (s[g] sum_k x q - m[g] sum_k x)``, each row's group sums of x once."""
    w = dequantize(qweight, scales, zeros, bits, group_size, out_features, x.shape[-1], mins)
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token symmetric int8 quantization (vLLM's ``scaled_int8_quant`` without a
    given scale; compressed-tensors' dynamic "token" strategy), exactly as ``cbatch::
    quantized_linear_w8a8`` does it: per row of x ``[M, K]``, in fp32, ``a = max |x|``,
    ``q = round(x * (127 / a))`` (ties to even; every |q| <= 127) and ``scale = a / 127``; a
    row of zeros gets q 0 and scale 0.  Returns int8 ``[M, K]`` and fp32 ``[M]``."""
    xf = x.float()
    top = xf.abs().amax(dim=-1)  # [M]
    # tensor / tensor: one correctly rounded division (a scalar's would multiply by a
    # reciprocal, a second rounding)
    levels = torch.full_like(top, 127.0)
    inv = torch.where(top > 0, levels / top, torch.zeros_like(top))
    q = (xf * inv[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, top / levels


def unpack_w8a8(qweight: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """int32 ``q [N, K]`` from the W8A8 layout (``cbatch::quantized_linear_w8a8``'s weight,
    :func:`cbatch.layers.quantization.weight.pack_w8a8`): uint8 ``[N16 / 16, ceil(K / 4),
    64]``, byte ``[b, i, 4 j + t]`` holding ``q[16 b + j, 4 i + t] + 128``."""
    blocks, quads, _ = qweight.shape
    q = qweight.view(blocks, quads, 16, 4).permute(0, 2, 1, 3).reshape(blocks * 16, quads * 4)
    return q[:out_features, :in_features].to(torch.int32) - 128


def quantized_linear_w8a8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                          out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8: x ``[M, K]`` quantized per token (:func:`quantize_per_token`: ``xq``, ``s_x``),
    the exact integer sums ``acc = xq @ q^T`` (in float64, exact below 2^53), then in fp32
    ``y = (acc * s_w[n]) * s_x[m] + bias[n]``, returned in x's dtype: what ``cbatch::
    quantized_linear_w8a8`` computes, bit for bit without a bias (with one, the kernel fuses
    the last multiply and the add into one rounding).  qweight: :func:`unpack_w8a8`'s
    layout; scales: fp32 ``[1, N16]``, one per output channel."""
    N = out_features
    q = unpack_w8a8(qweight, N, x.shape[-1])
    xq, sx = quantize_per_token(x)
    acc = xq.double() @ q.double().t()  # [M, N], exact
    y = acc.float() * scales[0, :N] * sx[:, None]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def quantize_per_group(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_per_token`'s rule per token and per group of ``group_size`` k (W4A8's
    activations, as ``cbatch::quantized_linear_w4a8`` quantizes them; llama.cpp's Q8_0 with
    its blocks of 32): per row of x ``[M, K]`` and group ``g`` (k in ``[g gs, (g + 1) gs)``,
    the last group cut at K), in fp32, ``a = max |x|``, ``q = round(x * (127 / a))`` (ties to
    even) and ``scale = a / 127``; a group of zeros gets q 0 and scale 0.  Returns int8
    ``[M, K]`` and fp32 ``[M, G]``."""
    M, K = x.shape
    G = -(-K // group_size)
    xf = torch.nn.functional.pad(x.float(), (0, G * group_size - K)).view(M, G, group_size)
    top = xf.abs().amax(dim=-1)  # [M, G]
    levels = torch.full_like(top, 127.0)
    inv = torch.where(top > 0, levels / top, torch.zeros_like(top))
    q = (xf * inv[..., None]).round().clamp(-127, 127).to(torch.int8)
    return q.view(M, G * group_size)[:, :K], top / levels


def unpack_w4a8(qweight: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """int32 ``q [N, K]`` in [-8, 7] from the W4A8 layout (``cbatch::quantized_linear_w4a8``'s
    weight, :func:`cbatch.layers.quantization.weight.pack_w4a8`): uint8 ``[N16 / 16, Q, 32]``,
    byte ``[b, i, 4 j + t]`` holding ``q[16 b + j, 4 i + t] + 8`` in its low nibble and
    ``q[16 b + 8 + j, 4 i + t] + 8`` in its high one."""
    blocks, quads, _ = qweight.shape
    u = qweight.view(blocks, quads, 8, 4).to(torch.int32)  # [b, i, j, t]
    halves = torch.stack((u & 15, u >> 4), dim=2)  # [b, i, half, j, t]: column 8 half + j
    q = halves.permute(0, 2, 3, 1, 4).reshape(blocks * 16, quads * 4)
    return q[:out_features, :in_features] - 8


def unpack_w8a8g(qweight: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """int32 ``q [N, K]`` from the 8-bit layout of ``cbatch::quantized_linear_w4a8``
    (:func:`cbatch.layers.quantization.weight.pack_w8a8g`): int8 ``[N16 / 16, Q, 64]``, byte
    ``[b, i, 32 half + 4 j + t]`` holding ``q[16 b + 8 half + j, 4 i + t]``."""
    blocks, quads, _ = qweight.shape
    q = qweight.view(blocks, quads, 2, 8, 4).to(torch.int32)  # [b, i, half, j, t]
    q = q.permute(0, 2, 3, 1, 4).reshape(blocks * 16, quads * 4)
    return q[:out_features, :in_features]


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` on fp32 tensors (broadcast) rounded once to fp32, as ``vfmadd`` rounds
    it (to nearest even).  The product of two fp32 is exact in float64 (48 bits); the sum is
    rounded to float64 and then to fp32, which is the fma's rounding except where the float64
    sum lands exactly on a midpoint of two fp32 that the exact sum is not on: there the exact
    sum's error (TwoSum, exact in float64) says which side it lies."""
    p = a.double() * b.double()
    cd = c.double()
    s = p + cd
    bb = s - p
    err = (p - (s - bb)) + (cd - bb)  # s + err == p + c exactly
    r = s.float()
    toward = torch.where(s > r.double(), math.inf, -math.inf).float()
    other = torch.nextafter(r, toward)  # r's neighbour on s's side
    mid = (r.double() + other.double()) * 0.5  # exact
    tie = (s != r.double()) & (s == mid) & (err != 0)
    past = (err > 0) == (other > r)  # the exact sum lies beyond the midpoint, toward other
    return torch.where(tie & past, other, r)


def quantized_linear_w4a8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                          group_size: int, out_features: int, bias: torch.Tensor | None,
                          zeros: torch.Tensor | None = None, mins: torch.Tensor | None = None
                          ) -> torch.Tensor:
    """W4A8: x ``[M, K]`` quantized per token and group (:func:`quantize_per_group`: ``xq``,
    ``s_x [M, G]``), each group's exact integer sums ``S[m, n, g]`` (in float64, exact below
    2^53), then in fp32, the groups in order from 0, ``y = fma(S, fl(s_w[g, n] * s_x[m, g]),
    y)`` (:func:`fma32`: one rounding; S rounded to fp32 first where it passes 2^24) and ``+
    bias[n]`` last, returned in x's dtype: what ``cbatch::quantized_linear_w4a8`` computes, bit
    for bit (llama.cpp's order: its block's two scales multiplied, then one fma).  qweight:
    :func:`unpack_w4a8`'s layout; scales: fp32 ``[G, N16]``; zeros: None (the weight's
    integers are the nibbles less 8) or int8 ``[G, N16]`` (the nibbles less ``zeros[g, n]``).
    An int8 qweight holds 8-bit weights (:func:`unpack_w8a8g`'s layout; W8A8 per group): the
    integers as they are (zero point 0), or less ``zeros[g, n]``; the rest alike.

    mins: None, or fp32 ``[G, N16]`` (``zeros`` None; ``W = s_w u - m``, u the nibble in
    0..15 as it is): ``S`` is then ``sum xq u``, and after each group's fma

        y = fma(-mins[g, n], c[m, g], y),   c[m, g] = fl(Sx[m, g] * s_x[m, g]),

    ``Sx`` the group's sum of xq (exact): ``c`` is the row's quantized x summed over the group
    (llama.cpp's Q8_1 ``s``, its Q8_K ``bsums``), one number per row and group."""
    M, K = x.shape
    N, G = out_features, scales.shape[0]
    pad = G * group_size - K
    if qweight.dtype == torch.int8:  # 8-bit: the stored integer, zero point 0
        stored, zero = unpack_w8a8g(qweight, N, K), 0
    else:  # 4-bit: the nibble, zero point 8
        stored, zero = unpack_w4a8(qweight, N, K) + 8, 8
    q = torch.nn.functional.pad(stored, (0, pad)).view(N, G, group_size)
    z = zero if zeros is None else zeros[:, :N].t().to(torch.int32)[:, :, None]
    q = q - (0 if mins is not None else z)  # mins: the stored integer as it is
    xq, sx = quantize_per_group(x, group_size)
    xq = torch.nn.functional.pad(xq, (0, pad)).view(M, G, group_size)
    S = torch.einsum("mgk,ngk->mng", xq.double(), q.double())  # [M, N, G], exact
    c = xq.sum(dim=-1, dtype=torch.int32).float() * sx if mins is not None else None  # [M, G]
    y = torch.zeros(M, N, dtype=torch.float32, device=x.device)
    for g in range(G):
        y = fma32(S[:, :, g].float(), scales[g, :N] * sx[:, g, None], y)
        if c is not None:
            y = fma32(-mins[g, :N], c[:, g, None], y)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
