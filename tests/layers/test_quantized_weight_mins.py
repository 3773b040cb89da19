"""Float mins in cbatch's quantized representation (``W = s q - m``, no zero point): the
dequantization is gguf's own, bit for bit (Q4_1's ``d q + m``, Q4_K's ``(d sc) q - dmin m``,
and the fp32 formula in numpy for int8), the record checks them, the W4A8 layout carries them,
and :class:`QuantizedLinear` holds them as a buffer and runs them on every path."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from cbatch.layers.quantization import QuantizedLinear, QuantizedWeight, pack
from cbatch.layers.quantization.weight import pack_w4a8, unpack_w4a8
from cbatch.ops import cpu, quantized, reference
from tests.quant_utils import random_with_mins


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _f16(gen: torch.Generator, shape: tuple[int, ...], scale: float) -> np.ndarray:
    """Random finite float16 values, as the bytes a block stores."""
    return (torch.randn(shape, generator=gen) * scale).half().numpy()


def test_dequantize_is_ggufs_q4_1_bit_for_bit():
    """Q4_1 blocks (d, m float16; 32 nibbles, element i low and 16 + i high): gguf's ``d q +
    m`` is pack(q, d, None, 4, 32, mins=-m).dequantize(), every bit."""
    N, K = 7, 96
    G = K // 32
    gen = torch.Generator().manual_seed(0)
    d, m = _f16(gen, (N, G), 0.01), _f16(gen, (N, G), 0.1)
    qs = torch.randint(0, 256, (N, G, 16), generator=gen, dtype=torch.uint8).numpy()
    raw = np.concatenate([d[..., None].view(np.uint8), m[..., None].view(np.uint8), qs], axis=-1)
    want = quants.dequantize(raw.reshape(N, G * 20), GGMLQuantizationType.Q4_1)
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(N, K)  # [N, G, 32] by element
    ours = pack(torch.from_numpy(q.astype(np.int16)), torch.from_numpy(d.T.astype(np.float32)),
                None, 4, 32, mins=-torch.from_numpy(m.T.astype(np.float32))).dequantize()
    assert torch.equal(_bits(ours), _bits(torch.from_numpy(want)))


def test_dequantize_is_ggufs_q4_k_bit_for_bit():
    """Q4_K super-blocks of 256 (d, dmin float16; eight 6-bit scales and mins; 32-k groups):
    with scales = fp32(d * sc) and mins = fp32(dmin * m), gguf's ``d q - dm`` is
    dequantize()'s, every bit."""
    N, K = 5, 512
    B = K // 256
    gen = torch.Generator().manual_seed(1)
    d, dmin = _f16(gen, (N, B), 0.01), _f16(gen, (N, B), 0.01)
    scales = torch.randint(0, 256, (N, B, 12), generator=gen, dtype=torch.uint8).numpy()
    qs = torch.randint(0, 256, (N, B, 128), generator=gen, dtype=torch.uint8).numpy()
    raw = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), scales,
                          qs], axis=-1)
    want = quants.dequantize(raw.reshape(N, B * 144), GGMLQuantizationType.Q4_K)
    sc, mn = quants.Q4_K.get_scale_min(scales.reshape(N * B, 12))  # [N B, 8] each
    s = d.reshape(N * B, 1).astype(np.float32) * sc.astype(np.float32)  # [N B, 8]
    m = dmin.reshape(N * B, 1).astype(np.float32) * mn.astype(np.float32)
    # 64 k per 32 bytes: their low nibbles, then their high ones
    q = np.stack([qs.reshape(N * B, 4, 32) & 15, qs.reshape(N * B, 4, 32) >> 4], axis=2)
    qw = pack(torch.from_numpy(q.reshape(N, K).astype(np.int16)),
              torch.from_numpy(s.reshape(N, K // 32).T.copy()), None, 4, 32,
              mins=torch.from_numpy(m.reshape(N, K // 32).T.copy()))
    assert torch.equal(_bits(qw.dequantize()), _bits(torch.from_numpy(want)))


@pytest.mark.parametrize("bits,K,group_size", [(8, 70, 32), (4, 70, 32), (4, 64, 64)])
def test_dequantize_is_the_fp32_formula(bits, K, group_size):
    """fl(fl(s q) - m) in numpy's fp32 (no fused multiply-add), with a short last group and
    padded columns: int8's q signed, int4's as stored."""
    N = 19
    qw, (q, s, m) = random_with_mins(N, K, bits, group_size, torch.Generator().manual_seed(2))
    g = np.arange(K) // group_size
    sn, mn = s.numpy()[g].T, m.numpy()[g].T  # [N, K] fp32
    want = sn * q.numpy().astype(np.float32) - mn
    assert want.dtype == np.float32
    assert torch.equal(_bits(qw.dequantize()), _bits(torch.from_numpy(want)))
    assert qw.mins.shape == (-(-K // group_size), 32) and (qw.mins[:, N:] == 0).all()


def test_the_record_checks_its_mins():
    qw, _ = random_with_mins(16, 64, 4, 32, torch.Generator().manual_seed(3))
    parts = (4, 32, 16, 64, qw.qweight, qw.scales)
    with pytest.raises(ValueError, match="a weight has zeros or mins, not both"):
        QuantizedWeight(*parts, torch.zeros(2, 16, dtype=torch.int8), qw.mins)
    with pytest.raises(ValueError, match="mins must be float32 \\[2, 16\\], got torch.float16"):
        QuantizedWeight(*parts, None, qw.mins.half())
    with pytest.raises(ValueError, match="mins must be float32 \\[2, 16\\]"):
        QuantizedWeight(*parts, None, qw.mins[:1])


def test_w4a8_layout_carries_mins():
    gen = torch.Generator().manual_seed(4)
    qw, _ = random_with_mins(20, 100, 4, 32, gen)
    back = unpack_w4a8(pack_w4a8(qw), qw.scales, 32, 20, 100, None, qw.mins)
    assert torch.equal(back.qweight, qw.qweight) and torch.equal(back.mins, qw.mins)
    assert torch.equal(back.dequantize(), qw.dequantize())


@pytest.mark.parametrize("bits,act_bits", [(8, None), (4, None), (4, 8)])
@pytest.mark.parametrize("kernel", [True, False])
def test_layer_holds_and_runs_mins(bits, act_bits, kernel, monkeypatch):
    """mins is a buffer (the state dict, .weight); forward runs them on cbatch's kernel (its
    path counted) or, without one, on the reference, each the reference's result (W4A8's to
    the bit; W16's within the kernel's own roundings)."""
    kind = f"w{bits}a{act_bits or 16}"
    if kernel and not quantized.available(kind):
        pytest.skip(f"cbatch's {kind} kernel does not run here")
    if not kernel:
        monkeypatch.setattr(quantized, "available", lambda kind: False)
    gen = torch.Generator().manual_seed(5)
    qw, _ = random_with_mins(24, 96, bits, 32, gen)
    layer = QuantizedLinear(qw, torch.randn(24, generator=gen), act_bits=act_bits)
    assert torch.equal(layer.state_dict()["mins"], qw.mins)
    assert torch.equal(layer.weight.dequantize(), qw.dequantize())
    x = torch.randn(2, 3, 96, generator=gen)
    counters = cpu.kernel_paths()
    y = layer(x)
    ran = sum(cpu.kernel_paths().values()) - sum(counters.values())
    assert ran == (1 if kernel else 0)
    args = (layer.qweight, layer.scales)
    if act_bits:
        want = reference.quantized_linear_w4a8(x.view(6, 96), *args, 32, 24, layer.bias, None,
                                               layer.mins)
        assert torch.equal(y.view(6, 24), want)
    else:
        want = reference.quantized_linear(x.view(6, 96), *args, None, bits, 32, 24, layer.bias,
                                          layer.mins)
        torch.testing.assert_close(y.view(6, 24), want, rtol=1e-5, atol=1e-5)


def test_w8a8_refuses_mins():
    qw, _ = random_with_mins(24, 64, 8, 64, torch.Generator().manual_seed(6))
    with pytest.raises(ValueError, match="W8A8 takes symmetric int8 weights: got one with mins"):
        QuantizedLinear(qw, act_bits=8)
    with pytest.raises(ValueError, match="W8A8 takes symmetric int8 weights: no mins"):
        quantized.linear(torch.zeros(1, 64), "w8a8", qw.qweight, qw.scales, None, 64, 24, None,
                         qw.mins)
