"""Shared builders for kernel and model tests, and the one scripted-run driver of the engine."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from cbatch.ops import compiled
from cbatch.outputs import RequestOutput
from cbatch.sampling_params import SamplingParams
from cbatch.ops import quantized

ROOT = Path(__file__).resolve().parents[1]
PROBE = "from tests import triton_probe; triton_probe.run()"

# tests of cbatch's C++ CPU kernels themselves (a build without the extension skips them)
needs_cpu_ext = pytest.mark.skipif("cpu" not in compiled.compiled_backends(),
                                   reason="cbatch's C++ CPU extension is not built")


@functools.lru_cache(maxsize=None)
def triton_interpreter_problem() -> str | None:
    """Why Triton's CPU interpreter cannot run cbatch's kernels in this environment (the
    installed triton and numpy), or None when it can.  Runs a tiny probe kernel in a fresh
    process when the interpreter is not on already (TRITON_INTERPRET acts when triton.jit
    decorates); see tests/triton_probe.py."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if os.environ.get("TRITON_INTERPRET") == "1":  # on already: probe in this process
        try:
            from tests import triton_probe

            triton_probe.run()
            return None
        except Exception as e:  # what the interpreter raised is the reason
            last = repr(e)
    else:
        result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                                cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"},
                                timeout=300)
        if result.returncode == 0:
            return None
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
    import numpy
    import triton

    return (f"Triton {triton.__version__}'s interpreter fails under numpy {numpy.__version__} "
            f"({last[-200:]})")


def triton_device() -> str | None:
    """Where Triton kernels run in this process: CUDA tensors on a GPU; CPU tensors only
    while Triton's interpreter is on (TRITON_INTERPRET=1, which conftest sets when there is
    no GPU) and works; otherwise nowhere (see :func:`triton_skip_reason`)."""
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1" and triton_interpreter_problem() is None:
        return "cpu"
    return None


