"""The Triton quantized GEMMs (kernels/quant_matmul.py: W8A16, W4A16, W8A8 and its per-token
quantization) against their oracle, dequantize-then-matmul in float64 from the unpacked
integers, on the GPU or, without one, on CPU tensors in Triton's interpreter.

The bound, as for the CPU kernel (tests/ops/test_quantized_linear.py): every term of the
exact result meets at most K + 3 fp32 roundings in the kernel (a tile's products are exact,
its sum scaled once by its group's scale, the tiles and the bias added) and the oracle's fp32
weight s (q - z) one more, so |y - y_fp64| <= gamma_{K+4} (|x| @ |W|^T + |bias|), gamma_n =
n u / (1 - n u), u = 2^-24; a 16-bit output adds its rounding (2^-8 |y| bf16, 2^-11 fp16;
2^-7 for bf16 in the interpreter, whose fp32 -> bf16 conversion truncates).
On a GPU a tile that spans several groups takes s (q - z) rounded to x's 16-bit dtype into
its dot: 2^-8 (2^-11) |x| @ |W|^T more.

With float mins (W = s q - m, no zero point) a tile in one group subtracts m times its rows'
sums of x after its scaled dot, two more roundings of the running sum a tile: n = K + 2T + 8,
T = ceil(K / 32) tiles at most, against the exact x @ (s q - m)^T, the size |x| @ (|s q| +
|m|)^T; a tile across groups takes s q - m per weight (rounded to x's 16-bit dtype on a GPU).

W8A8 (its weight in pack_w8a8's layout, as QuantizedLinear(act_bits=8) holds it) makes the
reference's roundings and no other (exact int32 sums; no fused multiply-add): its per-token
quantization equals cbatch.ops.reference.quantize_per_token bit for bit, and its product
reference.quantized_linear_w8a8's (the interpreter's bf16 output: within its truncation);
and it is within the bound above of the float64 product of x_scale * x_q and the weight.
"""

import pytest
import torch

from cbatch.layers.quantization import QuantizedLinear
from cbatch.layers.quantization.weight import pack_w8a8
from cbatch.ops import reference
from cbatch.ops import quantized
from cbatch.quantization import Scheme
from tests.helpers import triton_device, triton_skip_reason
from tests.quant_utils import (quantize_with_mins, random_quantized, random_with_mins,
                               unpacked_weight, weight_with_mins)

U = 2.0 ** -24
ROUNDING = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


@pytest.fixture(scope="module")
def device():
    device = triton_device()
    if device is None:
        pytest.skip(triton_skip_reason())
    from cbatch.ops import triton as _  # noqa: F401  (registers the cbatch_triton ops)

    return device


def _random_quantized(N, K, bits, group_size, zeros, gen):
    """A packed weight (:func:`tests.quant_utils.random_quantized`) and its float64 weight."""
    qw, parts = random_quantized(N, K, bits, group_size, zeros, gen)
    return qw, unpacked_weight(*parts, bits, group_size)


def _check(x, w, bias, ours, weight_rounding=0.0):
    """``ours`` within the module docstring's bound of ``x @ w.T + bias`` in float64."""
    b = 0 if bias is None else bias.double()
    truth = x.double() @ w.t() + b
    n = x.shape[1] + 4
    size = x.double().abs() @ w.abs().t()
    bound = n * U / (1 - n * U) * (size + abs(b)) + weight_rounding * size
    rounding = ROUNDING[ours.dtype]
    if ours.device.type == "cpu" and ours.dtype == torch.bfloat16:
        rounding *= 2  # the interpreter's fp32 -> bf16 truncates
    bound = bound + rounding * truth.abs()
    err = (ours.double().cpu() - truth).abs()
    assert (err <= bound * 1.001 + 1e-30).all(), (err - bound).max()


# (N, K): odd K and N, one column, K of one element, K across group edges; more k and
# several column tiles (slow in the interpreter)
WIDE = [pytest.param(17, 300, marks=pytest.mark.slow), pytest.param(130, 257,
                                                                    marks=pytest.mark.slow)]
