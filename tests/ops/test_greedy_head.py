"""The lm_head's greedy screens (cbatch.ops.cpu.greedy_head, csrc/cpu/greedy_head.cpp's
greedy_head_cpu): the argmax of the kernel's logits, bit for bit, read through a smaller copy
of the weight (int8 with a scale per column, or for fp32 bf16).  The int8 screens run
AVX512-VNNI's tile where the CPU has it, else AVX2's; a bf16 lm_head's kept columns are summed
as its kernel sums them (AVX512-BF16's vdpbf16ps, else AVX2's fmas)."""

import pytest
import torch

from cbatch import LLM, Engine, SamplingParams
from cbatch.ops import cpu
from cbatch.core.cpu.packing import pack_linears, unpack_linears
from cbatch.models.loader import load_model

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.skipif(not cpu.screen_available(torch.float32),
                       reason="the greedy screen runs on x86 CPUs with AVX2 or AVX-512"),
]
BF16 = pytest.mark.skipif(not cpu.screen_available(torch.bfloat16),
                          reason="a bf16 lm_head's screen (int8) needs cbatch's bf16 kernel")
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=BF16)]
# (the lm_head's dtype, whether its screen is int8): every screen this CPU may run
KINDS = [pytest.param((torch.float32, False), id="fp32-bf16screen"),
         pytest.param((torch.float32, True), id="fp32-int8screen"),
         pytest.param((torch.bfloat16, True), id="bf16-int8screen", marks=BF16)]


def _kernel_argmax(x, packed, N):
    """What an unscreened greedy step answers: torch's argmax of the kernel's logits."""
    return cpu.packed_linear(x, packed, None, N).argmax(dim=-1)


def _check(x, w, int8=None):
    packed, screen = cpu.pack(w, "cbatch"), cpu.pack_screen(w, int8)
    if int8 is not None:
        assert screen.weight.dtype == (torch.int8 if int8 else torch.bfloat16)
    got = cpu.greedy_head(x, packed, screen, w.shape[0])
    assert got.dtype == torch.int64 and got.shape == (x.shape[0],)
    assert torch.equal(got, _kernel_argmax(x, packed, w.shape[0]))


def _screen_argmax(x, w, int8):
    """The screen's own answer, without the kernel's sums (near enough: x unrounded)."""
    if int8:
        q, scales = cpu._quantize_int8(w)
        copy = q.float() * scales[:, None]
    else:
        x, copy = x.bfloat16().float(), w.bfloat16().float()
    return (x.float() @ copy.T).argmax(dim=-1)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("M", [1, 3, 8, 17, 70])
@pytest.mark.parametrize("N,K", [(37, 2), (1000, 64), (4099, 768)])
def test_tokens_are_the_kernels_argmax(kind, M, N, K):
    """Fresh random weights and rows of very different scales (1e-3 to 1e3); N not a
    multiple of 16; row counts below, at and past the kernel's tile and packing sizes (from
    16 rows a bf16 lm_head computes its logits: no screen)."""
    gen = torch.Generator().manual_seed(M * N + K)
    w = torch.randn(N, K, generator=gen) * torch.rand(N, 1, generator=gen) * 0.1
    x = torch.randn(M, K, generator=gen) * 10.0 ** torch.randint(-3, 4, (M, 1), generator=gen)
    dtype, int8 = kind
    _check(x.to(dtype), w.to(dtype), int8)


