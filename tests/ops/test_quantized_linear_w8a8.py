"""cbatch::quantized_linear_w8a8 (csrc/cpu/quantized_linear_w8a8.cpp) against its oracles.

The integer sums are exact in the kernel (int32, no saturation) and in the oracle (int64 here,
from the unpacked integers), and the per-token quantization of x is defined to the bit
(reference.quantize_per_token), so without a bias the kernel's output is the reference's bit
for bit: y = fl(fl(fl(acc) * s_w) * s_x).  With a bias the kernel fuses the last multiply and
the add (one rounding fewer than the reference's), so there it is within
2^-23 (|acc s_w s_x| + |b|) of it.  Against the exact value acc s_w s_x + b (float64), every
output is within gamma_4 (|acc s_w s_x| + |b|), gamma_n = n u / (1 - n u), u = 2^-24 (the
rounding of acc to fp32, two multiplies, the add); bf16 outputs add 2^-8 |y|.
Every path runs every case where the CPU has it (set_cpu_options("avx2") caps the kernel at
its AVX2 path; the AVX512-VNNI cases skip on a CPU without VNNI), and each call asserts the
path of its ISA ran.  "amx" runs AMX-INT8 tiles from 8 rows where K is whole tiles of 64 k:
the CPU's where it has them, else amx_tile_ops.h's software model of the tile instructions
(set_cpu_options(amx="model")), which checks the kernel's addressing, tile shapes and
epilogue, not the silicon; "avx512vnni" turns the tiles off.
"""

import pytest
import torch

from cbatch.layers.quantization import QuantizedLinear, pack
from cbatch.layers.quantization.weight import pack_w8a8
from cbatch.ops import compiled, cpu, reference
from cbatch.ops import quantized
from tests.helpers import CPU_FLAGS as FLAGS

pytestmark = pytest.mark.skipif(not quantized.available("w8a16"),
                                reason="cbatch's quantized CPU kernels do not run here")

HAS_VNNI = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"} <= FLAGS
NO_VNNI = pytest.mark.skipif(not HAS_VNNI, reason="no AVX512-VNNI")
ISAS = [pytest.param("amx", marks=NO_VNNI), pytest.param("avx512vnni", marks=NO_VNNI), "avx2"]
U = 2.0 ** -24
# where this CPU runs AMX-INT8 itself, the tiles' tests run on it rather than on the model
HARDWARE_AMX = "amx-int8" in cpu.cpu_isa()


@pytest.fixture
def isa(request):
    """Run the test on ``request.param``'s path (the tiles' from 8 rows for "amx"); restore
    the options after."""
    options = {"amx": ("", "", "" if HARDWARE_AMX else "model"),
               "avx512vnni": ("", "", "off"), "avx2": ("avx2", "", "")}[request.param]
    torch.ops.cbatch.set_cpu_options(*options)
    assert quantized.isa("w8a8") == ("avx512vnni" if request.param == "amx"
                                               else request.param)
    assert ("amx-int8" in cpu.cpu_isa()) == (request.param == "amx")
    yield request.param
    torch.ops.cbatch.set_cpu_options(*compiled._cpu_options())


