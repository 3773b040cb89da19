"""The sampler's kernels (:mod:`cbatch.ops.sampling`): cbatch's C++ draw, argmax and penalties
and the Triton draw (under Triton's interpreter without a GPU), each against the sorting
reference or torch, and the draw as distributions against transformers' warpers: a row's draw
is the inverse CDF at its uniform, so draws at a dense grid of uniforms give the row's
probabilities to within the grid's step."""

import math

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from cbatch.core.sampler import uniforms
from cbatch.ops import compiled, cpu, sampling
from cbatch.ops.sampling import argmax, reference_draw
from tests.helpers import needs_cpu_ext, triton_device, triton_skip_reason


def _triton_device() -> str:
    device = triton_device()
    if device is None:
        pytest.skip(triton_skip_reason())
    import cbatch.ops.triton  # noqa: F401  (registers torch.ops.cbatch_triton.*)

    return device


def _draw_grid(logits, temperature, top_k, top_p, min_p, n=20000, kernel=True):
    """Token frequencies of one row drawn at n evenly spaced uniforms."""
    R = n
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    args = (torch.full((R,), temperature), torch.full((R,), top_k, dtype=torch.int64),
            torch.full((R,), top_p), torch.full((R,), min_p), u)
    if kernel:
        tokens = torch.ops.cbatch.sample(logits.expand(R, -1).contiguous(), torch.arange(R),
                                         *args)
    else:
        tokens = reference_draw(logits.expand(R, -1), *args)
    return torch.bincount(tokens, minlength=logits.shape[-1]).double() / n


def _transformers_probs(logits, temperature, top_k, top_p, min_p):
    if temperature < 1e-30:  # transformers divides into inf - inf = NaN; the rule: greedy
        return torch.nn.functional.one_hot(logits[0].argmax(), logits.shape[-1]).double()
    x = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if min_p:
        x = MinPLogitsWarper(min_p)(None, x)
    if top_k:
        x = TopKLogitsWarper(top_k)(None, x)
    if top_p < 1:
        x = TopPLogitsWarper(top_p)(None, x)
    return x.double().softmax(dim=-1)[0]


@needs_cpu_ext
@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (1.3, 5, 1.0, 0.0), (1.0, 0, 1.0, 0.1),
    (0.8, 8, 0.8, 0.02), (1e-45, 0, 1.0, 0.0), (1.0, 0, 1e-46, 0.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_draws_the_distribution_transformers_warpers_define(temperature, top_k, top_p,
                                                                    min_p, dtype):
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(1, 37, generator=gen) * 2).to(dtype)
    before = cpu.kernel_paths()
    got = _draw_grid(logits, temperature, top_k, top_p, min_p)
    after = cpu.kernel_paths()
    assert sum(after[k] - before[k] for k in after if k.startswith("sample.")) == 1
    isa = cpu.cpu_isa().split()  # the widest loops here ran (max, weights, mass above t)
    widest = "avx512" if "avx512" in isa else "avx2" if "avx2" in isa else "generic"
    assert after[f"sample.{widest}"] == before[f"sample.{widest}"] + 1
    want = _transformers_probs(logits.float(), temperature, top_k, top_p, min_p)
    assert (got - want).abs().max() < 1e-3, (got, want)
    ref = _draw_grid(logits, temperature, top_k, top_p, min_p, kernel=False)
    assert (got - ref).abs().max() < 1e-3