@pytest.mark.parametrize("kind", KINDS)
def test_near_ties_are_settled_by_the_kernels_sums(kind):
    """Columns the screen cannot tell apart: copies of one column moved by less than the
    screen's error (bf16 screen: 1e-4, under a bf16 step; int8 screen: 1%, under the int8
    step made 20x coarser by one large weight in each, and for bf16 where many logits round
    to one bf16),
    where the kernel's logits decide (and the screen's own argmax is wrong for some rows),
    and exact duplicates of each row's winner further on (the first index wins, as
    torch.argmax)."""
    dtype, int8 = kind
    gen = torch.Generator().manual_seed(0)
    K, N = 256, 300
    x = torch.randn(12, K, generator=gen)  # below 16 rows: the bf16 screen's
    x[:, 0] = x[:, 0].abs()
    x = x.to(dtype)
    w = torch.randn(N, K, generator=gen) * 0.02
    best = 0.5 * x.float().sum(0) / x.float().sum(0).norm()  # a column every row likes
    near = list(range(40, 260, 7))
    move = 1e-2 if int8 else 1e-4
    for j in near:
        w[j] = best * (1 + move * torch.randn(K, generator=gen))
        if int8:
            w[j, 0] = 20 * best.abs().max()
    w = w.to(dtype)
    packed = cpu.pack(w, "cbatch")
    winners = _kernel_argmax(x, packed, N)
    assert set(winners.tolist()) <= set(near)
    assert (_screen_argmax(x, w, int8) != winners).any()  # the screen alone would not do
    for i, j in enumerate(winners.tolist()):
        w[261 + i] = w[j]  # a later tie of the winner (or a copy of an earlier one's)
    _check(x, w, int8)
    _check(x.flip(0), w, int8)


FP32_KINDS = KINDS[:2]


def _check_settled(x, w, int8):
    """_check, and the screen's own path ran (this CPU's int8 tile, or the bf16 screen) and
    settled every row itself."""
    path = _int8_path() if int8 else _bf16_path()
    before = cpu.kernel_paths()
    _check(x, w, int8)
    after = cpu.kernel_paths()
    assert after[path] == before[path] + 1
    assert after["greedy_head.unsettled_rows"] == before["greedy_head.unsettled_rows"]


@pytest.mark.parametrize("kind", FP32_KINDS)
@pytest.mark.parametrize("power", [0, -40, 60])
def test_fp32_logits_whole_ulps_apart(kind, power):
    """Near ties whose fp32 logits are exact and differ by whole ulps.  Weights are whole
    units (2^power; each column's largest 127 units, so exact in int8 too) and x is 80 but on
    4 fine k, where it is -1, 0 or 1: a near column's logit is 80 * 127 * 1020 units plus a
    few, in [2^23, 2^24) units, where a unit is one ulp, and every partial sum is exact.  The
    screen's bound is far wider than these gaps; the kernel's sums decide, and float64 gives
    the same logits: exact ties go to the first column, one ulp more wins."""
    _, int8 = kind
    K, N, M, fine = 1024, 300, 24, 4
    gen = torch.Generator().manual_seed(11)
    w = torch.randint(-127, 128, (N, K), generator=gen).float()
    near = list(range(20, 280, 9))
    w[near] = 127.0
    w[near, :fine] = torch.randint(-3, 4, (len(near), fine), generator=gen).float()
    w[:, fine] = 127.0
    w *= 2.0 ** power
    x = torch.full((M, K), 80.0)
    x[:, :fine] = torch.randint(-1, 2, (M, fine), generator=gen).float()
    exact = x.double() @ w.double().T
    logits = cpu.packed_linear(x, cpu.pack(w, "cbatch"), None, N)
    assert torch.equal(logits.double(), exact)  # every sum exact
    top2 = logits[:, near].topk(2, dim=-1).values
    assert (top2[:, 0] == top2[:, 1]).any()  # exact ties
    assert (torch.nextafter(top2[:, 0], torch.tensor(-1.0)) == top2[:, 1]).any()  # one ulp
    assert set(exact.argmax(dim=-1).tolist()) <= set(near)
    _check_settled(x, w, int8)
    got = cpu.greedy_head(x, cpu.pack(w, "cbatch"), cpu.pack_screen(w, int8), N)
    assert torch.equal(got, exact.argmax(dim=-1))  # float64's first maximum


