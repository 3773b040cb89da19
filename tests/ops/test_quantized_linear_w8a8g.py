"""W8A8 per group: cbatch::quantized_linear_w4a8 on an int8 qweight (csrc/cpu/
quantized_linear_w4a8.cpp, its 8-bit paragraph) against its oracles.

The oracles are those of tests/ops/test_quantized_linear_w4a8.py: each group's integer sum is
exact in the kernel (|q| sign(x, q) in int16 pairs, widened at once) and in the oracle (int64
here, from the integers tests/quant_utils.py drew, not from cbatch's packing), x's
quantization per token and group is reference.quantize_per_group's to the bit, so the output
is the reference's bit for bit and within gamma_{G+3} (sum_g |S_g s_w s_x| + |b|) of the exact
value (gamma_{G+4} with mins' extra term), bf16 outputs 2^-8 |y| more.  Each test runs on
the kernel's native path here (AVX512-VNNI's tile, the weights' top bits flipped, where the CPU
has it) and again under the avx2 cap (vpsignb, vpmaddubsw), and each call asserts that the
path it expects ran.  No AMX tile takes 8-bit weights.
"""

import pytest
import torch

from cbatch.layers.quantization import QuantizedLinear, pack
from cbatch.layers.quantization.weight import pack_w8a8g, unpack_w8a8g
from cbatch.ops import cpu, quantized, reference
from cbatch.quantization import Scheme
from tests.ops.test_quantized_linear_w4a8 import _check, _check_mins
from tests.quant_utils import random_quantized, random_with_mins

needs_kernel = pytest.mark.skipif(not quantized.available("w8a8g"),
                                  reason="cbatch's W4A8 CPU kernel (AVX2) does not run here")


@pytest.fixture(autouse=True, params=["", "avx2"], ids=["native", "avx2-cap"])
def isa(request):
    """Each test on the kernel's native path here, then under the avx2 cap where the native
    path is not already AVX2's."""
    from cbatch.ops import compiled

    if request.param == "avx2" and quantized.isa("w8a8g") in ("avx2", ""):
        pytest.skip("the native path here is already AVX2's")
    torch.ops.cbatch.set_cpu_options(request.param, "", "off")
    try:
        yield request.param
    finally:
        torch.ops.cbatch.set_cpu_options(*compiled._cpu_options())


def _path():
    """The counter of the path the kernel takes here now."""
    return f"quantized_linear.w8a8g.{quantized.isa('w8a8g')}"


def _run(x, qweight, scales, group_size, N, bias, zeros=None, mins=None):
    path = _path()
    before = cpu.kernel_paths()[path]
    ours = torch.ops.cbatch.quantized_linear_w4a8(x, qweight, scales, group_size, N, bias,
                                                  zeros, mins)
    assert cpu.kernel_paths()[path] == before + 1, path
    assert ours.dtype == x.dtype and ours.shape == (x.shape[0], N)
    return ours


