"""The sampler's kernels, each behind one dispatch: cbatch's C++ kernel on the CPU
(``csrc/cpu/argmax.cpp``, ``sample.cpp``), Triton on CUDA (``kernels/sample.py``, the
custom op ``torch.ops.cbatch_triton.sample``), else torch, which is also the reference.

- :func:`argmax`: greedy rows' tokens.
- :func:`draw`: sampled rows' tokens: temperature, min-p, top-k, top-p and one draw per row
  from its uniform ``u``, without sorting the vocabulary (:func:`reference_draw` sorts, and
  draws by the same rule).
- :func:`apply_penalties`: the repetition, frequency and presence penalties, in place.
- :func:`apply_bitmask`: a grammar's token bitmask, in place.

A row's draw is the first token, in vocabulary order, whose running kept mass passes ``u``
times the kept total.  Every backend takes ``u`` in float64 (53 random bits) and adds the
running mass in float64, so a backend's token differs from the reference's only where ``u``
lands within float32 rounding of a token's boundary (the weights themselves are float32).

:mod:`cbatch.core.sampler` decides which rows get which rule; this module only runs them.
"""

from __future__ import annotations

import torch

from cbatch.ops import compiled
from cbatch.ops.backends import triton_available


def _cpu_kernel(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.stride(-1) == 1 and "cpu" in compiled.compiled_backends()


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``argmax(logits, dim=-1)`` of ``[S, V]`` logits in any float dtype → int64 ``[S]``: on
    the CPU cbatch's kernel (torch's walks each row one element at a time), elsewhere torch's.
    The same answer: the first index of the maximum (the first NaN, if any)."""
    if _cpu_kernel(logits) and logits.shape[-1] > 0:
        return torch.ops.cbatch.argmax(logits)
    return logits.argmax(dim=-1)


def draw(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor,
         top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
         uniform: torch.Tensor) -> torch.Tensor:
    """One token for each of the rows ``rows`` (int64 ``[R]``) of ``logits [S, V]``:
    ``temperature`` (> 0), ``top_p``, ``min_p`` float32 ``[R]``, ``top_k`` int64 ``[R]`` (0 =
    off), ``uniform`` float64 ``[R]`` in [0, 1) → int64 ``[R]``.  The rule is
    :func:`reference_draw`'s."""
    if _cpu_kernel(logits):
        return torch.ops.cbatch.sample(logits, rows, temperature, top_k, top_p, min_p, uniform)
    if logits.device.type == "cuda" and triton_available():
        from cbatch.ops import triton as triton_ops  # (importing triton is slow: on first use)

        return triton_ops.sample(logits, rows, temperature, top_k, top_p, min_p, uniform)
    return reference_draw(logits[rows], temperature, top_k, top_p, min_p, uniform)


def reference_draw(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, min_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The draw by sorting: ``logits [R, V]``, ``temperature`` (> 0), ``top_p`` and ``min_p``
    fp32 ``[R]``, ``top_k`` int64 ``[R]`` (0 = off), ``u`` fp64 ``[R]`` → int64 ``[R]``.  What
    :func:`draw`'s kernels compute without sorting: w = exp((l - max) / T); keep w >= min_p;
    then w >= the k-th largest; then the most likely tokens whose mass first reaches top_p of
    what is kept (ties with the last one stay); the draw is the first token in vocabulary
    order whose running kept mass passes u times the kept total."""
    x = logits.float()
    m = x.max(dim=-1, keepdim=True).values
    w = ((x - m) / temperature[:, None]).exp().nan_to_num(0.0)  # a row all -inf: all 0
    keep = (w > 0) & (w >= min_p[:, None])
    V = w.shape[-1]
    k = torch.where((top_k > 0) & (top_k < V), top_k, V).clamp(max=V)
    ranked = w.masked_fill(~keep, 0).sort(dim=-1, descending=True).values
    keep &= w >= ranked.gather(-1, (k - 1)[:, None])
    ranked = w.masked_fill(~keep, 0).sort(dim=-1, descending=True).values.double()
    cum = ranked.cumsum(dim=-1)
    before = cum - ranked
    within = (before < top_p[:, None].double() * cum[:, -1:]) & (ranked > 0)
    last = within.sum(dim=-1).clamp(min=1) - 1
    keep &= w >= ranked.gather(-1, last[:, None]).float()
    run = (w * keep).double().cumsum(dim=-1)
    tokens = torch.searchsorted(run, (u * run[:, -1])[:, None], right=True)[:, 0]
    return tokens.clamp(max=V - 1)


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                    counts: torch.Tensor, prompt: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor, repetition: torch.Tensor) -> None:
    """Penalize rows ``rows`` (int64 ``[P]``) of ``logits: fp32 [S, V]`` in place, row p by
    the token counts ``counts[slots[p]]`` (int32 ``[slots, V]``: its output) and
    ``prompt[slots[p]]`` (bool: its prompt): logits of tokens in either are divided by
    ``repetition[p]`` when positive and multiplied when negative (transformers' rule), then
    ``frequency[p]`` times the count and ``presence[p]`` once are subtracted (vLLM's)."""
    if _cpu_kernel(logits):  # one pass per row
        torch.ops.cbatch.apply_penalties(logits, rows, slots, counts, prompt, presence,
                                         frequency, repetition)
        return
    presence, frequency, repetition = (v[:, None] for v in (presence, frequency, repetition))
    counts = counts[slots]  # [P, V]
    seen = prompt[slots] | (counts > 0)
    x = logits[rows]
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    x -= frequency * counts + presence * (counts > 0)
    logits[rows] = x


_BITS: dict[torch.device, torch.Tensor] = {}  # arange(32) per device


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, every logit whose token the bitmask forbids.

    ``logits: [S, V]`` (any float dtype, any device), ``bitmask: int32 [S, W]`` (bit t % 32
    of word t // 32 set where token t is allowed, as xgrammar writes it).  Ids past the
    bitmask's ``32 * W`` are forbidden in the rows that forbid any token (a grammar's rows)
    and left alone in all-ones rows."""
    S, V = logits.shape
    bitmask = bitmask.to(logits.device, non_blocking=True)
    if _cpu_kernel(logits) and logits.dtype == torch.float32:
        torch.ops.cbatch.apply_bitmask(logits, bitmask.contiguous())  # one pass, in C++
        return
    bits = _BITS.get(logits.device)
    if bits is None:
        bits = _BITS[logits.device] = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> bits) & 1).view(S, -1).bool()  # [S, 32 * W]
    n = min(V, allowed.shape[1])
    logits[:, :n].masked_fill_(~allowed[:, :n], float("-inf"))
    if V > n:
        constrained = (bitmask != -1).any(dim=1, keepdim=True)  # [S, 1]
        logits[:, n:].masked_fill_(constrained, float("-inf"))


if "cpu" in compiled.compiled_backends():  # shapes for torch.compile and the meta device

    @torch.library.register_fake("cbatch::argmax")
    def _(logits):
        return logits.new_empty((logits.shape[0],), dtype=torch.long)

    @torch.library.register_fake("cbatch::apply_bitmask")
    def _(logits, bitmask):
        return logits

    @torch.library.register_fake("cbatch::apply_penalties")
    def _(logits, rows, slots, counts, prompt, presence, frequency, repetition):
        return logits

    @torch.library.register_fake("cbatch::sample")
    def _(logits, rows, temperature, top_k, top_p, min_p, uniform):
        return rows.new_empty(rows.shape)