def triton_skip_reason() -> str:
    """Why :func:`triton_device` is None."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton needs a GPU, or TRITON_INTERPRET=1 for CPU tensors"
    return triton_interpreter_problem() or "Triton can run here"


def shuffled_block_tables(seq_lens: list[int], block_size: int, num_blocks: int,
                          generator: torch.Generator) -> torch.Tensor:
    """int32 [S, max_blocks]: each sequence gets distinct, randomly placed physical blocks;
    entries past what a sequence needs hold out-of-range garbage (they must never be read)."""
    needed = [-(-n // block_size) for n in seq_lens]
    if sum(needed) > num_blocks:
        raise ValueError(f"{sum(needed)} blocks needed, pool has {num_blocks}")
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    max_blocks = max(needed) + 1
    tables = torch.full((len(seq_lens), max_blocks), 10**6, dtype=torch.int32)
    offset = 0
    for s, n in enumerate(needed):
        tables[s, :n] = torch.tensor(perm[offset:offset + n], dtype=torch.int32)
        offset += n
    return tables


def paged_inputs(seq_lens: list[int], num_new: list[int], H: int, D: int, block_size: int,
                 dtype: torch.dtype, device: str, seed: int, spare_blocks: int = 3,
                 num_kv_heads: int | None = None):
    """Fresh random attention inputs over a shuffled paged cache.

    Blocks no sequence owns hold NaN, so a kernel that reads outside its block table poisons
    its output.  Returns query ``[sum(num_new), H, D]``, key_cache, value_cache (``[num_blocks,
    block_size, num_kv_heads, D]``; num_kv_heads defaults to H), block_tables, cu_seqlens_q
    and seq_lens (on ``device``).
    """
    H_kv = H if num_kv_heads is None else num_kv_heads
    gen = torch.Generator().manual_seed(seed)
    needed = sum(-(-n // block_size) for n in seq_lens)
    num_blocks = needed + spare_blocks
    tables = shuffled_block_tables(seq_lens, block_size, num_blocks, gen)
    shape = (num_blocks, block_size, H_kv, D)
    key_cache = torch.full(shape, float("nan"))
    value_cache = torch.full(shape, float("nan"))
    for s, n in enumerate(seq_lens):
        for b in tables[s, : -(-n // block_size)].tolist():
            key_cache[b] = torch.randn(block_size, H_kv, D, generator=gen)
            value_cache[b] = torch.randn(block_size, H_kv, D, generator=gen)
    query = torch.randn(sum(num_new), H, D, generator=gen)
    cu = torch.tensor([0, *torch.tensor(num_new).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return tuple(t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device)
                 for t in (query, key_cache, value_cache, tables, cu, lens))


# Smallest error allowed, so that a lucky near-exact torch baseline cannot fail a kernel.
ERROR_FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def assert_attention_close(out, query, key_cache, value_cache, block_tables, cu, seq_lens):
    """The kernel's error against float64 truth is at most ~2x that of the same maths done
    by torch in the input dtype (flash-attn's rule), plus a small floor."""
    from cbatch.ops import reference

    args = [t.cpu() for t in (query, key_cache, value_cache, block_tables, cu, seq_lens)]
    truth = reference.paged_prefill_attention(*args, compute_dtype=torch.float64).double()
    plain = reference.paged_prefill_attention(*args, compute_dtype=query.dtype).double()
    out = out.cpu().double()
    assert not out.isnan().any(), "NaN in the output: a row was not written or garbage was read"
    err = (out - truth).abs().max().item()
    base = (plain - truth).abs().max().item()
    assert err <= 2 * base + ERROR_FLOOR[query.dtype], (
        f"max error {err:.3g} vs torch-in-{query.dtype} {base:.3g}")


def fail_forward_at(monkeypatch, model, call: int, error: BaseException) -> list[int]:
    """Make the ``call``-th forward pass of ``model`` raise ``error`` (the earlier ones run
    as usual); returns the list that grows by one entry per call."""
    calls: list[int] = []

    def forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise error
        return type(model).forward(model, *args, **kwargs)

    monkeypatch.setattr(model, "forward", forward)
    return calls


# Engine shapes that stress the scheduler differently (max_num_seqs=10 puts batches of 4 and
# 5 on both sides of a CUDA-graph bucket edge): everything fits; prompts prefilled in chunks
# of 7 tokens beside decodes; two sequences at a time; a KV pool so small that requests are
# preempted and recomputed.
STRESS_CONFIGS = {
    "roomy": dict(max_num_seqs=10, max_num_batched_tokens=512),
    "chunked-prefill": dict(max_num_seqs=10, max_num_batched_tokens=7),
    "few-seqs": dict(max_num_seqs=2, max_num_batched_tokens=64),
    "preempting": dict(max_num_seqs=10, max_num_batched_tokens=64, block_size=4,
                       num_blocks=14),
}


@dataclass
class Arrival:
    """A request of a scripted run: it arrives at ``step`` and, unless ``abort_after`` is
    None, is aborted that many steps later if it has not finished by then."""

    prompt: list[int]
    params: SamplingParams
    step: int = 0
    priority: int = 0
    abort_after: int | None = None


def run_arrivals(engine, arrivals: list[Arrival], max_steps: int = 1000,
                 after_step=None) -> dict[int, RequestOutput]:
    """Step ``engine`` through a scripted run (the one arrival/abort driver of the tests):
    requests join at their steps and are aborted at theirs; ``after_step(engine)`` runs after
    every step.  Checks that every request finishes exactly once and that the KV pool is
    whole at the end; returns ``{index in arrivals: final output}``."""
    ids, aborts, finished = {}, {}, {}
    for step in range(max_steps):
        for i, a in enumerate(arrivals):
            if a.step == step:
                rid = engine.add_request(a.prompt, a.params, priority=a.priority)
                ids[rid] = i
                if a.abort_after is not None:
                    aborts[rid] = step + a.abort_after
        for rid, when in list(aborts.items()):
            if when == step and ids[rid] not in finished:
                engine.abort(rid)
                del aborts[rid]
        for out in engine.step():
            if out.finished:
                assert ids[out.request_id] not in finished, "finished twice"
                finished[ids[out.request_id]] = out
        if after_step is not None:
            after_step(engine)
        if len(finished) == len(arrivals) and not engine.has_unfinished_requests():
            break
    assert set(finished) == set(range(len(arrivals))), "every request finishes exactly once"
    engine.block_manager.check_whole()
    return finished


def int8_kernel_calls(op: str) -> int:
    """How many calls cbatch's ``op`` kernel ("w8a8" or "w4a8": int8 dot products) has run in
    this process on its paths here now: its ISA's and AMX-INT8's (tiles take calls of 8 rows
    and more where the CPU has them)."""
    from cbatch.ops import cpu
    isa = quantized.isa("w8a8") if op == "w8a8" else quantized.isa("w4a8")
    paths = cpu.kernel_paths()
    return paths.get(f"quantized_linear.{op}.{isa}", 0) + paths.get(f"quantized_linear.{op}.amx", 0)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f
                         if line.startswith("flags")), set())
    except OSError:
        return set()


CPU_FLAGS = _cpu_flags()  # /proc/cpuinfo's flags (empty where it has none)