def _rows(K, gen):
    """Rows 1..9 (AVX2's tiles of 4, VNNI's of 8, and their rests), 33 and 300 (chunks of 64
    rows), fp32 and bf16, with a row of zeros and an outlier past the first group."""
    for M, dtype in ((1, torch.float32), (2, torch.bfloat16), (3, torch.float32),
                     (4, torch.float32), (5, torch.bfloat16), (9, torch.float32),
                     (33, torch.bfloat16), (300, torch.float32)):
        x = torch.randn(M, K, generator=gen)
        if M > 1:
            x[M // 2] = 0
        x[-1, K - 1] = 1e4 if M > 2 else x[-1, K - 1]
        yield x.to(dtype)


@pytest.mark.parametrize("N,K,group_size", [(1, 1, 16), (5, 3, 32), (33, 130, 16),
                                            (17, 256, 64)])
def test_layout_round_trips(N, K, group_size):
    """pack_w8a8g's bytes are the drawn integers where the module docstring puts them, and
    unpack_w8a8g (and the reference's unpack) give them back bitwise."""
    qw, (q, s, _) = random_quantized(N, K, 8, group_size, False, torch.Generator().manual_seed(K))
    packed = pack_w8a8g(qw)
    quads = -(-K // 32) * 8
    assert packed.dtype == torch.int8 and packed.shape == (-(-N // 16), quads, 64)
    n, k = N - 1, K - 1  # the last column and k, by the docstring's formula
    assert int(packed[n // 16, k // 4, 32 * (n % 16 // 8) + 4 * (n % 8) + k % 4]) == int(q[n, k])
    assert torch.equal(reference.unpack_w8a8g(packed, N, K), q.to(torch.int32))
    back = unpack_w8a8g(packed, qw.scales, group_size, N, K)
    assert torch.equal(back.qweight, qw.qweight) and torch.equal(back.dequantize(),
                                                                 qw.dequantize())
    with pytest.raises(ValueError, match="groups of a multiple of 16 k"):
        pack_w8a8g(pack(q, torch.ones(-(-K // 24), N), None, 8, 24))


@needs_kernel
@pytest.mark.parametrize("N,K,group_size", [(1, 1, 16), (5, 3, 32), (33, 127, 16),
                                            (24, 129, 32), (130, 261, 32), (7, 300, 64),
                                            (40, 1024, 128)])
def test_matches_exact_integer_sums(N, K, group_size):
    """Symmetric int8 (Q8_0's, Q5_0's levels less 16, Q6_K's less 32) in groups of 16 to 128:
    ragged K (a short last group), odd N, with and without bias; the reference's bits and
    within the bound of the exact value; a row of zeros gives the bias."""
    gen = torch.Generator().manual_seed(N * 1000 + K)
    qw, (q, s_w, _) = random_quantized(N, K, 8, group_size, False, gen)
    qweight = pack_w8a8g(qw)
    for i, x in enumerate(_rows(K, gen)):
        bias = (torch.randn(N, generator=gen) * 0.1).to(x.dtype) if i % 2 else None
        ours = _run(x, qweight, qw.scales, group_size, N, bias)
        ref = reference.quantized_linear_w4a8(x, qweight, qw.scales, group_size, N, bias)
        _check(x, q, s_w, group_size, bias, ours, ref)
        M = x.shape[0]
        if M > 1:
            assert torch.equal(ours[M // 2], torch.zeros(N, dtype=x.dtype) if bias is None
                               else bias.float().to(x.dtype))


@needs_kernel
@pytest.mark.parametrize("N,K,group_size", [(5, 3, 32), (33, 127, 16), (7, 300, 64)])
def test_zero_points_and_mins(N, K, group_size):
    """Zero points (the integers less z) and float mins (W = s_w q - m, Q5_1's and Q5_K's
    levels 0..31 as they are): the reference's bits and within the bounds of the exact
    values."""
    gen = torch.Generator().manual_seed(N * 7 + K)
    qz, (q, s_w, z) = random_quantized(N, K, 8, group_size, True, gen)
    signed = q - z[torch.arange(K) // group_size].t()
    qm, (u, s_m, m) = random_with_mins(N, K, 8, group_size, gen)
    for i, x in enumerate(_rows(K, gen)):
        bias = torch.randn(N, generator=gen).to(x.dtype) if i % 2 else None
        packed = pack_w8a8g(qz)
        ours = _run(x, packed, qz.scales, group_size, N, bias, qz.zeros)
        _check(x, signed, s_w, group_size, bias, ours,
               reference.quantized_linear_w4a8(x, packed, qz.scales, group_size, N, bias,
                                               qz.zeros))
        packed = pack_w8a8g(qm)
        ours = _run(x, packed, qm.scales, group_size, N, bias, None, qm.mins)
        _check_mins(x, u, s_m, m, group_size, bias, ours,
                    reference.quantized_linear_w4a8(x, packed, qm.scales, group_size, N, bias,
                                                    None, qm.mins))


@needs_kernel
def test_extreme_integers_are_exact():
    """q all -128 or 127 against x quantized to +-127 in groups of 65536: the products whose
    sign moves to x (q = -128, |q| 128 read unsigned, against x = -127: an int16 pair of
    +32512), and the largest group sums, come out exact."""
    K, N, gs = 65536 + 64, 20, 65536
    q = torch.where(torch.arange(N)[:, None] % 2 == 0, -128, 127).expand(N, K)
    s = torch.rand(2, N, generator=torch.Generator().manual_seed(0)) + 0.5
    qw = pack(q, s, None, 8, gs)
    qweight = pack_w8a8g(qw)
    x = torch.ones(3, K)
    x[1] = -1
    x[2, ::2] = -1
    ours = _run(x, qweight, qw.scales, gs, N, None)
    _check(x, q, s, gs, None, ours,
           reference.quantized_linear_w4a8(x, qweight, qw.scales, gs, N, None))
    assert float(ours[1, 0]) > 0 and float(ours[0, 0]) < 0  # -128 x -127 is positive


@needs_kernel
def test_rows_are_independent():
    """Each row bitwise the row computed alone and in a batch of 5 at another offset."""
    gen = torch.Generator().manual_seed(5)
    N, K, gs = 40, 256, 32
    qw, _ = random_quantized(N, K, 8, gs, False, gen)
    qweight = pack_w8a8g(qw)
    x = torch.randn(130, K, generator=gen).to(torch.bfloat16)
    ours = _run(x, qweight, qw.scales, gs, N, None)
    for m in (0, 3, 64, 129):
        assert torch.equal(_run(x[m:m + 1], qweight, qw.scales, gs, N, None), ours[m:m + 1])
    assert torch.equal(_run(x[61:66], qweight, qw.scales, gs, N, None), ours[61:66])


@needs_kernel
def test_the_layer_runs_the_kernel():
    """QuantizedLinear(act_bits=8) on int8 in groups is W8A8 per group (kind "w8a8g") and runs
    it; on int8 per channel it is W8A8's own kernel still."""
    gen = torch.Generator().manual_seed(2)
    qw, (q, s, _) = random_quantized(24, 70, 8, 16, False, gen)
    layer = QuantizedLinear(qw, torch.randn(24, generator=gen), act_bits=8)
    assert layer.kind == "w8a8g" and "act_bits=8" in repr(layer)
    x = torch.randn(2, 5, 70, generator=gen)
    before = cpu.kernel_paths()[_path()]
    y = layer(x)
    assert cpu.kernel_paths()[_path()] == before + 1 and y.shape == (2, 5, 24)
    _check(x.view(10, 70), q, s, 16, layer.bias.detach(), y.view(10, 24),
           reference.quantized_linear_w4a8(x.view(10, 70), layer.qweight, layer.scales, 16,
                                           24, layer.bias))
    assert torch.equal(layer.weight.dequantize(), qw.dequantize())
    per_channel, _ = random_quantized(24, 70, 8, 70, False, gen)
    assert QuantizedLinear(per_channel, act_bits=8).kind == "w8a8"


def test_the_scheme_names_and_refuses():
    assert Scheme(8, 32, 8).kind == "w8a8g" and Scheme(8, None, 8).kind == "w8a8"
    assert Scheme.of(8, 64, 8, 64).kind == "w8a8" and Scheme.of(8, 32, 8, 64).kind == "w8a8g"
    assert Scheme(8, 32, 8).describe(4096) == "w8a8 g32"
    assert Scheme(8, 16, 8).refusal(4096, True) is None
    assert "groups of a multiple of 16 k" in Scheme(8, 24, 8).refusal(4096, False)
    with pytest.raises(ValueError, match="W8A8 per group"):
        QuantizedLinear(pack(torch.zeros(16, 48, dtype=torch.int8), torch.ones(2, 16), None, 8,
                             24), act_bits=8)


@needs_kernel
def test_bad_operands_get_a_sentence():
    qw, _ = random_quantized(24, 66, 8, 32, False, torch.Generator().manual_seed(0))
    qweight = pack_w8a8g(qw)
    x = torch.zeros(3, 66)
    with pytest.raises(ValueError, match="8-bit weights must be a multiple of 16"):
        torch.ops.cbatch.quantized_linear_w4a8(x, qweight, qw.scales, 24, 24, None)
    with pytest.raises(ValueError, match="does not hold 8-bit W4A8 40 x 66 "
                                         "\\(expected \\[3, 24, 64\\]\\)"):
        torch.ops.cbatch.quantized_linear_w4a8(x, qweight, qw.scales, 32, 40, None)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("form", ["symmetric", "zeros", "mins"])
def test_rows_are_the_dequantized_weights_rows(bits, form):
    """QuantizedLinear.rows (a tied embedding's lookup from its quantized lm_head) on W8A8 per
    group and W4A8, symmetric, with zero points or mins: bitwise the dequantized weight's rows,
    read from the packed layout (columns on both sides of a block's halves, the last one)."""
    gen = torch.Generator().manual_seed(bits)
    N, K = 37, 96
    qw, _ = random_with_mins(N, K, bits, 32, gen) if form == "mins" else \
        random_quantized(N, K, bits, 32, form == "zeros", gen)
    layer = QuantizedLinear(qw, act_bits=8)
    assert layer.kind == ("w8a8g" if bits == 8 else "w4a8")
    ids = torch.tensor([0, 7, 8, 15, 16, 36, 7])
    assert torch.equal(layer.rows(ids), qw.dequantize()[ids])
