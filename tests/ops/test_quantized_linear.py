"""cbatch::quantized_linear (W8A16, W4A16: csrc/cpu/quantized_linear.cpp) against its oracle,
dequantize-then-matmul: the weight that cbatch.ops.reference.dequantize reads from the packed
layout (checked here against s * (q - z) of the unpacked integers), times x in float64.

The bound: the kernel sums x (q - z) over a group in fp32 fmas (each product exact in its
fma), multiplies the group's sum by its scale, adds the groups and the bias; every term of
the exact result then meets at most K + 3 roundings, and the reference's fp32 weight
s * (q - z) one more, so |y - y_fp64| <= gamma_n * (|x| @ |W|^T + |bias|) with
gamma_n = n u / (1 - n u), n = K + 4, u = 2^-24; bf16 outputs add their rounding, 2^-8 |y|.
Both ISAs run every case (set_cpu_options("avx2") caps the kernel at its AVX2 path in this
process; the AVX-512 cases skip on a CPU without it), and each call asserts that the kernel
path of its ISA ran: int4 on a bf16 x takes vdpbf16ps where the CPU has AVX512-BF16
(``quantized_linear.w4.avx512bf16``: x read as bf16, each weight's q - z a bf16 exactly, each
product exact in fp32 and each add one rounding, so the same bound holds; denormals flush to
zero, far below it).

With float mins (W = s q - m, no zero point; llama.cpp's Q4_K, Q4_1) the kernel subtracts, at
each group's end, m times the row's sum of x over the group (an fma): each term then meets at
most K + 2G + 4 roundings, against the exact x @ (s q - m)^T of the unpacked parts, and the
bound's size is |x| @ (|s q| + |m|)^T (the weight's two parts apart, as the kernel adds them).
"""

import pytest
import torch

from cbatch.layers.quantization import pack, quantize
from cbatch.ops import compiled, cpu, reference
from cbatch.ops import quantized
from tests.helpers import CPU_FLAGS as FLAGS
from tests.quant_utils import (random_quantized, random_with_mins, unpacked_weight,
                               weight_with_mins)

pytestmark = pytest.mark.skipif(not quantized.available("w8a16"),
                                reason="cbatch's quantized CPU kernel does not run here")

HAS_AVX512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= FLAGS
ISAS = [pytest.param("avx512", marks=pytest.mark.skipif(not HAS_AVX512, reason="no AVX-512")),
        "avx2"]
U = 2.0 ** -24


@pytest.fixture
def isa(request):
    """Run the test with the kernel capped at ``request.param``; restore the options after."""
    torch.ops.cbatch.set_cpu_options("avx2" if request.param == "avx2" else "", "")
    yield request.param
    torch.ops.cbatch.set_cpu_options(*compiled._cpu_options())


def path(bits: int, isa: str, dtype: torch.dtype) -> str:
    """The kernel path a call with these operands takes under the ``isa`` cap."""
    bf16_dot = bits == 4 and dtype == torch.bfloat16 and "avx512bf16" in cpu.cpu_isa().split()
    return f"quantized_linear.w{bits}.{'avx512bf16' if bf16_dot else isa}"


def _check(x, qw, bias, ours):
    w = qw.dequantize().double()
    b = 0 if bias is None else bias.double()
    truth = x.double() @ w.t() + b
    n = x.shape[1] + 4  # see the module docstring
    bound = n * U / (1 - n * U) * (x.double().abs() @ w.abs().t() + abs(b))
    if x.dtype == torch.bfloat16:
        bound = bound + truth.abs() * 2.0 ** -8 + 1e-30
    err = (ours.double() - truth).abs()
    assert (err <= bound * 1.001 + 1e-30).all(), (err - bound).max()


# (N, K): odd K and N, one column, K of one element, K across group edges
SHAPES = [(1, 1), (5, 3), (33, 129), (17, 300), (130, 257), (64, 512)]


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("bits,group_size", [(8, None), (8, 7), (8, 128), (4, 128), (4, 32),
                                             (4, None)])