@pytest.mark.parametrize("kind", FP32_KINDS)
def test_fp32_logits_that_only_rounding_tells_apart(kind):
    """Near ties that differ from one column in one weight by a 2^-22 part of it: their exact
    sums differ by less than an ulp of the logit, so which fp32 logit is largest, and which
    ones tie, is the kernel's rounding alone (one fma per k, in order, from zero), and the
    correctly rounded sums pick another column in some rows.  Exact duplicates further on
    tie with the winner.  The screen cannot tell them apart; the logits it recomputes must be
    the kernel's bit for bit."""
    _, int8 = kind
    K, N, M = 768, 400, 64
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(M, K, generator=gen)
    w = torch.randn(N, K, generator=gen) * 0.02
    base = 2 * x.sum(0) / x.sum(0).norm()  # a column every row likes (logits ~7)
    near = list(range(30, 330, 6))
    for j in near:
        w[j] = base
        k = int(torch.randint(0, K, (), generator=gen))
        w[j, k] += base[k] * 2.0 ** -22 * float(torch.randn((), generator=gen))
    w[350:360] = w[near[:10]]  # later exact copies
    logits = cpu.packed_linear(x, cpu.pack(w, "cbatch"), None, N)
    winners = logits.argmax(dim=-1)
    assert set(winners.tolist()) <= set(near)
    top2 = logits[:, near].topk(2, dim=-1).values
    assert (top2[:, 0] == top2[:, 1]).any()
    assert (torch.nextafter(top2[:, 0], torch.tensor(-1.0)) == top2[:, 1]).any()
    rounded = (x.double() @ w.double().T).float()  # the same sums, correctly rounded
    assert not torch.equal(rounded.argmax(dim=-1), winners)
    _check_settled(x, w, int8)
    _check_settled(x.flip(0), w, int8)


UNIT = 2.0 ** -14  # weights in multiples of it with a column maximum of 127 units: exact in int8


