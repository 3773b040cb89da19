"""Quantized GEMMs in Triton on cbatch's packed weights (``cbatch.layers.quantization.weight``):
``y = x @ dequant(W).T + bias``, read from the layout the CPU kernel reads, with no repack.

The packed layout suits ``tl.dot``: a block of 16 output columns is ``K`` rows of 16 bytes
(int8) or ``ceil(K / 2)`` rows of 16 bytes (int4, k = 2i in the low nibble, 2i + 1 in the
high one) one after the other, so a ``[BLOCK_K, BLOCK_N]`` tile is ``BLOCK_N / 16`` contiguous
runs of ``16 BLOCK_K`` (or ``8 BLOCK_K``) bytes.

- :func:`wna16_linear` (W8A16, W4A16): x fp16/bf16/fp32; the integers ``q - z`` are exact in
  x's dtype, so the tensor cores take them as they are and the tile's fp32 product is scaled
  by its group's scale after the dot (when a tile lies in one group: ``group_size`` a multiple
  of ``BLOCK_K``, or one group); otherwise each weight is ``s (q - z)`` in fp32, rounded to
  x's dtype for the dot.  An int4 tile is two dots, the even k against the low nibbles and the
  odd k against the high ones.  With mins (``W = s q - m``, no zero point) a tile in one
  group takes ``q`` as it is and subtracts ``m`` times its rows' sums of x after the scaled
  dot; a tile across groups takes ``s q - m`` per weight.
- :func:`scaled_int8_quant` (vLLM's name): x quantized per token as
  :func:`cbatch.ops.reference.quantize_per_token` does it, bit for bit: ``a = max |x_row|``,
  ``x_q = round-half-even(x * (127 / a))`` with one correctly rounded division,
  ``s_x = a / 127`` (a row of zeros: 0 and 0).
- :func:`w8a8_linear`: the W8A8 layout of ``QuantizedLinear(act_bits=8)``
  (:func:`cbatch.layers.quantization.weight.pack_w8a8`: a column's 4 consecutive k in one
  4-byte lane, each + 128), read as it is: int8 x int8 ``tl.dot`` with the row's exact sum in
  int32 over all of K, then ``(acc * s_w) * s_x + bias`` in fp32:
  :func:`cbatch.ops.reference.quantized_linear_w8a8`'s arithmetic, bit for bit.  Both launch
  without fp contraction (``enable_fp_fusion=False``), so that no multiply and add fuse into
  one rounding the reference does not make.

fp32 accumulation for W8A16/W4A16; M is kept out of Triton's integer specialization (one
compiled kernel for every row count of a shape class).  The tile sizes are untuned heuristics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cbatch.kernels._utils import upcast

BLOCK = 16  # output columns per packed block (cbatch.layers.quantization.weight.BLOCK)
_RINT = 12582912.0  # 1.5 * 2^23: (v + _RINT) - _RINT is v rounded half-to-even, |v| < 2^22


@triton.jit
def _scale_row(scales_ptr, zeros_ptr, g, offs_n, mask_n, stride_s_g, ZERO: tl.constexpr,
               HAS_ZEROS: tl.constexpr):
    """Group ``g``'s scales and zero points of the columns ``offs_n`` (fp32 ``[BLOCK_N]``)."""
    s = tl.load(scales_ptr + g * stride_s_g + offs_n, mask=mask_n, other=0.0)
    if HAS_ZEROS:
        z = tl.load(zeros_ptr + g * stride_s_g + offs_n, mask=mask_n, other=0).to(tl.float32)
    else:
        z = tl.zeros_like(s) + ZERO
    return s, z


