"""W8A8 (``QuantizedLinear(..., act_bits=8)``): the interface, the W8A8 weight layout, the
per-token activation quantization against hand-computed values, and the layer against
``x @ W.T`` in float64 within the error that quantizing x may make (an oracle that knows
nothing of cbatch's integers)."""

import pytest
import torch
from torch import nn

from cbatch.layers.quantization import QuantizedLinear, pack, quantize
from cbatch.layers.quantization.weight import pack_w8a8, unpack_w8a8
from cbatch.ops import reference
from cbatch.quantization import Scheme

U = 2.0 ** -24


def test_quantize_per_token_by_hand():
    """scale = max |x| / 127; q = round(x * 127 / max), ties to even; a zero row: 0, 0."""
    x = torch.tensor([[254.0, 1.0, 3.0, -5.0], [0.0, 0.0, 0.0, 0.0], [-1.0, 0.5, 0.25, 0.0]])
    q, scale = reference.quantize_per_token(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    # 254: x * 0.5 -> 127, 0.5 -> 0, 1.5 -> 2, -2.5 -> -2; -1: x * 127 -> -127, 63.5 -> 64,
    # 31.75 -> 32
    assert q.tolist() == [[127, 0, 2, -2], [0, 0, 0, 0], [-127, 64, 32, 0]]
    assert scale.tolist() == [2.0, 0.0, torch.tensor(1 / 127, dtype=torch.float32).item()]
    q, scale = reference.quantize_per_token(x.to(torch.bfloat16))
    assert q.tolist()[0] == [127, 0, 2, -2] and scale[0] == 2.0


@pytest.mark.parametrize("N,K", [(1, 1), (5, 3), (33, 130), (16, 8)])
def test_w8a8_layout_round_trips(N, K):
    """pack_w8a8: byte [b, i, 4 j + t] = q[16 b + j, 4 i + t] + 128; unpack_w8a8 gives the
    same QuantizedWeight back, bit for bit."""
    gen = torch.Generator().manual_seed(N + K)
    q = torch.randint(-128, 128, (N, K), generator=gen)
    qw = pack(q, torch.rand(1, N, generator=gen), None, 8, K)
    packed = pack_w8a8(qw)
    assert packed.dtype == torch.uint8 and packed.shape == (-(-N // 16), -(-K // 4), 64)
    for n, k in ((0, 0), (N - 1, K - 1), (N // 2, K // 3)):
        assert int(packed[n // 16, k // 4, 4 * (n % 16) + k % 4]) == int(q[n, k]) + 128
    assert torch.equal(reference.unpack_w8a8(packed, N, K), q.to(torch.int32))
    back = unpack_w8a8(packed, qw.scales, N, K)
    assert torch.equal(back.qweight, qw.qweight) and torch.equal(back.scales, qw.scales)
    assert (back.bits, back.group_size, back.zeros) == (8, K, None)


def _float_oracle_check(x, w, bias, y):
    """|y - (x @ W.T + b)| within what per-token quantization of x may cost: each element of
    x moves by at most half its row's step s_x (plus a few roundings of x), so a sum moves by
    at most sum_k (s_x / 2 + 4 u |x_k|) |W[n, k]|, and the fp32 epilogue adds 4 roundings."""
    xd, wd = x.double(), w.double()
    b = 0 if bias is None else bias.double()
    truth = xd @ wd.t() + b
    step = xd.abs().amax(dim=1, keepdim=True) / 127  # [M, 1]
    bound = (step / 2 + 4 * U * xd.abs()) @ wd.abs().t() * (1 + 1e-6)
    bound = bound + 5 * U * ((xd.abs() + step) @ wd.abs().t() + abs(b))
    if y.dtype == torch.bfloat16:
        bound = bound + truth.abs() * 2.0 ** -8
    assert ((y.double() - truth).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_within_the_quantization_error_of_x(dtype):
    gen = torch.Generator().manual_seed(1)
    linear = nn.Linear(37, 21)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(21, 37, generator=gen))
        linear.bias.copy_(torch.randn(21, generator=gen))
    layer = QuantizedLinear.from_linear(linear, Scheme(8, None, 8))
    x = torch.randn(9, 37, generator=gen).to(dtype)
    x[4] = 0  # a zero row: scale 0, output the bias
    y = layer(x)
    assert y.dtype == dtype and y.shape == (9, 21)
    _float_oracle_check(x, layer.weight.dequantize(), layer.bias.detach(), y)
    torch.testing.assert_close(y[4], linear.bias.detach().to(dtype))


def test_interface():
    w = torch.randn(20, 30, generator=torch.Generator().manual_seed(0))
    qw = quantize(w, 8)
    layer = QuantizedLinear(qw, act_bits=8)
    assert "act_bits=8" in repr(layer) and "act_bits" not in repr(QuantizedLinear(qw))
    assert layer.act_bits == 8 and QuantizedLinear(qw).act_bits is None
    assert torch.equal(layer.weight.dequantize(), qw.dequantize())
    with pytest.raises(ValueError, match="act_bits None or 8"):
        QuantizedLinear(qw, act_bits=4)
    for bad in (quantize(w, 4, 10), quantize(w, 8, 10),
                pack(torch.zeros(20, 30), torch.ones(1, 20), torch.ones(1, 20), 8, 30)):
        with pytest.raises(ValueError, match="act_bits=8 takes symmetric int8 with one scale "
                                             "per output channel \\(W8A8\\)"):
            QuantizedLinear(bad, act_bits=8)
