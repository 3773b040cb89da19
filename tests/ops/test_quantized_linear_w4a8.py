"""cbatch::quantized_linear_w4a8 (csrc/cpu/quantized_linear_w4a8.cpp) against its oracles.

Each group's integer sum is exact in the kernel (int32, no saturation) and in the oracle (int64
here, from the unpacked integers that tests/quant_utils.py drew, not from cbatch's packing),
and the per-token, per-group quantization of x is defined to the bit
(reference.quantize_per_group, itself checked by hand), so the kernel's fp32 output is the
reference's bit for bit: y = fma(S_{G-1}, d_{G-1}, ... fma(S_0, d_0, 0)) + b, d_g = fl(s_w s_x),
each fma one rounding (reference.fma32, checked here against exact rationals).
Against the exact value sum_g S_g s_w s_x + b (float64) every output is within
gamma_{G+2} (sum_g |S_g s_w s_x| + |b|), gamma_n = n u / (1 - n u), u = 2^-24 (S_g < 2^24 is
exact in fp32; one multiply per term, G fmas, the bias's add); bf16 outputs add 2^-8 |y|.
The kernel has three paths, AVX512-VNNI (where present), AVX2, and from 8 rows, with groups of
a multiple of 64 k, AMX-INT8 tiles: every test runs on each (the AVX2 one also under
set_cpu_options' avx2 cap; the tiles on the CPU's where it has them, else on amx_tile_ops.h's
software model of the tile instructions, which checks the kernel's addressing, tile shapes
and epilogue, not the silicon), and each call asserts its path ran.

With float mins (W = s_w u - m, u the nibble as it is; reference.quantized_linear_w4a8 gives
the order) each group adds y = fma(-m, fl(Sx_g s_x), y) after its own fma, Sx_g the
row's sum of its q over the group: the kernel's output is the reference's bit for bit, and
within gamma_{2G+2} (sum_g |S_g s_w s_x| + |m Sx_g s_x| + |b|) of the exact value
sum_g (S_g s_w - m Sx_g) s_x + b.  The tests assert the path through the existing counters
(the same paths run mins) and the mins through these results.
"""

import pytest
import torch

from cbatch.layers.quantization import QuantizedLinear, pack
from cbatch.layers.quantization.weight import pack_w4a8, quantize, unpack_w4a8
from cbatch.ops import cpu, reference
from cbatch.ops import quantized
from tests.quant_utils import random_quantized, random_with_mins

U = 2.0 ** -24
needs_kernel = pytest.mark.skipif(not quantized.available("w4a8"),
                                  reason="cbatch's W4A8 CPU kernel (AVX2) does not run here")
# where this CPU runs AMX-INT8 itself, the tiles' tests run on it rather than on the model
HARDWARE_AMX = "amx-int8" in cpu.cpu_isa()


@pytest.fixture(autouse=True, params=["", "avx2", "amx"], ids=["native", "avx2-cap", "amx"])
def isa(request):
    """Each test on the kernel's native path here without AMX tiles, then under the avx2 cap
    (where the native path is not already AVX2's), then with the tiles (where AVX512-VNNI
    runs: the CPU's tiles, or their model)."""
    from cbatch.ops import compiled

    native = quantized.isa("w4a8")
    if request.param == "avx2" and native in ("avx2", ""):
        pytest.skip("the native path here is already AVX2's")
    if request.param == "amx" and native != "avx512vnni":
        pytest.skip("no AVX512-VNNI here (the tiles' epilogue)")
    torch.ops.cbatch.set_cpu_options(request.param if request.param == "avx2" else "", "",
                                     "" if request.param == "amx" and HARDWARE_AMX else
                                     "model" if request.param == "amx" else "off")
    try:
        yield request.param
    finally:
        torch.ops.cbatch.set_cpu_options(*compiled._cpu_options())