@pytest.mark.parametrize("N,K", SHAPES)
def test_quantized_linear_matches_dequantize_then_matmul(isa, bits, group_size, N, K):
    """Row counts 1..69 (one tile, partial tiles, past a 64-row chunk), fp32 and bf16 x,
    with and without zero points and bias."""
    gen = torch.Generator().manual_seed(N * 1000 + K + bits)
    gs = K if group_size is None else group_size
    for zeros, dtype, M, bias in ((False, torch.float32, 1, False), (True, torch.float32, 5, True),
                                  (False, torch.bfloat16, 8, True),
                                  (True, torch.bfloat16, 69, False)):
        qw, (q, s, z) = random_quantized(N, K, bits, gs, zeros, gen)
        x = torch.randn(M, K, generator=gen).to(dtype)
        b = (torch.randn(N, generator=gen) * 0.1).to(dtype) if bias else None
        before = cpu.kernel_paths()
        ours = torch.ops.cbatch.quantized_linear(x, qw.qweight, qw.scales, qw.zeros, bits, gs,
                                                 N, b)
        after = cpu.kernel_paths()
        taken = path(bits, isa, dtype)
        assert after[taken] == before[taken] + 1, taken
        assert ours.dtype == dtype and ours.shape == (M, N)
        # the reference's dequantization is the unpacked formula, in fp32
        torch.testing.assert_close(qw.dequantize().double(), unpacked_weight(q, s, z, bits, gs),
                                   rtol=U, atol=0)
        _check(x, qw, b, ours)
        torch.testing.assert_close(ours, reference.quantized_linear(
            x, qw.qweight, qw.scales, qw.zeros, bits, gs, N, b), rtol=1e-4 if dtype ==
            torch.float32 else 1e-2, atol=1e-4 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("bits,K,group_size,M", [(8, 256, 128, 2048), (4, 256, 128, 2048),
                                                 (8, 601, None, 67), (8, 300, 7, 13),
                                                 (4, 601, None, 67), (4, 514, 32, 9),
                                                 (4, 130, 32, 5)])
def test_many_rows_and_rows_are_independent(isa, bits, K, group_size, M):
    """Up to 2048 rows (32 chunks of 64; more rows than a tile: the weights dequantized once per
    chunk of k, tile_rows) on a decode-sized layer: within the bound, and each row bitwise the
    row computed alone by the one-tile loop (no row's sum depends on its batch-mates), across
    odd groups, odd K and k chunks of 256, and rows left over after tile_rows' runs of rows
    (AVX2 takes 3 at a time, AVX-512 4: 67, 13, 5 and 9 rows leave 0-3)."""
    gen = torch.Generator().manual_seed(bits + K)
    N, gs = 40, K if group_size is None else group_size
    qw, _ = random_quantized(N, K, bits, gs, True, gen)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    args = (qw.qweight, qw.scales, qw.zeros, bits, gs, N, None)
    before = cpu.kernel_paths()[path(bits, isa, x.dtype)]
    ours = torch.ops.cbatch.quantized_linear(x, *args)
    assert cpu.kernel_paths()[path(bits, isa, x.dtype)] == before + 1
    _check(x, qw, None, ours)
    for m in sorted({0, 3, 64 % M, M - 1}):
        assert torch.equal(torch.ops.cbatch.quantized_linear(x[m:m + 1], *args), ours[m:m + 1])


@pytest.mark.parametrize("bits,group_size", [(8, None), (4, 128), (4, 32)])
def test_online_quantization_round_trips_within_half_a_step(bits, group_size):
    """quantize(): every weight within half a quantization step of its dequantized value
    (a group's largest magnitude exactly), all-zero groups kept zero."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(37, 300, generator=gen)
    w[3] = 0
    qw = quantize(w, bits, group_size)
    assert qw.bits == bits and qw.group_size == (300 if group_size is None else group_size)
    deq = qw.dequantize()
    gs = qw.group_size
    g = torch.arange(300) // gs
    step = qw.scales[:, :37][g].t()
    assert ((deq - w).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(deq[3], torch.zeros(300))
    levels = 127 if bits == 8 else 7
    top = w.abs().view(37, -1, gs).amax(-1) if 300 % gs == 0 else None
    if top is not None:
        torch.testing.assert_close(qw.scales[:, :37].t()[top > 0], top[top > 0] / levels)


@pytest.mark.slow
def test_opcheck():
    gen = torch.Generator().manual_seed(0)
    for bits in (8, 4):
        qw, _ = random_quantized(24, 66, bits, 32, bits == 4, gen)
        x = torch.randn(3, 66, generator=gen)
        torch.library.opcheck(torch.ops.cbatch.quantized_linear,
                              (x, qw.qweight, qw.scales, qw.zeros, bits, 32, 24, None))


def test_pack_refuses_integers_out_of_range():
    s = torch.ones(1, 4)
    with pytest.raises(ValueError, match="4-bit q must be in \\[0, 15\\]"):
        pack(torch.full((4, 6), 16), s, None, 4, 6)
    with pytest.raises(ValueError, match="4-bit zero points must be in \\[0, 15\\]"):
        pack(torch.zeros(4, 6), s, torch.full((1, 4), -1), 4, 6)
    with pytest.raises(ValueError, match="8-bit q must be in \\[-128, 127\\]"):
        pack(torch.full((4, 6), 128), s, None, 8, 6)


@pytest.mark.parametrize("change,match", [
    (dict(bits=5), "bits must be 8 or 4"),
    (dict(out_features=40), "does not hold 4-bit 40 x 66"),
    (dict(group_size=33), "group_size must be even"),
    (dict(scales=torch.zeros(3, 32, dtype=torch.float16)), "scales must be a dense float32"),
    (dict(zeros=torch.zeros(2, 32, dtype=torch.int8)), "zeros must be a dense int8 \\[3, 32\\]"),
    (dict(x=torch.zeros(3, 66, dtype=torch.float16)), "x must be float32 or bfloat16"),
])
def test_bad_operands_get_a_sentence(change, match):
    qw, _ = random_quantized(24, 66, 4, 32, True, torch.Generator().manual_seed(0))
    args = dict(x=torch.zeros(3, 66), qweight=qw.qweight, scales=qw.scales, zeros=qw.zeros,
                bits=4, group_size=32, out_features=24, bias=None)
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        torch.ops.cbatch.quantized_linear(*args.values())


def _check_mins(x, parts, group_size, bias, ours):
    """ours within gamma_{K + 2G + 4} (|x| @ (|s q| + |m|)^T + |bias|) of x @ (s q - m)^T +
    bias in float64 (the module docstring), bf16 outputs 2^-8 |y| more."""
    q, s, m = parts
    K = x.shape[1]
    g = torch.arange(K) // group_size
    truth = x.double() @ weight_with_mins(q, s, m, group_size).t()
    size = x.double().abs() @ (s[g].t().double() * q.double().abs() + m[g].t().double().abs()).t()
    b = 0 if bias is None else bias.double()
    truth = truth + b
    n = K + 2 * (-(-K // group_size)) + 4
    bound = n * U / (1 - n * U) * (size + abs(b))
    if x.dtype == torch.bfloat16:
        bound = bound + truth.abs() * 2.0 ** -8
    err = (ours.double() - truth).abs()
    assert (err <= bound * 1.001 + 1e-30).all(), (err - bound).max()


# (N, K): one column and one k, odd N and K, K a group and one (a last group of one k), a
# short last group of 12 or 44 k, odd N past one block
MINS_SHAPES = [(1, 1), (5, 3), (33, 129), (17, 300), (130, 257)]


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("N,K", MINS_SHAPES)
def test_mins_match_the_exact_product(isa, bits, group_size, N, K):
    """W = s q - m: rows 1..9 (whole and partial tiles) and 300 (tile_rows, past four chunks
    of 64 rows), fp32 and bf16 x, with and without bias: within the bound of the exact product,
    near the reference, the ISA's path counted; and each row of the long call is the row
    computed alone, bit for bit."""
    gen = torch.Generator().manual_seed(N * 1000 + K + bits + group_size)
    qw, parts = random_with_mins(N, K, bits, group_size, gen)
    assert qw.zeros is None and qw.mins.shape == qw.scales.shape
    for M in (*range(1, 10), 300):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(M, K, generator=gen).to(dtype)
            b = (torch.randn(N, generator=gen) * 0.1).to(dtype) if M % 3 == 0 else None
            args = (qw.qweight, qw.scales, None, bits, group_size, N, b, qw.mins)
            taken = path(bits, isa, dtype)
            before = cpu.kernel_paths()[taken]
            ours = torch.ops.cbatch.quantized_linear(x, *args)
            assert cpu.kernel_paths()[taken] == before + 1, taken
            assert ours.dtype == dtype and ours.shape == (M, N)
            _check_mins(x, parts, group_size, b, ours)
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(ours, reference.quantized_linear(x, *args), rtol=tol,
                                       atol=tol)
            if M == 300:
                for m in (0, 3, 64, 299):
                    assert torch.equal(torch.ops.cbatch.quantized_linear(x[m:m + 1], *args),
                                       ours[m:m + 1])


def test_mins_are_not_a_zero_point():
    """With mins, q is used as stored: int4's nibble is not less 8, and int8's q is signed.
    A weight of q = 15 (int4) or -128 (int8), s = 1 and m = 2 is 13 or -130 everywhere."""
    for bits, value in ((4, 15), (8, -128)):
        qw = pack(torch.full((3, 64), value), torch.ones(2, 3), None, bits, 32,
                  mins=torch.full((2, 3), 2.0))
        assert torch.equal(qw.dequantize(), torch.full((3, 64), value - 2.0))
        x = torch.ones(2, 64)
        ours = torch.ops.cbatch.quantized_linear(x, qw.qweight, qw.scales, None, bits, 32, 3,
                                                 None, qw.mins)
        assert torch.equal(ours, torch.full((2, 3), 64 * (value - 2.0)))


@pytest.mark.parametrize("change,match", [
    (dict(zeros=torch.zeros(3, 32, dtype=torch.int8)), "mins and zeros exclude each other"),
    (dict(mins=torch.zeros(3, 32, dtype=torch.float16)), "mins must be a dense float32 "
                                                         "\\[3, 32\\]"),
    (dict(mins=torch.zeros(2, 32)), "mins must be a dense float32 \\[3, 32\\], got Float "
                                    "\\[2, 32\\]"),
])
def test_bad_mins_get_a_sentence(change, match):
    qw, _ = random_with_mins(24, 66, 4, 32, torch.Generator().manual_seed(0))
    args = dict(x=torch.zeros(3, 66), qweight=qw.qweight, scales=qw.scales, zeros=None,
                bits=4, group_size=32, out_features=24, bias=None, mins=qw.mins)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        torch.ops.cbatch.quantized_linear(*args.values())


@pytest.mark.slow
def test_opcheck_with_mins():
    gen = torch.Generator().manual_seed(1)
    for bits in (8, 4):
        qw, _ = random_with_mins(24, 66, bits, 32, gen)
        x = torch.randn(3, 66, generator=gen)
        torch.library.opcheck(torch.ops.cbatch.quantized_linear,
                              (x, qw.qweight, qw.scales, None, bits, 32, 24, None, qw.mins))