SHAPES = [(1, 1), (5, 3), (33, 129), *WIDE]


@pytest.mark.parametrize("bits,group_size", [(8, None), (8, 7), (8, 128), (4, 128), (4, 32),
                                             (4, 6), (4, None)])
@pytest.mark.parametrize("N,K", SHAPES)
def test_wna16_matches_dequantize_then_matmul(device, bits, group_size, N, K):
    """W8A16 and W4A16: M = 1, 3, 17 in fp32, bf16 and fp16, with and without zero points and
    bias; groups of whole tiles (32, 128, one) and of a few k (7, 6: per-weight scales)."""
    gen = torch.Generator().manual_seed(N * 1000 + K + bits)
    gs = K if group_size is None else group_size
    if bits == 4 and gs % 2 and gs < K:
        pytest.skip("int4 groups hold pairs of k")
    per_tile = qlinear_tile(bits, K, gs)
    for zeros, dtype, M, bias in ((False, torch.float32, 1, False),
                                  (True, torch.float32, 3, True),
                                  (False, torch.bfloat16, 17, True),
                                  (True, torch.float16, 3, False)):
        qw, w = _random_quantized(N, K, bits, gs, zeros, gen)
        x = torch.randn(M, K, generator=gen).to(dtype)
        b = (torch.randn(N, generator=gen) * 0.1).to(dtype) if bias else None
        args = [t.to(device) if t is not None else None
                for t in (x, qw.qweight, qw.scales, qw.zeros)]
        ours = torch.ops.cbatch_triton.quantized_linear(
            *args, bits, gs, N, None if b is None else b.to(device))
        assert ours.dtype == dtype and ours.shape == (M, N)
        gpu_rounding = ROUNDING[dtype] if device == "cuda" and not per_tile else 0.0
        _check(x, w, b, ours, gpu_rounding)
        torch.testing.assert_close(ours.cpu(), reference.quantized_linear(
            x, qw.qweight, qw.scales, qw.zeros, bits, gs, N, b),
            rtol=1e-4 if dtype == torch.float32 else 2e-2,
            atol=1e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("bits,group_size", [(8, None), (8, 7), (8, 32), (4, 64), (4, 32),
                                             (4, 6)])
@pytest.mark.parametrize("N,K", SHAPES)
def test_wna16_with_mins_matches_the_exact_product(device, bits, group_size, N, K):
    """W = s q - m (int4's q as stored): M = 1, 3, 17 in fp32, bf16 and fp16, with and without
    bias; tiles in one group (32, 64, one) and across groups (7, 6: per-weight s q - m)."""
    gen = torch.Generator().manual_seed(N * 1000 + K + bits + 1)
    gs = K if group_size is None else group_size
    if bits == 4 and gs % 2 and gs < K:
        pytest.skip("int4 groups hold pairs of k")
    per_tile = qlinear_tile(bits, K, gs)
    qw, (q, s, m) = random_with_mins(N, K, bits, gs, gen)
    g = torch.arange(K) // gs
    for dtype, M, bias in ((torch.float32, 1, False), (torch.float32, 3, True),
                           (torch.bfloat16, 17, True), (torch.float16, 3, False)):
        x = torch.randn(M, K, generator=gen).to(dtype)
        b = (torch.randn(N, generator=gen) * 0.1).to(dtype) if bias else None
        ours = torch.ops.cbatch_triton.quantized_linear(
            x.to(device), qw.qweight.to(device), qw.scales.to(device), None, bits, gs, N,
            None if b is None else b.to(device), qw.mins.to(device))
        assert ours.dtype == dtype and ours.shape == (M, N)
        bb = 0 if b is None else b.double()
        truth = x.double() @ weight_with_mins(q, s, m, gs).t() + bb
        size = x.double().abs() @ (s[g].t().double() * q.double().abs()
                                   + m[g].t().double().abs()).t()
        n = K + 2 * -(-K // 32) + 8
        bound = n * U / (1 - n * U) * (size + abs(bb))
        if device == "cuda" and not per_tile:
            bound = bound + ROUNDING[dtype] * size
        rounding = ROUNDING[dtype] * (2 if device == "cpu" and dtype == torch.bfloat16 else 1)
        err = (ours.double().cpu() - truth).abs()
        assert (err <= (bound + rounding * truth.abs()) * 1.001 + 1e-30).all()
        torch.testing.assert_close(ours.cpu(), reference.quantized_linear(
            x, qw.qweight, qw.scales, None, bits, gs, N, b, qw.mins),
            rtol=1e-4 if dtype == torch.float32 else 2e-2,
            atol=1e-4 if dtype == torch.float32 else 2e-2)


def qlinear_tile(bits, K, group_size) -> bool:
    """Whether the kernel scales whole tiles (else each weight) for this weight."""
    from cbatch.kernels import quant_matmul

    return quant_matmul.tile_config(1, bits, K, group_size)[3]


def test_scaled_int8_quant_is_the_references(device):
    """a = max |x_row|, x_q = round-half-even(x * (127 / a)), scale a / 127 (a row of zeros:
    0 and 0): reference.quantize_per_token's, bit for bit, in fp32, bf16 and fp16."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = (torch.randn(6, 1500, generator=gen) * 3).to(dtype)
        x[2] = 0
        x[3, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])  # 127 / a = 1: ties at the halves
        x[3, 4:] = 0
        x_q, scale = torch.ops.cbatch_triton.scaled_int8_quant(x.to(device))
        want_q, want_scale = reference.quantize_per_token(x)
        assert scale.shape == (6, 1) and torch.equal(scale.cpu().view(6), want_scale)
        assert x_q.dtype == torch.int8 and torch.equal(x_q.cpu(), want_q)
        assert x_q[3, :4].tolist() == [127, 0, 2, -2] and scale[2].item() == 0


@pytest.mark.parametrize("N,K", SHAPES)
def test_w8a8_is_the_references(device, N, K):
    """int8 x int8 on pack_w8a8's layout: M = 1, 3, 17, fp32, bf16 and fp16, with and without
    bias; reference.quantized_linear_w8a8's result bit for bit, and within the bound of the
    float64 product."""
    gen = torch.Generator().manual_seed(N + K)
    for dtype, M, bias in ((torch.float32, 1, True), (torch.bfloat16, 3, False),
                           (torch.float16, 17, True), (torch.float32, 17, False)):
        qw, w = _random_quantized(N, K, 8, K, False, gen)
        qweight = pack_w8a8(qw)
        x = torch.randn(M, K, generator=gen).to(dtype)
        x[M // 2] = 0  # a row of zeros: scale 0
        b = (torch.randn(N, generator=gen) * 0.1).to(dtype) if bias else None
        x_q, x_scale = torch.ops.cbatch_triton.scaled_int8_quant(x.to(device))
        ours = torch.ops.cbatch_triton.w8a8_linear(
            x_q, x_scale, qweight.to(device), qw.scales.to(device), N,
            None if b is None else b.to(device), dtype)
        assert ours.dtype == dtype and ours.shape == (M, N)
        want = reference.quantized_linear_w8a8(x, qweight, qw.scales, N, b)
        if ours.device.type == "cpu" and dtype == torch.bfloat16:  # the interpreter truncates
            torch.testing.assert_close(ours, want, rtol=2.0 ** -7, atol=0)
        else:
            assert torch.equal(ours.cpu(), want)
        _check(x_q.cpu().double() * x_scale.cpu().double(), w, b, ours)


def test_w8a8_refuses_what_it_does_not_run(device):
    qw, _ = _random_quantized(24, 100, 8, 100, False, torch.Generator().manual_seed(0))
    x_q = torch.zeros(2, 100, dtype=torch.int8, device=device)
    x_scale = torch.ones(2, 1, device=device)
    args = (x_q, x_scale, pack_w8a8(qw).to(device), qw.scales.to(device), 24, None,
            torch.float32)
    with pytest.raises(ValueError, match="qweight does not hold a W8A8 24 x 100"):
        torch.ops.cbatch_triton.w8a8_linear(x_q, x_scale, qw.qweight.to(device), *args[3:])
    with pytest.raises(ValueError, match="x_scale must be a dense float32 \\[2, 1\\]"):
        torch.ops.cbatch_triton.w8a8_linear(x_q, x_scale[:1], *args[2:])
    with pytest.raises(ValueError, match="x_q must be an int8"):
        torch.ops.cbatch_triton.w8a8_linear(x_q.float(), *args[1:])


@pytest.mark.parametrize("change,match", [
    (dict(bits=5), "bits must be 8 or 4"),
    (dict(out_features=40), "does not hold 4-bit 40 x 66"),
    (dict(group_size=33), "group_size must be >= 1 \\(even for 4 bits\\)"),
    (dict(scales=torch.zeros(3, 32, dtype=torch.float16)), "scales must be a dense float32"),
    (dict(zeros=torch.zeros(2, 32, dtype=torch.int8)), "zeros must be a dense int8 \\[3, 32\\]"),
    (dict(x=torch.zeros(3, 66, dtype=torch.int32)), "x must be float16, bfloat16 or float32"),
    (dict(x=torch.zeros(66, 3).t()), "x must be \\[M, K\\] with dense rows"),
    (dict(bias=torch.zeros(25)), "bias must be a dense \\[24\\]"),
    (dict(mins=torch.zeros(3, 32)), "mins and zeros exclude each other"),
    (dict(mins=torch.zeros(3, 32, dtype=torch.float16), zeros=None),
     "mins must be a dense float32 \\[3, 32\\]"),
])
def test_bad_operands_get_a_sentence(device, change, match):
    qw, _ = _random_quantized(24, 66, 4, 32, True, torch.Generator().manual_seed(0))
    args = dict(x=torch.zeros(3, 66), qweight=qw.qweight, scales=qw.scales, zeros=qw.zeros,
                bits=4, group_size=32, out_features=24, bias=None, mins=None)
    args.update(change)
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises((ValueError, TypeError), match=match):
        torch.ops.cbatch_triton.quantized_linear(*args.values())


def test_no_rows_and_fakes(device):
    """M = 0 returns an empty [0, N]; the fakes give the real ops' shapes and dtypes."""
    qw, _ = _random_quantized(24, 66, 8, 66, False, torch.Generator().manual_seed(0))
    w = (qw.qweight.to(device), qw.scales.to(device))
    x = torch.zeros(0, 66, dtype=torch.bfloat16, device=device)
    assert torch.ops.cbatch_triton.quantized_linear(x, *w, None, 8, 66, 24, None).shape == (0, 24)
    x_q, x_scale = torch.ops.cbatch_triton.scaled_int8_quant(x)
    assert x_q.shape == (0, 66) and x_scale.shape == (0, 1)
    meta = {k: torch.empty_like(v, device="meta") for k, v in
            dict(x=torch.zeros(5, 66, dtype=torch.float16), q=qw.qweight, s=qw.scales).items()}
    y = torch.ops.cbatch_triton.quantized_linear(meta["x"], meta["q"], meta["s"], None, 8, 66,
                                                 24, None)
    assert y.shape == (5, 24) and y.dtype == torch.float16 and y.device.type == "meta"
    x_q, x_scale = torch.ops.cbatch_triton.scaled_int8_quant(meta["x"])
    assert (x_q.shape, x_q.dtype, x_scale.shape) == ((5, 66), torch.int8, (5, 1))
    y = torch.ops.cbatch_triton.w8a8_linear(x_q, x_scale, meta["q"], meta["s"], 24, None,
                                            torch.bfloat16)
    assert y.shape == (5, 24) and y.dtype == torch.bfloat16


@pytest.mark.slow
def test_opcheck(device):
    gen = torch.Generator().manual_seed(0)
    for bits in (8, 4):
        qw, _ = _random_quantized(24, 66, bits, 32, bits == 4, gen)
        x = torch.randn(3, 66, generator=gen, device=device)
        torch.library.opcheck(torch.ops.cbatch_triton.quantized_linear,
                              (x, qw.qweight.to(device), qw.scales.to(device),
                               None if qw.zeros is None else qw.zeros.to(device),
                               bits, 32, 24, None))
    torch.library.opcheck(torch.ops.cbatch_triton.scaled_int8_quant, (x,))
    x_q, x_scale = torch.ops.cbatch_triton.scaled_int8_quant(x)
    qw, _ = _random_quantized(24, 66, 8, 66, False, gen)
    torch.library.opcheck(torch.ops.cbatch_triton.w8a8_linear,
                          (x_q, x_scale, pack_w8a8(qw).to(device), qw.scales.to(device), 24,
                           None, torch.float32))


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_layer_on_cuda_runs_the_triton_kernel(device, monkeypatch, bits):
    """QuantizedLinear.forward's dispatch: on CUDA (here: CPU tensors in the interpreter, the
    dispatch's device test pointed at them) it runs the Triton kernel, not the CPU kernel or
    the reference, on x of any leading shape; with act_bits=8 (8 bits) the per-token
    quantization and the W8A8 GEMM, whose result is the reference's."""
    from cbatch.kernels import quant_matmul

    calls = []

    def spy(name):
        real = getattr(quant_matmul, name)
        monkeypatch.setattr(quant_matmul, name,
                            lambda *a, **k: calls.append(name) or real(*a, **k))

    for name in ("wna16_linear", "scaled_int8_quant", "w8a8_linear"):
        spy(name)
    if device == "cpu":
        monkeypatch.setattr(quantized, "on_triton", lambda x: True)
    gen = torch.Generator().manual_seed(bits)
    dense = torch.nn.Linear(130, 37).to(dtype=torch.bfloat16)
    layer = QuantizedLinear.from_linear(dense, Scheme(bits, 32 if bits == 4 else None)).to(device)
    x = torch.randn(2, 3, 130, generator=gen).to(torch.bfloat16)
    y = layer(x.to(device))
    assert calls == ["wna16_linear"] and y.shape == (2, 3, 37) and y.dtype == torch.bfloat16
    w = layer.weight.dequantize().double().cpu()
    _check(x.view(6, 130), w, dense.bias, y.view(6, 37).cpu())
    if bits == 8:
        calls.clear()
        w8a8 = QuantizedLinear.from_linear(dense, Scheme(8, None, 8)).to(device)
        y8 = w8a8(x.to(device))
        assert calls == ["scaled_int8_quant", "w8a8_linear"] and y8.shape == (2, 3, 37)
        want = reference.quantized_linear_w8a8(x.view(6, 130), w8a8.qweight.cpu(),
                                               w8a8.scales.cpu(), 37, dense.bias)
        torch.testing.assert_close(y8.view(6, 37).cpu(), want, rtol=2.0 ** -7, atol=0)
    calls.clear()  # float mins (GGUF's): the buffer reaches the kernel
    with_mins = QuantizedLinear(quantize_with_mins(dense.weight, bits, 32), dense.bias).to(device)
    y = with_mins(x.to(device))
    assert calls == ["wna16_linear"] and y.shape == (2, 3, 37)
    want = reference.quantized_linear(x.view(6, 130), with_mins.qweight.cpu(),
                                      with_mins.scales.cpu(), None, bits, 32, 37, dense.bias,
                                      with_mins.mins.cpu())
    torch.testing.assert_close(y.view(6, 37).cpu(), want, rtol=2.0 ** -6, atol=1e-3)