def path(M: int = 1, K: int = 1, group_size: int = 32) -> str:
    """The kernel path counter a call of M rows, K k and group_size should move: the tiles'
    from 8 rows where they run, groups a multiple of 64 k and K's quads whole tiles."""
    tiles = "amx-int8" in cpu.cpu_isa() and M >= 8 and group_size % 64 == 0 and \
        -(-K // 32) * 8 % 16 == 0
    return f"quantized_linear.w4a8.{'amx' if tiles else quantized.isa('w4a8')}"


def _random_w4a8(N, K, group_size, gen):
    """The kernel's operands (W4A8 qweight, scales [G, N16]) and the unpacked q [N, K] in
    [-8, 7], s_w [G, N]."""
    qw, (q, s, _) = random_quantized(N, K, 4, group_size, False, gen)
    return pack_w4a8(qw), qw.scales, q - 8, s


def _run(x, qweight, scales, group_size, N, bias, zeros=None, mins=None):
    counter = path(*x.shape, group_size)
    before = cpu.kernel_paths()[counter]
    ours = torch.ops.cbatch.quantized_linear_w4a8(x, qweight, scales, group_size, N, bias,
                                                  zeros, mins)
    assert cpu.kernel_paths()[counter] == before + 1, counter
    assert ours.dtype == x.dtype and ours.shape == (x.shape[0], N)
    return ours


def _check(x, q, s_w, group_size, bias, ours, ref):
    """ours against the exact value (int64 group sums of the quantized x) and the reference."""
    xq, s_x = reference.quantize_per_group(x, group_size)
    M, K = x.shape
    G = s_x.shape[1]
    g = torch.arange(K) // group_size
    exact = torch.zeros(M, q.shape[0], dtype=torch.float64)
    size = torch.zeros_like(exact)
    for j in range(G):
        cols = g == j
        S = xq[:, cols].long() @ q[:, cols].long().t()  # [M, N], exact
        term = S.double() * s_w[j].double() * s_x[:, j, None].double()
        exact, size = exact + term, size + term.abs()
    b = 0 if bias is None else bias.double()
    n = G + 2
    bound = n * U / (1 - n * U) * (size + abs(b))
    if x.dtype == torch.bfloat16:
        bound = bound + (exact + b).abs() * 2.0 ** -8
    assert ((ours.double() - (exact + b)).abs() <= bound).all()
    if ref is not None:
        assert torch.equal(ours, ref)


def test_quantize_per_group_by_hand():
    """Per group of 4: scale = max |x| / 127, q = round(x * 127 / max) ties to even; a zero
    group 0, 0; the last group cut at K (6 = 4 + 2)."""
    x = torch.tensor([[254.0, 1.0, 3.0, -5.0, -1.0, 0.5],
                      [0.0, 0.0, 0.0, 0.0, 0.25, 0.0]])
    q, scale = reference.quantize_per_group(x, 4)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (2, 2)
    # 254: x * 0.5 -> 127, 0.5 -> 0, 1.5 -> 2, -2.5 -> -2; -1: x * 127 -> -127, 63.5 -> 64
    assert q.tolist() == [[127, 0, 2, -2, -127, 64], [0, 0, 0, 0, 127, 0]]
    assert scale.tolist() == [[2.0, torch.tensor(1 / 127, dtype=torch.float32).item()],
                              [0.0, torch.tensor(0.25 / 127, dtype=torch.float32).item()]]


def _ties(K, tops, gen):
    """A row of K values x.5 (every product x * 127 / 127 a tie) in (-127, 127), with the
    group tops 127 at ``tops`` (s_x 1, inv exactly 1)."""
    x = torch.randint(-126, 126, (1, K), generator=gen).float() + 0.5
    for k in tops:
        x[0, k] = 127.0 if k % 2 else -127.0
    return x


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_quantizes_x_as_the_reference(dtype):
    """x's quantization read back through a diagonal weight (7 on the diagonal: s_w 1, q 7) at
    x whose groups top out at 127 (s_x 1), so y[n] = 7 q_x[n]: every k but the tops a tie,
    rounded to even as nearbyint rounds it; groups of 32 (whole vectors of 8 k) and a last
    group of 13 (one vector and 5 k one at a time)."""
    K, group_size = 45, 32
    x = _ties(K, (5, 40), torch.Generator().manual_seed(3))
    q_x, s_x = reference.quantize_per_group(x, group_size)
    assert s_x.tolist() == [[1.0, 1.0]]
    assert torch.equal(q_x, torch.round(x).to(torch.int8))  # torch.round: ties to even
    qw = quantize(torch.eye(K) * 7, 4, group_size)
    assert torch.equal(qw.dequantize(), torch.eye(K) * 7) and qw.scales.max() == 1
    ours = _run(x.to(dtype), pack_w4a8(qw), qw.scales, group_size, K, None)
    assert torch.equal(ours, (7 * q_x.float()).to(dtype))


@pytest.mark.parametrize("N,K,group_size", [(1, 1, 32), (5, 3, 128), (33, 130, 32),
                                            (16, 256, 128), (20, 64, 64)])
def test_w4a8_layout_round_trips(N, K, group_size):
    """pack_w4a8: byte [b, i, 4 j + t] = q[16 b + j, 4 i + t] + 8 (low nibble) and
    q[16 b + 8 + j, 4 i + t] + 8 (high), 8 past K to a multiple of 32; unpack_w4a8 gives the
    weight back."""
    gen = torch.Generator().manual_seed(N + K)
    qw, (q, s, _) = random_quantized(N, K, 4, group_size, False, gen)
    packed = pack_w4a8(qw)
    assert packed.dtype == torch.uint8 and packed.shape == (-(-N // 16), -(-K // 32) * 8, 32)
    byte = packed[0, 0, 0].item()  # column 0 and column 8's k = 0
    assert byte & 15 == q[0, 0] and (N <= 8 or byte >> 4 == q[8, 0])
    if K > 1:
        assert packed[0, 0, 1].item() & 15 == q[0, 1]
    assert torch.equal(reference.unpack_w4a8(packed, N, K), q.to(torch.int32) - 8)
    past = reference.unpack_w4a8(packed, N, -(-K // 32) * 32)[:, K:]
    assert (past == 0).all()  # 8 past K: zero weights
    back = unpack_w4a8(packed, qw.scales, group_size, N, K)
    assert torch.equal(back.qweight, qw.qweight) and torch.equal(back.scales, qw.scales)


# (N, K, group_size): one column and one k, odd K and N, K a group less one, a group, a group
# and one (a last group of one k), several groups of 32, a partial last block
SHAPES = [(1, 1, 128), (5, 3, 32), (33, 127, 128), (17, 128, 128), (24, 129, 128),
          (130, 261, 32), (64, 512, 128), (7, 300, 64)]


@needs_kernel
@pytest.mark.parametrize("N,K,group_size", SHAPES)
def test_w4a8_matches_exact_integer_sums(N, K, group_size):
    """Rows 1, 2, 3, 8, 15 (VNNI's tiles of 8 and then 7 rows), 33 and 300 (past four chunks of
    64), fp32 and bf16 x, with and without bias; a row of zeros (the output is the bias), a
    group of zeros in another row, and an outlier in one group (its own scale only)."""
    gen = torch.Generator().manual_seed(N * 1000 + K)
    qweight, scales, q, s_w = _random_w4a8(N, K, group_size, gen)
    for M, dtype, with_bias in ((1, torch.float32, False), (2, torch.bfloat16, True),
                                (3, torch.float32, True), (8, torch.float32, False),
                                (15, torch.bfloat16, True), (33, torch.bfloat16, False),
                                (300, torch.float32, True)):
        x = torch.randn(M, K, generator=gen)
        if M > 1:
            x[M // 2] = 0
            x[0, :group_size] = 0
        x[-1, K // 2] = 1e4 if M > 2 else x[-1, K // 2]
        x = x.to(dtype)
        bias = (torch.randn(N, generator=gen) * 0.1).to(dtype) if with_bias else None
        ours = _run(x, qweight, scales, group_size, N, bias)
        ref = reference.quantized_linear_w4a8(x, qweight, scales, group_size, N, bias)
        _check(x, q, s_w, group_size, bias, ours, ref)
        if M > 1:
            assert torch.equal(ours[M // 2], torch.zeros(N, dtype=dtype) if bias is None
                               else bias.float().to(dtype))


@needs_kernel
@pytest.mark.parametrize("N,K,group_size", [(5, 3, 32), (33, 127, 128), (130, 261, 32),
                                            (7, 300, 64)])
def test_w4a8_with_zero_points_matches_exact_integer_sums(N, K, group_size):
    """Zero points per group and column (AWQ's, asymmetric GPTQ's): the weight's integers are
    the nibbles less z, each group's sum exact against the oracle's int64 sums of x's q times
    (q - z) from the drawn integers; rows 1, 4, 6 and 33, fp32 and bf16."""
    gen = torch.Generator().manual_seed(N * 7 + K)
    qw, (q, s_w, z) = random_quantized(N, K, 4, group_size, True, gen)
    qweight = pack_w4a8(qw)
    signed = q - z[torch.arange(K) // group_size].t()  # [N, K] in [-15, 15]
    for M, dtype, with_bias in ((1, torch.float32, True), (4, torch.bfloat16, False),
                                (6, torch.float32, True), (33, torch.float32, False)):
        x = torch.randn(M, K, generator=gen).to(dtype)
        bias = torch.randn(N, generator=gen).to(dtype) if with_bias else None
        ours = _run(x, qweight, qw.scales, group_size, N, bias, qw.zeros)
        ref = reference.quantized_linear_w4a8(x, qweight, qw.scales, group_size, N, bias,
                                              qw.zeros)
        _check(x, signed, s_w, group_size, bias, ours, ref)
    assert torch.equal(unpack_w4a8(qweight, qw.scales, group_size, N, K, qw.zeros).zeros,
                       qw.zeros)


def _check_mins(x, u, s_w, m, group_size, bias, ours, ref):
    """With mins: ours against the exact value (the module docstring) and the reference."""
    xq, s_x = reference.quantize_per_group(x, group_size)
    M, K = x.shape
    G = s_x.shape[1]
    g = torch.arange(K) // group_size
    exact = torch.zeros(M, u.shape[0], dtype=torch.float64)
    size = torch.zeros_like(exact)
    for j in range(G):
        cols = g == j
        S = xq[:, cols].long() @ u[:, cols].long().t()  # [M, N], exact
        Sx = xq[:, cols].long().sum(dim=1, keepdim=True)  # [M, 1]
        sx = s_x[:, j, None].double()
        part, less = S.double() * s_w[j].double() * sx, m[j].double() * Sx.double() * sx
        exact, size = exact + part - less, size + part.abs() + less.abs()
    b = 0 if bias is None else bias.double()
    n = 2 * G + 2
    bound = n * U / (1 - n * U) * (size + abs(b))
    if x.dtype == torch.bfloat16:
        bound = bound + (exact + b).abs() * 2.0 ** -8
    assert ((ours.double() - (exact + b)).abs() <= bound).all()
    assert torch.equal(ours, ref)


@needs_kernel
@pytest.mark.parametrize("N,K,group_size", [(1, 1, 32), (5, 3, 64), (33, 127, 32),
                                            (24, 129, 64), (130, 261, 32), (7, 300, 64),
                                            (17, 200, 128)])
def test_w4a8_with_mins_is_the_reference(N, K, group_size):
    """W = s_w u - m (llama.cpp's Q4_1 / Q4_K x Q8 route): rows 1..9 (AVX2's tiles of 4 and
    VNNI's of 8, and their rests), 33 and 300 (chunks of 64 rows; the tiles' path where
    they run), fp32 and bf16 x, with and without bias, ragged K (a short last group) and odd
    N: the reference's bits and within the bound of the exact value; a row of zeros gives the
    bias (its s_x is 0, and so its mins' term)."""
    gen = torch.Generator().manual_seed(N * 31 + K + group_size)
    qw, (u, s_w, m) = random_with_mins(N, K, 4, group_size, gen)
    qweight = pack_w4a8(qw)
    for M in (*range(1, 10), 33, 300):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(M, K, generator=gen)
            if M > 1:
                x[M // 2] = 0
            x = x.to(dtype)
            bias = (torch.randn(N, generator=gen) * 0.1).to(dtype) if M % 2 else None
            ours = _run(x, qweight, qw.scales, group_size, N, bias, None, qw.mins)
            ref = reference.quantized_linear_w4a8(x, qweight, qw.scales, group_size, N, bias,
                                                  None, qw.mins)
            _check_mins(x, u, s_w, m, group_size, bias, ours, ref)
            if M > 1:
                assert torch.equal(ours[M // 2], torch.zeros(N, dtype=dtype) if bias is None
                                   else bias.float().to(dtype))
    back = unpack_w4a8(qweight, qw.scales, group_size, N, K, None, qw.mins)
    assert torch.equal(back.qweight, qw.qweight) and back.mins is qw.mins


@needs_kernel
def test_extreme_integers_are_exact():
    """q all -8 or 7 against x quantized to +-127 in groups of 65536 (the largest the kernel
    takes): the int16 runs' and the group sums' largest magnitudes come out exact."""
    K, N, gs = 65536 + 64, 20, 65536
    q = torch.where(torch.arange(N)[:, None] % 2 == 0, 0, 15).expand(N, K)
    s = torch.rand(2, N, generator=torch.Generator().manual_seed(0)) + 0.5
    qw = pack(q, s, None, 4, gs)
    qweight = pack_w4a8(qw)
    x = torch.ones(3, K)
    x[1] = -1
    x[2, ::2] = -1
    ours = _run(x, qweight, qw.scales, gs, N, None)
    _check(x, q - 8, s, gs, None, ours,
           reference.quantized_linear_w4a8(x, qweight, qw.scales, gs, N, None))
    # zero points 15 under nibbles 0 and 0 under 15: integers -15 and 15, the widest they get
    z = torch.where(torch.arange(N) % 2 == 0, 15, 0).expand(2, N)
    qz = pack(q, s, z, 4, gs)
    ours = _run(x, qweight, qz.scales, gs, N, None, qz.zeros)
    _check(x, q - z[0][:, None], s, gs, None, ours,
           reference.quantized_linear_w4a8(x, qweight, qz.scales, gs, N, None, qz.zeros))
    with pytest.raises(ValueError, match="must be a multiple of 32 in \\[32, 65536\\]"):
        torch.ops.cbatch.quantized_linear_w4a8(x, qweight, qw.scales, 2 * gs, N, None)


@needs_kernel
def test_many_rows_and_rows_are_independent():
    """2048 rows: within the bound, and each row bitwise the row computed alone, and in a
    batch of 8 at another offset."""
    gen = torch.Generator().manual_seed(5)
    N, K, gs = 40, 256, 128
    qweight, scales, q, s_w = _random_w4a8(N, K, gs, gen)
    x = torch.randn(2048, K, generator=gen).to(torch.bfloat16)
    ours = _run(x, qweight, scales, gs, N, None)
    _check(x, q, s_w, gs, None, ours, None)
    for m in (0, 3, 64, 2047):
        alone = torch.ops.cbatch.quantized_linear_w4a8(x[m:m + 1], qweight, scales, gs, N, None)
        assert torch.equal(alone, ours[m:m + 1])
    eight = torch.ops.cbatch.quantized_linear_w4a8(x[61:69], qweight, scales, gs, N, None)
    assert torch.equal(eight, ours[61:69])


@needs_kernel
def test_amx_tiles_are_the_vnni_tile_bit_for_bit(isa):
    """The tiles' group sums are the VNNI tile's exact integers and their epilogue its
    add_group and store_tile, so every output is the VNNI path's to the bit: 8 rows (mostly
    zero rows in the tiles), 33 (a partial pair of row tiles), 300 rows of K = 4096 in groups
    of 256 with zero points (three chunks of 128 rows), a short last group, odd N (a last
    block alone in its pair), with mins; groups of 32 and 7 rows stay on VNNI."""
    if isa != "amx":
        pytest.skip("the tiles' test")
    gen = torch.Generator().manual_seed(12)
    for M, N, K, gs, zp in ((8, 16, 64, 64, False), (33, 100, 960, 128, True),
                            (300, 40, 4096, 256, True), (40, 17, 300, 64, False),
                            (16, 32, 128, 32, False), (7, 48, 256, 128, True),
                            (33, 40, 960, 128, "mins"), (8, 17, 300, 64, "mins")):
        qw, _ = random_with_mins(N, K, 4, gs, gen) if zp == "mins" else \
            random_quantized(N, K, 4, gs, zp, gen)
        qweight = pack_w4a8(qw)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(M, K, generator=gen).to(dtype)
            bias = torch.randn(N, generator=gen).to(dtype) if zp else None
            ours = _run(x, qweight, qw.scales, gs, N, bias, qw.zeros, qw.mins)
            torch.ops.cbatch.set_cpu_options("", "", "off")
            vnni = torch.ops.cbatch.quantized_linear_w4a8(x, qweight, qw.scales, gs, N, bias,
                                                          qw.zeros, qw.mins)
            torch.ops.cbatch.set_cpu_options("", "", "" if HARDWARE_AMX else "model")
            assert torch.equal(ours, vnni), (M, N, K, gs, dtype)


@needs_kernel
def test_the_layer_runs_the_kernel():
    gen = torch.Generator().manual_seed(2)
    qw, (q, s, _) = random_quantized(24, 70, 4, 32, False, gen)
    layer = QuantizedLinear(qw, torch.randn(24, generator=gen), act_bits=8)
    x = torch.randn(2, 5, 70, generator=gen)
    before = cpu.kernel_paths()[path(10, 70, 32)]
    y = layer(x)
    assert cpu.kernel_paths()[path(10, 70, 32)] == before + 1 and y.shape == (2, 5, 24)
    _check(x.view(10, 70), q - 8, s, 32, layer.bias.detach(), y.view(10, 24),
           reference.quantized_linear_w4a8(x.view(10, 70), layer.qweight, layer.scales, 32,
                                           24, layer.bias))


@pytest.mark.slow
@needs_kernel
def test_opcheck():
    gen = torch.Generator().manual_seed(0)
    qweight, scales, _, _ = _random_w4a8(24, 66, 32, gen)
    torch.library.opcheck(torch.ops.cbatch.quantized_linear_w4a8,
                          (torch.randn(3, 66, generator=gen), qweight, scales, 32, 24, None))
    qw, _ = random_with_mins(24, 66, 4, 32, gen)
    torch.library.opcheck(torch.ops.cbatch.quantized_linear_w4a8,
                          (torch.randn(3, 66, generator=gen), pack_w4a8(qw), qw.scales, 32, 24,
                           None, None, qw.mins))


@needs_kernel
@pytest.mark.parametrize("change,match", [
    (dict(out_features=40), "does not hold 4-bit W4A8 40 x 66 \\(expected \\[3, 24, 32\\]\\)"),
    (dict(group_size=64), "scales must be a dense float32 \\[2, 32\\]"),
    (dict(group_size=48), "4-bit weights must be a multiple of 32"),
    (dict(qweight=torch.zeros(2, 24, 32, dtype=torch.int16)), "a W4A8 qweight is uint8"),
    (dict(scales=torch.zeros(1, 32)), "scales must be a dense float32 \\[3, 32\\]"),
    (dict(bias=torch.zeros(23)), "bias must be \\[24\\]"),
    (dict(zeros=torch.zeros(3, 32, dtype=torch.int32)), "zeros must be None or a dense int8 "
                                                        "\\[3, 32\\]"),
    (dict(x=torch.zeros(3, 66, dtype=torch.float16)), "x must be float32 or bfloat16"),
    (dict(mins=torch.zeros(3, 32, dtype=torch.float16)), "mins must be None or a dense "
                                                         "float32 \\[3, 32\\]"),
    (dict(mins=torch.zeros(3, 32), zeros=torch.zeros(3, 32, dtype=torch.int8)),
     "mins and zeros exclude each other"),
])
def test_bad_operands_get_a_sentence(change, match):
    qweight, scales, _, _ = _random_w4a8(24, 66, 32, torch.Generator().manual_seed(0))
    args = dict(x=torch.zeros(3, 66), qweight=qweight, scales=scales, group_size=32,
                out_features=24, bias=None, zeros=None, mins=None)
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        torch.ops.cbatch.quantized_linear_w4a8(*args.values())


@needs_kernel
@pytest.mark.parametrize("strided", [False, True])
def test_bf16_output_rounds_as_torch(strided):
    """A bf16 x gets its output rounded from fp32 in the kernel's epilogue (no fp32 copy):
    bitwise as ``Tensor.to(torch.bfloat16)`` rounds, ties to even, overflow to inf, NaN kept.
    A zero weight makes every output its fp32 bias alone, so the cases are exact fp32 values;
    x's rows may be strided (the kernel reads them in place)."""
    N, K, gs = 40, 64, 32
    qw, _ = random_quantized(N, K, 4, gs, False, torch.Generator().manual_seed(0))
    qw.qweight.fill_(0x88)  # u = 8 in both nibbles: q = 0
    one = 1.0
    cases = [one + 2.0 ** -8,            # halfway: to even (1)
             one + 3 * 2.0 ** -8,        # halfway: to even (1 + 2^-6)
             one + 2.0 ** -8 + 2.0 ** -20,  # just above halfway: up
             -(one + 2.0 ** -8),
             3.4028234663852886e38,      # the largest fp32: overflows to inf
             -3.4028234663852886e38, 3.3895313892515355e38,  # the largest bf16: kept
             float("inf"), float("-inf"), float("nan"),
             2.0 ** -130,                # fp32 subnormal
             1e-45, 0.0, -0.0, 65504.0, 1.0e10 + 123.0]
    bias = torch.tensor((cases * 3)[:N], dtype=torch.float32)
    x = torch.randn(6, 2 * K if strided else K).to(torch.bfloat16)
    x = x[:, :K] if strided else x
    ours = _run(x, pack_w4a8(qw), qw.scales, gs, N, bias)
    want = (torch.zeros(N) + bias).to(torch.bfloat16).expand(6, N)  # 0 + -0 is +0
    nan = want.isnan()
    assert torch.equal(ours.isnan(), nan)
    assert torch.equal(ours.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    ref = reference.quantized_linear_w4a8(x, pack_w4a8(qw), qw.scales, gs, N, bias)
    assert torch.equal(ours.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])


def test_fma32_rounds_once():
    """reference.fma32 is a * b + c rounded once to fp32 (to nearest even): against exact
    rationals on random operands, and where the float64 sum lands on an fp32 midpoint that the
    exact sum is not on (1 + 2^-23 + 2^-24 - 2^-70: a float64 rounding then an fp32 one would
    give 1 + 2^-22) and where it is exactly on one (ties to even)."""
    from fractions import Fraction

    def exact(a, b, c):
        v = Fraction(a) * Fraction(b) + Fraction(c)
        near = torch.tensor(float(v), dtype=torch.float32)
        cands = [torch.nextafter(near, torch.tensor(-float("inf"))), near,
                 torch.nextafter(near, torch.tensor(float("inf")))]
        return min(cands, key=lambda t: (abs(Fraction(t.item()) - v),
                                         t.view(torch.int32).item() & 1)).item()

    gen = torch.Generator().manual_seed(3)
    a, b, c = (torch.randn(3000, generator=gen) * s for s in (1.0, 1e-3, 1e-2))
    got = reference.fma32(a, b, c)
    assert [got[i].item() for i in range(3000)] == \
        [exact(a[i].item(), b[i].item(), c[i].item()) for i in range(3000)]
    e = 2.0 ** -23
    a = torch.tensor([2.0 ** -24 * (1 + e), -2.0 ** -24 * (1 + e), 2.0 ** -24, 2.0 ** -24])
    b = torch.tensor([1 - e, 1 - e, 1.0, 1.0])
    c = torch.tensor([1 + e, -(1 + e), 1.0, 1 + e])
    assert reference.fma32(a, b, c).tolist() == [1 + e, -(1 + e), 1.0, 1 + 2 * e]
