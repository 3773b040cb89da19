"""cbatch's bf16 linear on its AVX2 tiles (csrc/cpu/gemm.h, namespace avx2): bf16 x and W
widened to fp32 in registers, each output one fp32 sum over k in order, the bias, GELU (tanh)
and residual in fp32, rounded to bf16 once.  Run on any x86 CPU with AVX2 (an AVX-512 one is
capped at its AVX2 paths), against an oracle in pure torch that does the same arithmetic
op by op, and against the float64 product."""

import pytest
import torch
import torch.nn.functional as F

from cbatch.ops import compiled, cpu
from tests.helpers import CPU_FLAGS, needs_cpu_ext

pytestmark = [needs_cpu_ext, pytest.mark.skipif(
    not {"avx2", "fma", "f16c"} <= CPU_FLAGS, reason="no AVX2, FMA and F16C here")]

PATH = "linear.bf16.avx2"


@pytest.fixture(autouse=True)
def avx2_paths():
    """The AVX2 tiles whatever the CPU; the options the extension's loader set, after."""
    torch.ops.cbatch.set_cpu_options("avx2", "")
    yield
    torch.ops.cbatch.set_cpu_options(*compiled._cpu_options())


def _runs() -> int:
    return cpu.kernel_paths().get(PATH, 0)


def _linear(x, w, bias=None, gelu=None, residual=None):
    """The kernel on w packed, counted: exactly one call of the AVX2 bf16 tile."""
    packed = cpu.pack(w, "cbatch")
    before = _runs()
    y = cpu.packed_linear(x, packed, bias, w.shape[0], gelu=gelu, residual=residual)
    assert _runs() == before + 1
    assert y.dtype == torch.bfloat16 and y.shape == (x.shape[0], w.shape[0])
    return y


def _oracle(x, w, bias=None, gelu=None, residual=None):
    """The kernel's arithmetic in torch: from zero, k = 0, 1, ... in order, one fp32 rounding
    per k (a product of two bf16 is exact in fp32, so each add is the kernel's fma), + the
    bias (0 without one), GELU, + the residual, in fp32; then torch's cast to bf16."""
    xf, wf = x.float(), w.float()
    acc = torch.zeros(x.shape[0], w.shape[0])
    for k in range(x.shape[1]):
        acc = acc + xf[:, k:k + 1] * wf[:, k]
    acc = acc + (bias.float() if bias is not None else 0.0)
    if gelu:
        acc = F.gelu(acc, approximate=gelu)
    if residual is not None:
        acc = residual.float() + acc
    return acc.bfloat16()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, but any NaN for a NaN (torch's own casts write NaN as 0x7fc0 or 0xffff)."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and \
        torch.equal(a[~nan].view(torch.int16), b[~nan].view(torch.int16))


def _random(M, N, K, seed, scale=0.05):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, K, generator=gen) * scale).bfloat16()
    x = torch.randn(M, K, generator=gen).bfloat16()
    b = (torch.randn(N, generator=gen) * scale).bfloat16()
    res = torch.randn(M, N, generator=gen).bfloat16()
    return x, w, b, res


def test_bf16_route_is_cbatch_on_avx2():
    """With AVX2 and FMA, bf16 linears run cbatch's kernel (not oneDNN's emulated bf16)."""
    assert torch.ops.cbatch.cpu_linear_supported(torch.bfloat16)
    assert cpu.cpu_linear_route(torch.bfloat16) == "cbatch"


# N: below, at, above and far from a block of 16; K: one pair, odd pairs, long
@pytest.mark.parametrize("N", [1, 7, 8, 15, 16, 17, 40, 123])
@pytest.mark.parametrize("K", [2, 6, 98, 768])
@pytest.mark.parametrize("M", [1, 3, 4, 5, 9, 16, 17, 70])
def test_matches_the_op_by_op_oracle_bitwise(M, N, K):
    """Rows in every tile size (1-4) and x unpacked (below 16 rows) or packed, chunks of 64
    rows; the last block's columns partly past N."""
    x, w, b, _ = _random(M, N, K, seed=M * 1000 + N * 10 + K)
    assert _same(_linear(x, w, b), _oracle(x, w, b))
    assert _same(_linear(x, w), _oracle(x, w))


@pytest.mark.parametrize("M", [1, 2, 8, 64, 65, 130, 300])
def test_within_the_float64_product(M):
    """The float64 product, rounded to bf16: within half a bf16 step of the fp32 sum plus the
    sum's own error, K u sum |x w| (u = 2^-24), at 1-300 rows (several chunks)."""
    N, K = 100, 960
    x, w, b, _ = _random(M, N, K, seed=M)
    y = _linear(x, w, b).double()
    truth = F.linear(x.double(), w.double(), b.double())
    sum_err = (K + 1) * 2.0 ** -24 * F.linear(x.double().abs(), w.double().abs(), b.double().abs())
    step = truth.abs() * 2.0 ** -8  # half a bf16 step is at most 2^-8 relative
    assert ((y - truth).abs() <= step + sum_err * (1 + 2.0 ** -8) + 1e-30).all()


