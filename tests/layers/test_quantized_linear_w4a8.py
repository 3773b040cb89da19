"""W4A8 (``QuantizedLinear(..., act_bits=8)`` on int4): the interface, and the layer against
``x @ W.T`` in float64 within the error that quantizing x per token and group may make (an
oracle that knows nothing of cbatch's integers), on the kernel where it runs and on the
pure-torch reference."""

import pytest
import torch
from torch import nn

from cbatch.layers.quantization import QuantizedLinear, pack, quantize
from cbatch.ops import cpu
from cbatch.ops import quantized
from cbatch.quantization import Scheme
from tests.quant_utils import random_quantized, unpacked_weight

U = 2.0 ** -24


def _float_oracle_check(x, w, bias, group_size, y):
    """|y - (x @ W.T + b)| within what quantizing x per token and group may cost: each element
    of x moves by at most half its group's step s_x (plus a few roundings of x), so a sum
    moves by at most sum_k (s_x / 2 + 4 u |x_k|) |W[n, k]|; the fp32 epilogue adds G + 3
    roundings."""
    xd, wd = x.double(), w.double()
    M, K = x.shape
    G = -(-K // group_size)
    b = 0 if bias is None else bias.double()
    truth = xd @ wd.t() + b
    groups = torch.nn.functional.pad(xd.abs(), (0, G * group_size - K)).view(M, G, group_size)
    step = (groups.amax(dim=2) / 127).repeat_interleave(group_size, dim=1)[:, :K]  # [M, K]
    bound = (step / 2 + 4 * U * xd.abs()) @ wd.abs().t() * (1 + 1e-6)
    bound = bound + (G + 4) * U * ((xd.abs() + step) @ wd.abs().t() + abs(b))
    if y.dtype == torch.bfloat16:
        bound = bound + truth.abs() * 2.0 ** -8
    assert ((y.double() - truth).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_within_the_quantization_error_of_x(dtype, kernel, monkeypatch):
    if not kernel:
        monkeypatch.setattr(quantized, "available", lambda kind: kind != "w4a8")
    gen = torch.Generator().manual_seed(1)
    linear = nn.Linear(200, 21)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(21, 200, generator=gen))
        linear.bias.copy_(torch.randn(21, generator=gen))
    layer = QuantizedLinear.from_linear(linear, Scheme(4, 64, 8))
    x = torch.randn(9, 200, generator=gen).to(dtype)
    x[4] = 0  # a zero row: scale 0, output the bias
    x[2, 64:128] = 0  # a zero group
    x[3, 70] = 100.0  # an outlier: its group's step only
    y = layer(x)
    assert y.dtype == dtype and y.shape == (9, 21)
    _float_oracle_check(x, layer.weight.dequantize(), layer.bias.detach(), 64, y)
    torch.testing.assert_close(y[4], linear.bias.detach().to(dtype))


@pytest.mark.parametrize("kernel", [True, False])
def test_layer_with_zero_points_within_the_quantization_error_of_x(kernel, monkeypatch):
    """Zero points (AWQ's, asymmetric GPTQ's): the oracle's weight is s * (q - z) from the
    drawn integers (tests/quant_utils.py), not cbatch's dequantization."""
    if not kernel:
        monkeypatch.setattr(quantized, "available", lambda kind: kind != "w4a8")
    gen = torch.Generator().manual_seed(2)
    qw, (q, s, z) = random_quantized(21, 200, 4, 64, True, gen)
    bias = torch.randn(21, generator=gen)
    layer = QuantizedLinear(qw, bias, act_bits=8)
    x = torch.randn(9, 200, generator=gen)
    x[3, 70] = 100.0
    before = cpu.kernel_paths().get(f"quantized_linear.w4a8.{quantized.isa('w4a8')}",
                                    0)
    y = layer(x)
    after = cpu.kernel_paths().get(f"quantized_linear.w4a8.{quantized.isa('w4a8')}",
                                   0)
    assert after == before + (kernel and quantized.available("w4a8"))
    _float_oracle_check(x, unpacked_weight(q, s, z, 4, 64), bias, 64, y)


def test_interface():
    w = torch.randn(20, 70, generator=torch.Generator().manual_seed(0))
    qw = quantize(w, 4, 32)
    layer = QuantizedLinear(qw, act_bits=8)
    assert "bits=4, group_size=32, act_bits=8" in repr(layer)
    assert layer.qweight.shape == (2, 3 * 8, 32) and layer.qweight.dtype == torch.uint8
    assert torch.equal(layer.weight.dequantize(), qw.dequantize())
    assert torch.equal(layer.weight.qweight, qw.qweight)
    for bad in (quantize(w, 4, 10), quantize(w, 4, 48)):
        with pytest.raises(ValueError, match="or int4 in groups of a multiple of 32 k, "
                                             "with zero points or without \\(W4A8\\)"):
            QuantizedLinear(bad, act_bits=8)
    zeros = pack(torch.zeros(20, 70), torch.ones(3, 20), torch.full((3, 20), 3), 4, 32)
    layer = QuantizedLinear(zeros, act_bits=8)  # zero points: W4A8 too, kept beside it
    assert torch.equal(layer.weight.zeros, zeros.zeros)
    assert torch.equal(layer.weight.dequantize(), zeros.dequantize())
