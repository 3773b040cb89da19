"""The sampled rows' draw in Triton: one program per row, the rule of
``csrc/cpu/sample.cpp`` (and of the sorting reference, ``cbatch.ops.sampling.reference_draw``)
without a sort; registered as ``torch.ops.cbatch_triton.sample``.

Per row, with T its temperature and m its largest logit, w = exp((l - m) / T) (the largest
w is 1); min-p keeps w >= min_p; top-k keeps w >= the k-th largest w and top-p w >= the least
likely of the most likely tokens holding top_p of what is kept, each threshold found by
bisection on the bits of a positive float (30 passes over the row at most, each counting or
summing what lies at or above a candidate); the draw is the first token in vocabulary order
whose running kept mass passes u times the kept total.  As on the CPU, u is float64 (53 random
bits) and masses are summed in float64.  w is recomputed from the logits in each pass instead
of being stored: the row is read again, nothing is written but the token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_ONE_BITS = 0x3F800000  # 1.0f: the largest w


@triton.jit
def _weights(base, offs, V, m, t):
    x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    return tl.where(x == float("-inf"), 0.0, tl.exp((x - m) / t))


@triton.jit
def _above(base, V, m, t, threshold, BLOCK: tl.constexpr):
    """(mass, count) of the row's w at or above ``threshold``; the mass in float64."""
    mass = tl.full([], 0.0, tl.float64)
    count = 0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        w = _weights(base, offs, V, m, t)
        keep = (w >= threshold) & (offs < V)
        mass += tl.sum(tl.where(keep, w, 0.0).to(tl.float64), axis=0)
        count += tl.sum(keep.to(tl.int32), axis=0)
    return mass, count


@triton.jit
def _largest_threshold(base, V, m, t, floor, goal, BY_MASS: tl.constexpr,
                       ONE_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """The largest threshold in [floor, 1] whose mass (BY_MASS) or count of w at or above it
    reaches ``goal``, by bisection on a positive float's bits (they order as the floats do)."""
    lo = floor.to(tl.int32, bitcast=True)
    hi = ONE_BITS
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        mass, count = _above(base, V, m, t, mid.to(tl.float32, bitcast=True), BLOCK)
        if BY_MASS:
            reached = mass >= goal
        else:
            reached = count.to(tl.float32) >= goal
        if reached:
            lo = mid
        else:
            hi = mid - 1
    return lo.to(tl.float32, bitcast=True)


@triton.jit
def _sample_kernel(logits_ptr, rows_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
                   u_ptr, out_ptr, stride, V, ONE_BITS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    base = logits_ptr + tl.load(rows_ptr + r).to(tl.int64) * stride
    t = tl.load(temperature_ptr + r)
    k = tl.load(top_k_ptr + r)
    top_p = tl.load(top_p_ptr + r)
    u = tl.load(u_ptr + r)
    m = float("-inf")
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m = tl.maximum(m, tl.max(x, axis=0))
    # min-p, and never a banned token (w = 0): the smallest positive float at least
    floor = tl.maximum(tl.load(min_p_ptr + r), 1.401298464324817e-45)
    if (k > 0) & (k < V):  # the k-th largest w
        floor = _largest_threshold(base, V, m, t, floor, k.to(tl.float32), False, ONE_BITS,
                                   BLOCK)
    if top_p < 1.0:  # the least likely of the most likely tokens holding top_p
        kept, _ = _above(base, V, m, t, floor, BLOCK)
        floor = _largest_threshold(base, V, m, t, floor, top_p * kept, True, ONE_BITS, BLOCK)
    total, _ = _above(base, V, m, t, floor, BLOCK)
    target = u * total  # float64
    run = tl.full([], 0.0, tl.float64)
    token = -1
    last = 0
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        w = _weights(base, offs, V, m, t)
        w = tl.where((w >= floor) & (offs < V), w, 0.0).to(tl.float64)
        ends = run + tl.cumsum(w, axis=0)  # the running mass after each token of the block
        passed = (ends > target) & (w > 0)
        first = tl.min(tl.where(passed, offs, V), axis=0)
        if (token < 0) & (first < V):
            token = first
        last = tl.maximum(last, tl.max(tl.where(w > 0, offs, 0), axis=0))
        run += tl.sum(w, axis=0)
    tl.store(out_ptr + r, tl.where(token < 0, last, token).to(tl.int64))


def sample(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor,
           top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
           uniform: torch.Tensor) -> torch.Tensor:
    """``torch.ops.cbatch.sample``'s contract on a Triton device: ``logits [S, V]`` (dense
    rows), ``rows`` int64 ``[R]``, ``temperature`` (> 0), ``top_p``, ``min_p`` fp32 ``[R]``,
    ``top_k`` int64 ``[R]`` (0 = off), ``uniform`` float64 ``[R]`` in [0, 1) → int64 tokens
    ``[R]``."""
    R, V = rows.numel(), logits.shape[-1]
    out = torch.empty(R, dtype=torch.int64, device=logits.device)
    if R == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    _sample_kernel[(R,)](
        logits, rows, temperature.float(), top_k, top_p.float(), min_p.float(),
        uniform.double(), out, logits.stride(0), V,
        ONE_BITS=_ONE_BITS, BLOCK=min(1024, triton.next_power_of_2(V)))
    return out