@needs_cpu_ext
@pytest.mark.parametrize("V", [1, 15, 16, 17, 63, 64, 65, 50257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_the_reference_token_for_token(V, dtype):
    """Random rows, random rules, a shuffled subset of rows, banned tokens: the kernel's token
    is the reference's (they differ only where u lands within rounding of a boundary)."""
    gen = torch.Generator().manual_seed(V)
    S = 12
    logits = (torch.randn(S, V, generator=gen) * 3).to(dtype)
    logits[0, : V // 2] = float("-inf")  # banned tokens are never drawn
    rows = torch.randperm(S, generator=gen)[:9]
    R = len(rows)
    temperature = torch.rand(R, generator=gen) + 0.3
    top_k = torch.randint(0, min(V, 40) + 1, (R,), generator=gen)
    top_p = torch.where(torch.rand(R, generator=gen) < 0.5, 1.0, torch.rand(R, generator=gen))
    top_p = top_p.clamp(min=0.05)
    min_p = torch.where(torch.rand(R, generator=gen) < 0.5, 0.0, 0.1 * torch.rand(R, generator=gen))
    u = torch.tensor(uniforms(list(range(R)), [V] * R), dtype=torch.float64)
    got = torch.ops.cbatch.sample(logits, rows, temperature, top_k, top_p, min_p, u)
    want = reference_draw(logits[rows], temperature, top_k, top_p, min_p, u)
    assert torch.equal(got, want)
    if 0 in rows.tolist():
        assert got[rows.tolist().index(0)] >= V // 2


@needs_cpu_ext
def test_penalty_kernel_is_the_torch_rule_and_runs(monkeypatch):
    """torch.ops.cbatch.apply_penalties (one pass per row) against the torch formula that
    runs elsewhere, on random counts, prompts and penalties, rows in any order."""
    gen = torch.Generator().manual_seed(5)
    V, S, P = 1000, 6, 4
    logits = torch.randn(S, V, generator=gen) * 4
    counts = torch.randint(0, 3, (5, V), generator=gen, dtype=torch.int32)
    counts *= torch.rand(5, V, generator=gen) < 0.05
    prompt = torch.rand(5, V, generator=gen) < 0.03
    rows, slots = torch.tensor([4, 0, 5, 2]), torch.tensor([1, 3, 0, 4])
    penalties = [torch.tensor([0.3 * i - 0.5 for i in range(P)]),
                 torch.tensor([0.2 * i for i in range(P)]),
                 torch.tensor([0.8 + 0.3 * i for i in range(P)])]
    before = cpu.kernel_paths()["penalties.cpu"]
    fast = logits.clone()
    sampling.apply_penalties(fast, rows, slots, counts, prompt, *penalties)
    assert cpu.kernel_paths()["penalties.cpu"] == before + 1
    monkeypatch.setattr(compiled, "compiled_backends", lambda: [])
    slow = logits.clone()
    sampling.apply_penalties(slow, rows, slots, counts, prompt, *penalties)
    torch.testing.assert_close(fast, slow)
    assert torch.equal(fast[1], logits[1]) and torch.equal(fast[3], logits[3])
    x, seen = logits[4], prompt[1] | (counts[1] > 0)  # row 4 by hand: slot 1, penalties 0
    want = torch.where(seen, torch.where(x > 0, x / 0.8, x * 0.8), x)
    want -= 0.0 * counts[1] + (-0.5) * (counts[1] > 0)
    torch.testing.assert_close(fast[4], want)


@pytest.mark.slow
def test_triton_kernel_draws_what_the_reference_draws():
    """kernels/sample.py (the CUDA path; here under Triton's interpreter): the reference's
    token on random rows with banned tokens, ragged V, shuffled rows and random rules, and the
    distributions of transformers' warpers at a grid of uniforms."""
    device = _triton_device()

    gen = torch.Generator().manual_seed(6)
    for V in (1, 17, 65):
        S, R = 6, 5
        logits = torch.randn(S, V, generator=gen) * 3
        logits[0, : V // 2] = float("-inf")
        rows = torch.randperm(S, generator=gen)[:R]
        temperature = torch.rand(R, generator=gen) + 0.3
        top_k = torch.randint(0, min(V, 40) + 1, (R,), generator=gen)
        top_p = torch.where(torch.rand(R, generator=gen) < 0.5, 1.0,
                            torch.rand(R, generator=gen)).clamp(min=0.05)
        min_p = torch.where(torch.rand(R, generator=gen) < 0.5, 0.0,
                            0.1 * torch.rand(R, generator=gen))
        u = torch.tensor(uniforms(list(range(R)), [V] * R), dtype=torch.float64)
        want = reference_draw(logits[rows], temperature, top_k, top_p, min_p, u)
        args = [t.to(device) for t in (logits, rows, temperature, top_k, top_p, min_p, u)]
        assert torch.equal(torch.ops.cbatch_triton.sample(*args).cpu(), want)
    logits = torch.randn(1, 37, generator=gen) * 2
    n = 200
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    for rule in ((0.8, 8, 0.8, 0.02),):
        t, k, p, mp = rule
        args = (logits.expand(n, -1).contiguous(), torch.arange(n), torch.full((n,), t),
                torch.full((n,), k), torch.full((n,), p), torch.full((n,), mp), u)
        tokens = torch.ops.cbatch_triton.sample(*[a.to(device) for a in args]).cpu()
        got = torch.bincount(tokens, minlength=37).double() / n
        assert (got - _transformers_probs(logits, *rule)).abs().max() < 1.5 / n


def test_uniforms_are_a_requests_own_and_spread():
    u = uniforms([7] * 1000, list(range(1000)))
    assert uniforms([7], [5]) == [u[5]]  # the same (seed, position), the same uniform
    assert all(0 <= x < 1 for x in u) and abs(sum(u) / 1000 - 0.5) < 0.05
    assert uniforms([8], [5]) != [u[5]]
    assert math.isclose(sorted(u)[500], 0.5, abs_tol=0.06)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("V", [1, 15, 16, 17, 50257])
def test_greedy_is_torch_argmax_ties_nans_and_infinities_included(dtype, V):
    """ops.sampling.argmax (cbatch's CPU kernel where the extension is loaded) gives
    torch.argmax's answer: the first index of the maximum, the first NaN if a row has one;
    rows of a wider tensor (row stride > V) too."""
    gen = torch.Generator().manual_seed(V)
    wide = torch.randn(6, V + 5, generator=gen).to(dtype)
    cases = [torch.randn(4, V, generator=gen).to(dtype),
             torch.randint(0, 3, (4, V), generator=gen).to(dtype),  # ties everywhere
             torch.full((2, V), float("-inf"), dtype=dtype),
             wide[:, :V]]
    with_nan = torch.randn(3, V, generator=gen).to(dtype)
    with_nan[1, V // 2] = float("nan")
    with_nan[2, V - 1] = float("nan")
    with_inf = torch.randn(3, V, generator=gen).to(dtype)
    with_inf[0, V - 1] = float("inf")
    with_inf[1, 0] = float("inf")
    for logits in cases + [with_nan, with_inf]:
        assert torch.equal(argmax(logits), logits.argmax(dim=-1))
    assert argmax(torch.empty(0, V, dtype=dtype)).shape == (0,)


@pytest.mark.parametrize("backend", ["cpu", "triton", "reference"])
def test_every_backend_reads_the_uniform_in_float64(backend):
    """Two equally likely tokens: token 0 holds u in [0, 0.5).  A u just under 0.5 that
    float32 rounds up to 0.5 still draws token 0: every backend takes u (53 bits) and the
    running mass in float64, so they draw alike up to the weights' float32 rounding."""
    logits = torch.zeros(2, 2)
    u = torch.tensor([0.5 - 2.0**-40, 0.5], dtype=torch.float64)
    assert float(u[0].float()) == 0.5  # what a float32 uniform would have drawn from
    args = [torch.arange(2), torch.ones(2), torch.zeros(2, dtype=torch.int64), torch.ones(2),
            torch.zeros(2), u]
    if backend == "cpu":
        if "cpu" not in compiled.compiled_backends():
            pytest.skip("cbatch's C++ CPU extension is not built")
        tokens = torch.ops.cbatch.sample(logits, *args)
    elif backend == "triton":
        device = _triton_device()
        tokens = torch.ops.cbatch_triton.sample(*[t.to(device) for t in [logits] + args]).cpu()
    else:
        tokens = reference_draw(logits, *args[1:])
    assert tokens.tolist() == [0, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [31, 64, 100])
def test_apply_bitmask_forbids_exactly_the_cleared_bits(dtype, vocab):
    """Against a bit-by-bit reference; the bitmask covers 64 ids, so a vocab of 100 has ids
    past it: forbidden in the constrained rows, untouched in the all-ones row."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, vocab, generator=gen).to(dtype)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 2), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[1] = -1  # a row without a grammar
    want = logits.clone()
    for s in range(3):
        for t in range(vocab):
            allowed = t < 64 and (int(bitmask[s, t // 32]) >> (t % 32)) & 1
            if not allowed and not (s == 1 and t >= 64):
                want[s, t] = float("-inf")
    before = cpu.kernel_paths().get("bitmask.cpu", 0)
    sampling.apply_bitmask(logits, bitmask)
    torch.testing.assert_close(logits, want)
    assert torch.isfinite(logits[1]).all()
    # fp32 on the CPU: cbatch's one-pass kernel (the torch rule otherwise)
    kernel = dtype == torch.float32 and "cpu" in compiled.compiled_backends()
    assert cpu.kernel_paths().get("bitmask.cpu", 0) - before == int(kernel)