def _path(isa, M, K):
    """The path counter a call of M rows and K k moves on ``isa``'s options: the tiles take
    8 rows and more of whole tiles of k (ceil(K / 4) quads a multiple of 16)."""
    tiles = isa == "amx" and M >= 8 and -(-K // 4) % 16 == 0
    return f"quantized_linear.w8a8.{'amx' if tiles else 'avx512vnni' if isa == 'amx' else isa}"


def _random_w8a8(N, K, gen, q=None):
    """The kernel's operands (W8A8 qweight, scales [1, N16]) and the unpacked q [N, K], s_w."""
    if q is None:
        q = torch.randint(-128, 128, (N, K), generator=gen)
    s = torch.rand(1, N, generator=gen) * 0.02 + 1e-3
    qw = pack(q, s, None, 8, K)
    return pack_w8a8(qw), qw.scales, q, s[0]


def _run(isa, x, qweight, scales, N, bias):
    before = cpu.kernel_paths()
    ours = torch.ops.cbatch.quantized_linear_w8a8(x, qweight, scales, N, bias)
    path = _path(isa, *x.shape)
    assert cpu.kernel_paths()[path] == before[path] + 1, path
    assert ours.dtype == x.dtype and ours.shape == (x.shape[0], N)
    return ours


def _check(x, q, s_w, bias, ours, ref):
    """ours against the exact value (int64 sums of the quantized x) and the reference."""
    xq, s_x = reference.quantize_per_token(x)
    acc = xq.long() @ q.long().t()  # [M, N], exact
    scaled = acc.double() * s_w.double() * s_x.double()[:, None]
    b = 0 if bias is None else bias.double()
    size = scaled.abs() + abs(b)
    bound = 4 * U / (1 - 4 * U) * size
    if x.dtype == torch.bfloat16:
        bound = bound + (scaled + b).abs() * 2.0 ** -8
    assert ((ours.double() - (scaled + b)).abs() <= bound).all()
    if bias is None and ref is not None:  # bf16: fp32 results rounded alike
        assert torch.equal(ours, ref)
    elif x.dtype == torch.float32:
        assert ((ours.double() - ref.double()).abs() <= 2 * U * size).all()


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_quantizes_x_as_the_reference(isa, dtype):
    """x's quantization read back through a diagonal weight (q 1, s_w 1) at a row whose top is
    127 (s_x 1), so y[n] = q_x[n]: every k but the top a tie x.5, rounded to even as
    nearbyint rounds it; K = 45: whole vectors of 8 k and 5 k one at a time."""
    K = 45
    x = torch.randint(-126, 126, (1, K), generator=torch.Generator().manual_seed(3)) + 0.5
    x[0, 7] = -127.0
    q_x, s_x = reference.quantize_per_token(x)
    assert s_x.tolist() == [1.0]
    assert torch.equal(q_x, torch.round(x).to(torch.int8))  # torch.round: ties to even
    qw = pack(torch.eye(K, dtype=torch.int16), torch.ones(1, K), None, 8, K)
    ours = _run(isa, x.to(dtype), pack_w8a8(qw), qw.scales, K, None)
    assert torch.equal(ours, q_x.float().to(dtype))


# (N, K): one column, K of one element, odd K and N, K not a multiple of 4, a partial last
# block, several 4-block column items; whole tiles of k (the tiles' from 8 rows), one with a
# last block alone in its pair
SHAPES = [(1, 1), (5, 3), (33, 129), (17, 302), (130, 257), (64, 512), (200, 96), (70, 192)]


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("N,K", SHAPES)
def test_w8a8_matches_exact_integer_sums(isa, N, K):
    """Rows 1, 7, 64 (a chunk) and 300 (past four chunks), fp32 and bf16 x, with and without
    bias, a row of zeros (scale 0: the output is the bias) and a row with one outlier."""
    gen = torch.Generator().manual_seed(N * 1000 + K)
    qweight, scales, q, s_w = _random_w8a8(N, K, gen)
    for M, dtype, with_bias in ((1, torch.float32, False), (7, torch.bfloat16, True),
                                (64, torch.float32, True), (300, torch.bfloat16, False),
                                (7, torch.float32, False)):
        x = torch.randn(M, K, generator=gen)
        x[M // 2] = 0
        x[-1, K // 2] = 1e4 if M > 1 else x[-1, K // 2]
        x = x.to(dtype)
        bias = (torch.randn(N, generator=gen) * 0.1).to(dtype) if with_bias else None
        ours = _run(isa, x, qweight, scales, N, bias)
        ref = reference.quantized_linear_w8a8(x, qweight, scales, N, bias)
        _check(x, q, s_w, bias, ours, ref)
        if M > 1:
            assert torch.equal(ours[M // 2], torch.zeros(N, dtype=dtype) if bias is None
                               else bias.float().to(dtype))


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_extreme_integers_are_exact(isa):
    """q all -128 or 127 against x quantized to +-127, at the largest K the kernel takes: the
    sums' largest magnitudes (128 * 127 * 65536) come out exact; one more k is refused."""
    K, N = 65536, 20
    q = torch.where(torch.arange(N)[:, None] % 2 == 0, -128, 127).expand(N, K)
    qweight, scales, q, s_w = _random_w8a8(N, K, torch.Generator().manual_seed(0), q)
    x = torch.ones(3, K)
    x[1] = -1
    x[2, ::2] = -1
    ours = _run(isa, x, qweight, scales, N, None)
    _check(x, q, s_w, None, ours, reference.quantized_linear_w8a8(x, qweight, scales, N, None))
    with pytest.raises(ValueError, match="K must be <= 65536"):
        torch.ops.cbatch.quantized_linear_w8a8(torch.ones(1, K + 1), qweight, scales, N, None)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("strided", [False, True])
def test_bf16_output_rounds_as_torch(isa, strided):
    """A bf16 x gets its output rounded from fp32 in the kernel's epilogue (no fp32 copy):
    bitwise as ``Tensor.to(torch.bfloat16)`` rounds, ties to even, overflow to inf, NaN kept.
    A zero weight makes every output its fp32 bias alone (0 * s_x + b), so the cases are exact
    fp32 values; x's rows may be strided (the kernel reads them in place)."""
    N, K = 40, 64
    qweight, scales, _, _ = _random_w8a8(N, K, torch.Generator().manual_seed(0),
                                         torch.zeros(N, K, dtype=torch.long))
    cases = [1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8,  # halfway: to even (1, 1 + 2^-6)
             1 + 2.0 ** -8 + 2.0 ** -20, -(1 + 2.0 ** -8),  # above halfway: away from 0
             3.4028234663852886e38, -3.4028234663852886e38,  # the largest fp32: to inf
             3.3895313892515355e38,  # the largest bf16: kept
             float("inf"), float("-inf"), float("nan"), 2.0 ** -130, 1e-45, 0.0, -0.0,
             65504.0, 1.0e10 + 123.0]
    bias = torch.tensor((cases * 3)[:N], dtype=torch.float32)
    x = torch.randn(6, 2 * K if strided else K).to(torch.bfloat16)
    x = x[:, :K] if strided else x
    ours = _run(isa, x, qweight, scales, N, bias)
    want = (torch.zeros(N) + bias).to(torch.bfloat16).expand(6, N)  # 0 + -0 is +0
    nan = want.isnan()
    assert torch.equal(ours.isnan(), nan)
    assert torch.equal(ours.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    ref = reference.quantized_linear_w8a8(x, qweight, scales, N, bias)
    assert torch.equal(ours.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_many_rows_and_rows_are_independent(isa):
    """2048 rows: within the bound, and each row bitwise the row computed alone."""
    gen = torch.Generator().manual_seed(5)
    N, K = 40, 256
    qweight, scales, q, s_w = _random_w8a8(N, K, gen)
    x = torch.randn(2048, K, generator=gen).to(torch.bfloat16)
    ours = _run(isa, x, qweight, scales, N, None)
    _check(x, q, s_w, None, ours, None)
    for m in (0, 3, 64, 2047):
        alone = torch.ops.cbatch.quantized_linear_w8a8(x[m:m + 1], qweight, scales, N, None)
        assert torch.equal(alone, ours[m:m + 1])


@pytest.mark.parametrize("isa", [pytest.param("amx", marks=NO_VNNI)], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_amx_tiles_are_the_vnni_tiles_bit_for_bit(isa, dtype):
    """The tiles' sums are the same exact integers and their epilogue the VNNI tiles', so
    every output is the VNNI path's to the bit: 8 rows (one tile pair, mostly zero rows), 31
    and 33 (a partial tile pair), 300 rows of K = 4096 (three chunks of 128 rows), odd N (a
    last block alone in its pair, a partial block), with and without bias; 7 rows and K not
    whole tiles stay on VNNI."""
    gen = torch.Generator().manual_seed(11)
    for M, N, K, with_bias in ((8, 16, 64, False), (31, 33, 128, True), (33, 100, 960, False),
                               (300, 40, 4096, True), (7, 48, 256, False),
                               (64, 24, 96, True)):
        qweight, scales, q, s_w = _random_w8a8(N, K, gen)
        x = torch.randn(M, K, generator=gen).to(dtype)
        bias = (torch.randn(N, generator=gen) * 0.1).to(dtype) if with_bias else None
        ours = _run(isa, x, qweight, scales, N, bias)
        _check(x, q, s_w, bias, ours, reference.quantized_linear_w8a8(x, qweight, scales, N,
                                                                        bias))
        torch.ops.cbatch.set_cpu_options("", "", "off")
        assert torch.equal(ours, _run("avx512vnni", x, qweight, scales, N, bias))
        torch.ops.cbatch.set_cpu_options("", "", "" if HARDWARE_AMX else "model")


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_the_layer_runs_the_kernel(isa):
    gen = torch.Generator().manual_seed(2)
    qweight, scales, q, s_w = _random_w8a8(24, 70, gen)
    layer = QuantizedLinear(pack(q, s_w[None], None, 8, 70), torch.randn(24, generator=gen),
                            act_bits=8)
    x = torch.randn(5, 70, generator=gen)
    before = cpu.kernel_paths()[_path(isa, 5, 70)]
    y = layer(x)
    assert cpu.kernel_paths()[_path(isa, 5, 70)] == before + 1
    _check(x, q, s_w, layer.bias.detach(), y, reference.quantized_linear_w8a8(
        x, layer.qweight, layer.scales, 24, layer.bias))


@pytest.mark.slow
def test_opcheck():
    gen = torch.Generator().manual_seed(0)
    qweight, scales, _, _ = _random_w8a8(24, 66, gen)
    torch.library.opcheck(torch.ops.cbatch.quantized_linear_w8a8,
                          (torch.randn(3, 66, generator=gen), qweight, scales, 24, None))


@pytest.mark.parametrize("change,match", [
    (dict(out_features=40), "does not hold W8A8 40 x 66"),
    (dict(qweight=torch.zeros(2, 17, 64, dtype=torch.int8)), "a W8A8 qweight is uint8"),
    (dict(scales=torch.zeros(2, 32)), "scales must be a dense float32 \\[1, 32\\]"),
    (dict(bias=torch.zeros(23)), "bias must be \\[24\\]"),
    (dict(x=torch.zeros(3, 66, dtype=torch.float16)), "x must be float32 or bfloat16"),
])
def test_bad_operands_get_a_sentence(change, match):
    qweight, scales, _, _ = _random_w8a8(24, 66, torch.Generator().manual_seed(0))
    args = dict(x=torch.zeros(3, 66), qweight=qweight, scales=scales, out_features=24,
                bias=None)
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        torch.ops.cbatch.quantized_linear_w8a8(*args.values())