@triton.jit
def _weight_tile(q, k, offs_n, mask, scales_ptr, zeros_ptr, mins_ptr, group_size, stride_s_g,
                 ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr):
    """``s (q - z)`` (with mins ``s q - m``) in fp32 of a ``[BLOCK_K, BLOCK_N]`` tile whose k
    (``k [BLOCK_K]``) span several groups: scales and zero points (mins) gathered per
    element."""
    g = (k // group_size)[:, None] * stride_s_g + offs_n[None, :]
    s = tl.load(scales_ptr + g, mask=mask, other=0.0)
    if HAS_MINS:
        return s * q.to(tl.float32) - tl.load(mins_ptr + g, mask=mask, other=0.0)
    if HAS_ZEROS:
        z = tl.load(zeros_ptr + g, mask=mask, other=0).to(tl.float32)
    else:
        z = ZERO
    return s * (q.to(tl.float32) - z)


@triton.jit
def _less_mins(acc, x_sum, mins_ptr, g, offs_n, mask_n, stride_s_g):
    """``acc - x_sum m``: a tile in group ``g`` less its mins times its rows' sums of x
    (``x_sum [BLOCK_M]``), ``W = s q - m``."""
    m = tl.load(mins_ptr + g * stride_s_g + offs_n, mask=mask_n, other=0.0)
    return acc - x_sum[:, None] * m[None, :]


@triton.jit(do_not_specialize=["M"])
def _wna16_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, mins_ptr, bias_ptr, out_ptr,
    M, N, K, group_size,
    stride_x_m, stride_o_m, stride_q_b, stride_s_g,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr,
    SCALE_PER_TILE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # a symmetric weight's zero point (with mins none: q as it is)
    ZERO: tl.constexpr = 8 if BITS == 4 and not HAS_MINS else 0
    dot_dtype = tl.float32 if UPCAST else x_ptr.dtype.element_ty
    # column n's bytes: its block's rows, then its lane in the 16 of a row
    q_col = (offs_n // 16).to(tl.int64) * stride_q_b + offs_n % 16  # [BLOCK_N]
    x_row = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x_m  # [BLOCK_M, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    HALF: tl.constexpr = BLOCK_K // 2
    for k0 in range(0, K, BLOCK_K):
        if BITS == 8:
            k = k0 + tl.arange(0, BLOCK_K)
            mask_k = k < K
            x = tl.load(x_row + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            mask_w = mask_k[:, None] & mask_n[None, :]
            q = tl.load(qweight_ptr + q_col[None, :] + k[:, None] * 16, mask=mask_w,
                        other=0)  # [BLOCK_K, BLOCK_N] int8
            if SCALE_PER_TILE:
                s, z = _scale_row(scales_ptr, zeros_ptr, k0 // group_size, offs_n, mask_n,
                                  stride_s_g, ZERO, HAS_ZEROS)
                w = (q.to(tl.float32) - z[None, :]).to(dot_dtype)  # integers: exact
                part = tl.dot(x.to(dot_dtype), w, input_precision=PRECISION)
                acc += part * s[None, :]
                if HAS_MINS:
                    acc = _less_mins(acc, tl.sum(x.to(tl.float32), axis=1), mins_ptr,
                                     k0 // group_size, offs_n, mask_n, stride_s_g)
            else:
                w = _weight_tile(q, k, offs_n, mask_w, scales_ptr, zeros_ptr, mins_ptr,
                                 group_size, stride_s_g, ZERO, HAS_ZEROS,
                                 HAS_MINS).to(dot_dtype)
                acc = tl.dot(x.to(dot_dtype), w, acc, input_precision=PRECISION)
        else:
            i = k0 // 2 + tl.arange(0, HALF)  # byte rows: k = 2i (low nibble), 2i + 1 (high)
            even, odd = 2 * i, 2 * i + 1
            x_even = tl.load(x_row + even[None, :], mask=mask_m[:, None] & (even < K)[None, :],
                             other=0.0)  # [BLOCK_M, HALF]
            x_odd = tl.load(x_row + odd[None, :], mask=mask_m[:, None] & (odd < K)[None, :],
                            other=0.0)
            mask_w = (even < K)[:, None] & mask_n[None, :]
            byte = tl.load(qweight_ptr + q_col[None, :] + i[:, None] * 16, mask=mask_w,
                           other=0)  # [HALF, BLOCK_N] uint8
            low = byte & 15
            high = byte >> 4
            if SCALE_PER_TILE:
                s, z = _scale_row(scales_ptr, zeros_ptr, k0 // group_size, offs_n, mask_n,
                                  stride_s_g, ZERO, HAS_ZEROS)
                w_even = (low.to(tl.float32) - z[None, :]).to(dot_dtype)
                w_odd = (high.to(tl.float32) - z[None, :]).to(dot_dtype)
                part = tl.dot(x_even.to(dot_dtype), w_even, input_precision=PRECISION)
                part = tl.dot(x_odd.to(dot_dtype), w_odd, part, input_precision=PRECISION)
                acc += part * s[None, :]
                if HAS_MINS:
                    x_sum = tl.sum(x_even.to(tl.float32), axis=1) + \
                        tl.sum(x_odd.to(tl.float32), axis=1)
                    acc = _less_mins(acc, x_sum, mins_ptr, k0 // group_size, offs_n, mask_n,
                                     stride_s_g)
            else:  # a group holds pairs of k (group_size even): both nibbles share it
                w_even = _weight_tile(low, even, offs_n, mask_w, scales_ptr, zeros_ptr,
                                      mins_ptr, group_size, stride_s_g, ZERO, HAS_ZEROS,
                                      HAS_MINS).to(dot_dtype)
                w_odd = _weight_tile(high, even, offs_n, mask_w, scales_ptr, zeros_ptr,
                                     mins_ptr, group_size, stride_s_g, ZERO, HAS_ZEROS,
                                     HAS_MINS).to(dot_dtype)
                acc = tl.dot(x_even.to(dot_dtype), w_even, acc, input_precision=PRECISION)
                acc = tl.dot(x_odd.to(dot_dtype), w_odd, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_o_m + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _scaled_int8_quant_kernel(x_ptr, x_q_ptr, scale_ptr, K, stride_x_m, stride_q_m,
                              RINT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    top = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x_m + k, mask=k < K, other=0.0).to(tl.float32)
        top = tl.maximum(top, tl.abs(x))
    amax = tl.max(top, axis=0)
    inv = tl.where(amax > 0, tl.math.div_rn(127.0, tl.maximum(amax, 1e-30)), 0.0)
    tl.store(scale_ptr + row, tl.math.div_rn(amax, 127.0))
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x_m + k, mask=k < K, other=0.0).to(tl.float32)
        v = x * inv  # |v| <= 127 (up to rounding): the magic number rounds it half-to-even
        v = tl.minimum(tl.maximum((v + RINT) - RINT, -127.0), 127.0)
        tl.store(x_q_ptr + row * stride_q_m + k, v.to(tl.int8), mask=k < K)


@triton.jit(do_not_specialize=["M"])
def _w8a8_kernel(
    x_q_ptr, x_scale_ptr, qweight_ptr, scales_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_x_m, stride_o_m, stride_q_b,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # column n's lane: its block's rows of 64 bytes (4 k of 16 columns), then 4 bytes a column
    q_col = (offs_n // 16).to(tl.int64) * stride_q_b + (offs_n % 16) * 4  # [BLOCK_N]
    x_row = x_q_ptr + offs_m.to(tl.int64)[:, None] * stride_x_m  # [BLOCK_M, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        mask_k = k < K
        x = tl.load(x_row + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0)
        u = tl.load(qweight_ptr + q_col[None, :] + (k // 4 * 64 + k % 4)[:, None],
                    mask=mask_k[:, None] & mask_n[None, :], other=128)  # [BLOCK_K, BLOCK_N]
        q = (u.to(tl.int32) - 128).to(tl.int8)
        acc = tl.dot(x, q, acc, out_dtype=tl.int32)  # exact: |acc| <= 127 * 128 * K < 2^31
    s = tl.load(scales_ptr + offs_n, mask=mask_n, other=0.0)
    y = acc.to(tl.float32) * s[None, :]
    y = y * tl.load(x_scale_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_o_m + offs_n[None, :],
             y.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def tile_config(M: int, bits: int, K: int, group_size: int) -> tuple[int, int, int, bool]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, scale_per_tile)`` for a launch: 16 rows (decode) or 64
    (prefill) a tile; BLOCK_K the largest of 128, 64, 32 that divides ``group_size`` (any,
    with one group), so that a tile lies in one group; else 32, with per-weight scales."""
    block_m = 16 if M <= 16 else 64
    block_n = 32 if M <= 16 else 64
    if group_size >= K:
        return block_m, block_n, 64 if M > 16 else 128, True
    for block_k in (128, 64, 32):
        if group_size % block_k == 0:
            return block_m, block_n, block_k, True
    return block_m, block_n, 32, False


def check_packed(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None, bits: int, group_size: int, out_features: int,
                 bias: torch.Tensor | None, mins: torch.Tensor | None = None) -> None:
    """A sentence, not a fault, for operands that are not one packed weight and its x."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K] with dense rows, got {tuple(x.shape)} strides "
                         f"{x.stride()}")
    K, N = x.shape[1], out_features
    if bits not in (4, 8):
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    blocks, rows = -(-N // BLOCK), (K if bits == 8 else -(-K // 2))
    dtype = torch.int8 if bits == 8 else torch.uint8
    if qweight.dtype != dtype or tuple(qweight.shape) != (blocks, rows, BLOCK) \
            or not qweight.is_contiguous():
        raise ValueError(f"qweight does not hold {bits}-bit {N} x {K}: want dense {dtype} "
                         f"[{blocks}, {rows}, {BLOCK}], got {qweight.dtype} "
                         f"{list(qweight.shape)}")
    if group_size < 1 or (bits == 4 and group_size < K and group_size % 2):
        raise ValueError(f"group_size must be >= 1 (even for 4 bits), got {group_size}")
    groups = -(-K // group_size)
    shape = (groups, blocks * BLOCK)
    if scales.dtype != torch.float32 or tuple(scales.shape) != shape \
            or not scales.is_contiguous():
        raise ValueError(f"scales must be a dense float32 {list(shape)}, got {scales.dtype} "
                         f"{list(scales.shape)}")
    if zeros is not None and (zeros.dtype != torch.int8 or tuple(zeros.shape) != shape
                              or not zeros.is_contiguous()):
        raise ValueError(f"zeros must be a dense int8 {list(shape)}, got {zeros.dtype} "
                         f"{list(zeros.shape)}")
    if mins is not None:
        if zeros is not None:
            raise ValueError("mins and zeros exclude each other: a weight with mins has no "
                             "zero point (zeros must be None)")
        if mins.dtype != torch.float32 or tuple(mins.shape) != shape \
                or not mins.is_contiguous():
            raise ValueError(f"mins must be a dense float32 {list(shape)}, got {mins.dtype} "
                             f"{list(mins.shape)}")
    if bias is not None and (tuple(bias.shape) != (N,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a dense [{N}], got {list(bias.shape)}")
    devices = {t.device for t in (x, qweight, scales, zeros, mins, bias) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"operands on several devices: {sorted(map(str, devices))}")


def wna16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None, bits: int, group_size: int, out_features: int,
                 bias: torch.Tensor | None = None, mins: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """W8A16 / W4A16: ``x [M, K]`` (fp16, bf16 or fp32, dense rows) times the packed weight's
    transpose plus ``bias [N]`` → ``[M, N]`` in x's dtype (``cbatch::quantized_linear``'s
    operands and contract, ``mins`` included; fp32 accumulation)."""
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    check_packed(x, qweight, scales, zeros, bits, group_size, out_features, bias, mins)
    M, K = x.shape
    N = out_features
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(M, N))
    block_m, block_n, block_k, per_tile = tile_config(M, bits, K, group_size)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _wna16_kernel[grid](
        x, qweight, scales, scales if zeros is None else zeros,
        scales if mins is None else mins, scales if bias is None else bias, out,
        M, N, K, group_size,
        x.stride(0), out.stride(0), qweight.stride(0), scales.stride(0),
        BITS=bits, HAS_ZEROS=zeros is not None, HAS_MINS=mins is not None,
        HAS_BIAS=bias is not None,
        SCALE_PER_TILE=per_tile, UPCAST=upcast(x.dtype),
        PRECISION="ieee" if upcast(x.dtype) else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=3,
    )
    return out


def scaled_int8_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token int8 quantization of ``x [M, K]`` (any float dtype, dense rows) →
    ``(x_q int8 [M, K], scale fp32 [M, 1])`` with ``x ~ scale * x_q`` (vLLM's
    ``scaled_int8_quant`` shapes; :func:`cbatch.ops.reference.quantize_per_token`'s values)."""
    if x.dim() != 2 or x.stride(1) != 1 or not x.is_floating_point():
        raise ValueError(f"x must be a float [M, K] with dense rows, got {x.dtype} "
                         f"{tuple(x.shape)}")
    M, K = x.shape
    x_q = torch.empty((M, K), dtype=torch.int8, device=x.device)
    scale = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M == 0:
        return x_q, scale
    _scaled_int8_quant_kernel[(M,)](x, x_q, scale, K, x.stride(0), x_q.stride(0),
                                    RINT=_RINT, BLOCK=min(1024, triton.next_power_of_2(max(K, 1))),
                                    enable_fp_fusion=False)
    return x_q, scale


# the largest K whose int32 sums cannot overflow: 127 * 128 * K < 2^31
W8A8_MAX_K = (2**31 - 1) // (127 * 128)


def w8a8_linear(x_q: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor,
                scales: torch.Tensor, out_features: int, bias: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
    """W8A8: ``x_q`` int8 ``[M, K]`` and ``x_scale`` fp32 ``[M, 1]`` (:func:`scaled_int8_quant`'s)
    times the W8A8 weight (``qweight`` uint8 ``[N16 / 16, ceil(K / 4), 64]``, ``pack_w8a8``'s;
    ``scales`` fp32 ``[1, N16]``) plus ``bias [N]`` → ``[M, N]`` in ``out_dtype``."""
    if x_q.dtype != torch.int8 or x_q.dim() != 2 or x_q.stride(1) != 1:
        raise ValueError(f"x_q must be an int8 [M, K] with dense rows, got {x_q.dtype} "
                         f"{tuple(x_q.shape)}")
    M, K = x_q.shape
    N = out_features
    blocks, quads = -(-N // BLOCK), -(-K // 4)
    if qweight.dtype != torch.uint8 or tuple(qweight.shape) != (blocks, quads, 4 * BLOCK) \
            or not qweight.is_contiguous():
        raise ValueError(f"qweight does not hold a W8A8 {N} x {K}: want dense uint8 "
                         f"[{blocks}, {quads}, {4 * BLOCK}], got {qweight.dtype} "
                         f"{list(qweight.shape)}")
    if scales.dtype != torch.float32 or tuple(scales.shape) != (1, blocks * BLOCK) \
            or not scales.is_contiguous():
        raise ValueError(f"scales must be a dense float32 [1, {blocks * BLOCK}] (one per "
                         f"output channel), got {scales.dtype} {list(scales.shape)}")
    if x_scale.dtype != torch.float32 or x_scale.numel() != M or not x_scale.is_contiguous():
        raise ValueError(f"x_scale must be a dense float32 [{M}, 1], got {x_scale.dtype} "
                         f"{list(x_scale.shape)}")
    if bias is not None and (tuple(bias.shape) != (N,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a dense [{N}], got {list(bias.shape)}")
    if K > W8A8_MAX_K:
        raise ValueError(f"W8A8 sums K in int32: K must be at most {W8A8_MAX_K}, got {K}")
    out = torch.empty((M, N), dtype=out_dtype, device=x_q.device)
    if M == 0 or N == 0:
        return out
    block_m, block_n, block_k, _ = tile_config(M, 8, K, K)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _w8a8_kernel[grid](
        x_q, x_scale, qweight, scales, scales if bias is None else bias, out,
        M, N, K,
        x_q.stride(0), out.stride(0), qweight.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=3,
        enable_fp_fusion=False,
    )
    return out