@pytest.mark.parametrize("M", [1, 6, 33])
def test_epilogues(M):
    """The bias, GELU (tanh) and residual enter as in the AVX-512 tile: all in fp32, rounded
    once.  The residual is bitwise.  GELU is the kernel's own (its e^x, and 1 + tanh as
    2 - 2 / (1 + e^2u), which cancels for sums far below 0): within one bf16 step of torch's
    GELU on the same sums, or 2^-20 of the sum, and nearly all equal."""
    N, K = 77, 130
    x, w, b, res = _random(M, N, K, seed=7 + M, scale=0.2)
    assert _same(_linear(x, w, b, residual=res), _oracle(x, w, b, residual=res))
    assert _same(_linear(x, w, residual=res), _oracle(x, w, residual=res))
    got, want = _linear(x, w, b, gelu="tanh").float(), _oracle(x, w, b, gelu="tanh").float()
    pre = _oracle(x, w, b).float()
    assert ((got - want).abs() <= want.abs() * 2.0 ** -7 + pre.abs() * 2.0 ** -20).all()
    assert (got == want).float().mean() > 0.9
    # GELU other than tanh: the kernel's sum rounded to bf16, then F.gelu (packed_linear)
    exact = _linear(x, w, b, gelu="none")
    assert torch.equal(exact, F.gelu(_oracle(x, w, b), approximate="none"))


def test_rounding_to_bf16_is_torchs_cast():
    """Sums hi + lo exact in fp32 (K = 2, W = 1) that sit on ties (round to even), beside
    them, in bf16's subnormals, past its largest (to inf), and NaN: each rounds to bf16 as
    torch casts the fp32 sum."""
    gen = torch.Generator().manual_seed(3)
    hi = (torch.randn(2000, generator=gen) * 2.0 ** torch.randint(-20, 20, (2000,),
                                                                  generator=gen)).bfloat16()
    kind = torch.arange(2000) % 4
    shift = torch.tensor([-8.0, -9.0, -8.0, -12.0])[kind]  # ties at 2^-8 of hi
    lo = (hi.float() * 2.0 ** shift * torch.where(kind == 2, -1.0, 1.0)).bfloat16()
    special = torch.tensor([[2.0 ** -130, 2.0 ** -132],  # subnormal sums
                            [-(2.0 ** -133), 0.0],
                            [3.3e38, 1.0e37],             # to bf16's inf
                            [float("nan"), 1.0],
                            [float("inf"), float("-inf")],  # NaN
                            [-0.0, -0.0]]).bfloat16()
    x = torch.cat([torch.stack([hi, lo], dim=1), special])
    w = torch.ones(1, 2, dtype=torch.bfloat16)
    y = _linear(x, w)
    want = (x[:, :1].float() + x[:, 1:].float()).bfloat16()
    want[-1] = 0.0  # -0 + -0 + the absent bias (+0): +0, as avx512::tile adds it
    assert _same(y, want)
    assert torch.isnan(y[-3:-1]).all() and torch.isinf(y[-4]).all()


def test_rows_are_independent_of_the_batch_and_threads():
    """A row alone, in any slice of a long chunk and at any thread count: bitwise the same
    (each output one thread's sum over k in order)."""
    x, w, b, res = _random(300, 200, 960, seed=11)
    full = _linear(x, w, b, residual=res)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for rows in (slice(0, 1), slice(7, 8), slice(5, 13), slice(3, 70), slice(250, 300)):
                assert _same(_linear(x[rows], w, b, residual=res[rows]), full[rows])
    finally:
        torch.set_num_threads(before)


def test_strided_rows_and_odd_k():
    """x and the residual with rows apart (views of wider tensors) give the dense result; an
    odd K has no packed bf16 layout (pairs of k) and the op says so."""
    x, w, b, res = _random(9, 40, 64, seed=5)
    wide_x = torch.cat([x, x], dim=1)[:, :64]
    wide_res = torch.cat([res, res], dim=1)[:, :40]
    assert not wide_x.is_contiguous() and not wide_res.is_contiguous()
    assert _same(_linear(wide_x, w, b, residual=wide_res), _oracle(x, w, b, residual=res))
    with pytest.raises(ValueError, match="even number of input features"):
        torch.ops.cbatch.linear(torch.randn(2, 7).bfloat16(),
                                torch.zeros(3, 7, 16, dtype=torch.bfloat16), 40, None, None,
                                "none")