def _column(units, K):
    """A column of whole units, 127 at k = 0, summing to ``units`` (x = ones)."""
    c = torch.zeros(K)
    c[0] = 127
    rest = units - 127
    c[1:] = rest // (K - 1)
    c[1:1 + rest - rest // (K - 1) * (K - 1)] += 1
    assert c.abs().max() <= 127 and c.sum() == units
    return c * UNIT


@BF16
def test_bf16_logits_that_round_alike_go_to_the_first():
    """A bf16 lm_head's logits are its fp32 sums rounded to bf16: an earlier column whose sum
    is smaller by far more than the screen's error, but rounds to the same bf16, ties with the
    later one and wins (the screen's cut follows bf16's steps, not only its error bound).
    Every weight here is exact in the int8 copy but one, so the bound is ~1e-4."""
    K = 256
    x = torch.ones(2, K, dtype=torch.bfloat16)  # exact in int16 too
    gen = torch.Generator().manual_seed(3)
    w = torch.randint(-127, 128, (100, K), generator=gen) * UNIT  # sums within +-0.3
    w[:, 0] = 127 * UNIT  # each column's largest magnitude: scale 2^-14, exact
    w[30] = 2.0 ** -8
    w[30, 5] = 0.875 * 2.0 ** -8  # sums to 1 - 2^-11 in fp32, to 1 in bf16
    w[70] = 2.0 ** -8  # sums to exactly 1
    w = w.bfloat16()
    packed = cpu.pack(w, "cbatch")
    logits = cpu.packed_linear(x, packed, None, 100)
    assert logits[0, 30] == logits[0, 70] == 1.0 and logits.max() == 1.0
    screen = cpu.pack_screen(w)
    assert screen.error_norm < 1e-5
    assert cpu.greedy_head(x, packed, screen, 100).tolist() == [30, 30]
    _check(x, w)
    w[[30, 70]] = w[[70, 30]]  # the larger sum first: still 30
    _check(x, w)


@BF16
@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("power", [0, 3, -5, 20, -60])
def test_bf16_ties_a_whole_step_apart_on_both_signs(sign, power):
    """Sums 1 - 2^-10 and 1 + 2^-9 (times 2^power, and negated) both round to one bf16, a
    whole bf16 step below the larger: the earlier column wins, so the cut keeps a column one
    step below the bf16 at or under the top's lower bound (and finds that bf16 for negative
    values too).  Exact int8 weights: the bound is tiny beside the step."""
    K, one = 256, 2 ** 14
    gen = torch.Generator().manual_seed(power + 100 * sign)
    w = torch.randint(-60, 60, (100, K), generator=gen).float() * UNIT
    w[:, 0] = 127 * UNIT
    earlier, later = (one - 16, one + 32) if sign > 0 else (one + 32, one - 16)
    w[30], w[70] = _column(earlier, K), _column(later, K)
    if sign < 0:  # every other column far below
        w[[i for i in range(100) if i not in (30, 70)]] = 127 * UNIT
    w = (w * 2.0 ** power).bfloat16()
    x = torch.full((3, K), float(sign), dtype=torch.bfloat16)
    _check(x, w)
    assert cpu.greedy_head(x, cpu.pack(w, "cbatch"), cpu.pack_screen(w),
                                    100).tolist() == [30, 30, 30]


@BF16
def test_bf16_random_ties_of_exact_int8_columns():
    """Columns that differ in a few whole units (exact in int8, so the bound is only the
    kernel's rounding) against x of small integers, at scales 2^-54 to 2^26: bf16 rounding
    makes ties of logits that differ in fp32 at every magnitude and sign."""
    gen = torch.Generator().manual_seed(7)
    for _ in range(100):
        N, K = 64, 128
        base = torch.randint(-127, 128, (K,), generator=gen).float()
        base[0] = 127
        w = base.repeat(N, 1)
        w.scatter_add_(1, torch.randint(1, K, (N, 3), generator=gen),
                       torch.randint(-3, 4, (N, 3), generator=gen).float())
        w = w.clamp(-127, 127) * 2.0 ** (int(torch.randint(-40, 40, (), generator=gen)) - 14)
        x = torch.randint(-3, 4, (5, K), generator=gen).float()
        x *= 2.0 ** int(torch.randint(-20, 20, (), generator=gen))
        x[:, 0] = torch.randn(5, generator=gen).sign() * 3
        _check(x.bfloat16(), w.bfloat16())


def _bound_case(name):
    """x, W (both exact in bf16) and the kernel's token for a row that one term of the bf16
    screen's bound (csrc/cpu/greedy_head.cpp, the bound's proof at its top) decides."""
    if name == "x quantization":  # small entries that round to level 0 carry the winner
        K = 1024
        x = torch.full((1, K), 63 / 128 * UNIT)
        x[0, 0] = 1
        w = torch.zeros(8, K)
        w[:, 0] = 100 * UNIT
        w[2, 0] = 127 * UNIT  # the screen's top
        w[5, 0], w[5, 1:] = 124 * UNIT, 127 * UNIT  # in truth ~127.9 units
        return x, w, 5
    if name == "kernel rounding":  # fp32 absorbs column 6's small terms: 0, not -2^-14
        K, s = 256, 2.0 ** -7
        x = torch.ones(1, K)
        x[0, 64:192] = UNIT
        w = torch.zeros(8, K)
        w[:, 0], w[:, 192], w[:, 64:128] = 127 * s, -127 * s, -s  # the others: -2^-15
        w[6, 0:64], w[6, 192:256], w[6, 64:192] = 127 * s, -127 * s, -s
        w[1, 64:96] = 0  # -2^-16: the screen's top
        return x, w, 6
    if name == "int32 range":  # every level at its largest: the sums must not wrap
        K = 768
        x = torch.full((1, K), 1.9921875)
        w = torch.zeros(4, K)
        w[0], w[1], w[2], w[3] = 1.0, 0.5, 0.25, -1.0
        w[1, 0] = 1.0
        return x, w, 0
    # "overflow": column 5's partial sums overflow to +inf (its true sum is -2^135)
    K = 64
    x = torch.full((2, K), 2.0 ** 60)
    w = torch.full((40, K), 2.0 ** 53)
    w[5, :24], w[5, 24:] = 2.0 ** 71, -2.0 ** 71
    return x, w, 5


@BF16
@pytest.mark.parametrize("name", ["x quantization", "kernel rounding", "int32 range",
                                  "overflow"])
def test_bf16_bound_terms_each_decide_a_row(name):
    x, w, token = _bound_case(name)
    assert torch.equal(x.bfloat16().float(), x) and torch.equal(w.bfloat16().float(), w)
    x, w = x.bfloat16(), w.bfloat16()
    assert _kernel_argmax(x, cpu.pack(w, "cbatch"), w.shape[0]).tolist() == \
        [token] * x.shape[0]
    _check(x, w)


@pytest.mark.parametrize("kind", KINDS)
def test_rows_the_screen_cannot_settle(kind):
    """Rows that tie every column (x = 0: index 0), hold NaN or infinity, or whose sums
    could overflow run the kernel on the whole row: torch.argmax's answer still (the first
    NaN for NaN logits)."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(500, 64, generator=gen) * 0.05
    x = torch.randn(6, 64, generator=gen)
    x[0] = 0
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    x[3] *= 1e36
    x[4, 7] = float("-inf")
    dtype, int8 = kind
    x, w = x.to(dtype), w.to(dtype)
    _check(x, w, int8)
    w[123, 9] = float("nan")  # a NaN column: every row's logit there is NaN
    _check(x[5:], w, int8)


def test_rejects_bad_arguments():
    w = torch.randn(40, 8)
    packed, screen = cpu.pack(w, "cbatch"), cpu.pack_screen(w, int8=False)
    with pytest.raises(TypeError, match="greedy_head takes"):  # bf16 x, fp32 weights
        cpu.greedy_head(torch.randn(2, 8).bfloat16(), packed, screen, 40)
    with pytest.raises(TypeError, match="greedy_head takes"):  # an int8 screen without scales
        torch.ops.cbatch.greedy_head(torch.randn(2, 8), packed, screen.weight.view(torch.int16)
                                     .to(torch.int8), 40, 1.0, 1.0, 1.0, None)
    with pytest.raises(ValueError, match="does not hold"):
        cpu.greedy_head(torch.randn(2, 8), packed, screen, 50)
    assert cpu.greedy_head(torch.randn(0, 8), packed, screen, 40).shape == (0,)
    with pytest.raises(ValueError, match="cannot be negative"):
        torch.ops.cbatch.greedy_head(torch.randn(2, 8), packed, screen.weight, 40, -1.0, 1.0,
                                     1.0, None)
    with pytest.raises(ValueError, match="a bf16 screen is for an fp32 weight"):
        cpu.pack_screen(w.bfloat16(), int8=False)
    w16 = w.bfloat16()
    packed16, screen16 = cpu.pack(w16, "cbatch"), cpu.pack_screen(w16)
    if not torch.ops.cbatch.greedy_head_supported(torch.bfloat16):
        with pytest.raises(ValueError, match="runs BFloat16 only where cbatch's CPU linear "
                                             "runs it"):
            cpu.greedy_head(torch.randn(2, 8).bfloat16(), packed16, screen16, 40)
    else:
        with pytest.raises(TypeError, match="greedy_head takes"):  # no scales
            torch.ops.cbatch.greedy_head(torch.randn(2, 8).bfloat16(), packed16, screen16.weight,
                                         40, 1.0, 1.0, 1.0, None)
        with pytest.raises(ValueError, match="scales must be"):
            torch.ops.cbatch.greedy_head(torch.randn(2, 8).bfloat16(), packed16, screen16.weight,
                                         40, 1.0, 1.0, 1.0, screen16.scales[:20])


def test_packing_gives_the_lm_head_a_screen(monkeypatch):
    """pack_linears gives the lm_head a screen, int8 (fp32 and bf16), and keeps it on cbatch's
    kernel
    (the logits the screen is exact for); not with $CBATCH_GREEDY_SCREEN=0 (the lm_head then
    goes back to its route without a screen); unpacking drops it."""
    model = load_model("random:tiny")
    assert pack_linears(model) and _screened(model)
    assert not model.lm_head.packed_weight.is_mkldnn
    int8 = cpu.int8_screens()
    assert model.lm_head.greedy_screen.weight.dtype == (torch.int8 if int8 else torch.bfloat16)
    assert (model.lm_head.greedy_screen.scales is None) != int8
    unpack_linears(model)
    assert not _screened(model)
    model = load_model("random:tiny", dtype=torch.bfloat16)
    # (a CPU without a bf16 route, AVX2 only, packs nothing: torch runs bf16 there)
    assert pack_linears(model) == (cpu.cpu_linear_route(torch.bfloat16) != "torch")
    assert _screened(model) == cpu.screen_available(torch.bfloat16)
    if _screened(model):
        screen = model.lm_head.greedy_screen
        assert screen.weight.dtype == torch.int8
        assert screen.scales.shape == (model.lm_head.out_features,)
    monkeypatch.setenv("CBATCH_GREEDY_SCREEN", "0")
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model("random:tiny", dtype=dtype)
        assert pack_linears(model) == (cpu.cpu_linear_route(dtype) != "torch")
        assert not _screened(model)


@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_screens_greedy_steps_and_gives_the_same_tokens(monkeypatch, dtype):
    """An engine's greedy steps without logprobs take the screen, and give the tokens
    the unscreened engine gives; a step with a sampled or a logprobs request computes the
    logits (and so does every step with the screen off)."""
    prompts = [[(7 * i + 3 * j) % 500 for j in range(3 + 5 * i)] for i in range(6)]
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)

    def tokens(llm, params=greedy, n=len(prompts)):
        """The tokens, and how many calls of the kernel's greedy head they took."""
        before = _greedy_head_calls()
        outs = llm.generate(prompts[:n], params, use_tqdm=False)
        return [o.token_ids for o in outs], _greedy_head_calls() - before, outs

    llm = LLM("random:tiny", dtype=dtype, max_num_seqs=4)
    int8 = dtype == torch.bfloat16 or cpu.int8_screens()
    assert llm.engine.runner.describe()["greedy screen"] == ("int8" if int8 else "bf16")
    unsettled = cpu.kernel_paths()["greedy_head.unsettled_rows"]
    int8_calls = cpu.kernel_paths()[_int8_path()]
    on, calls, _ = tokens(llm)
    assert calls >= 12  # every decode step of the greedy requests, at least
    if int8:  # each of them through this CPU's int8 tile
        assert cpu.kernel_paths()[_int8_path()] - int8_calls >= 12
    # and the screen settled every row itself (none went back to the full kernel)
    assert cpu.kernel_paths()["greedy_head.unsettled_rows"] == unsettled
    monkeypatch.setenv("CBATCH_GREEDY_SCREEN", "0")
    off = LLM("random:tiny", dtype=dtype, max_num_seqs=4)
    assert off.engine.runner.greedy_screen is None
    assert off.engine.runner.describe()["greedy screen"] == "off (CBATCH_GREEDY_SCREEN=0)"
    off_tokens, off_calls, _ = tokens(off)
    assert off_tokens == on and off_calls == 0
    monkeypatch.delenv("CBATCH_GREEDY_SCREEN")
    mixed = [greedy, SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)]
    mixed_tokens, mixed_calls, outs = tokens(llm, mixed, n=2)
    assert mixed_calls == 0  # a logprobs request in every step: logits computed
    assert mixed_tokens == on[:2]
    assert outs[1].logprobs and outs[1].logprobs[0]
    engine = Engine(load_model("random:tiny", dtype=dtype), max_num_seqs=4, batch_invariant=True)
    assert engine.runner.greedy_screen is not None  # exact, so batch-invariant too


def _int8_path() -> str:
    """The counter of the int8 screen's tile on this CPU (csrc/cpu/greedy_head.cpp)."""
    vnni = {"avx512bf16", "avx512vnni"} <= set(cpu.cpu_isa().split())
    return "greedy_head.int8.avx512vnni" if vnni else "greedy_head.int8.avx2"


def _bf16_path() -> str:
    """The counter of the fp32 lm_head's bf16 screen on this CPU."""
    bf16 = "avx512bf16" in cpu.cpu_isa().split()
    return "greedy_head.bf16.avx512" if bf16 else "greedy_head.bf16.avx2"


def _screened(model) -> bool:
    return model.lm_head.greedy_screen is not None


def _greedy_head_calls() -> int:
    """Calls of the C++ greedy head that ran a screen, as the kernels count them."""
    paths = cpu.kernel_paths()
    assert any(name.startswith("greedy_head.") for name in paths), paths
    return sum(n for name, n in paths.items()
               if name.startswith("greedy_head.") and name != "greedy_head.kernel")
