"""Inputs at the edges of the ops (issue 23): zero-size inputs give an empty result or a
clear error, never a signal (SIGFPE from a division by zero tiles in the C++ kernel), and
the torch backend checks block ids and slots as the compiled kernels do."""

import subprocess
import sys

import pytest
import torch

from cbatch import ops
from tests.helpers import triton_device

# ------------------------------------------------------------------ finding 7

ZERO_SIZE = """
import torch
from cbatch import ops
def cache(H, D):
    return torch.zeros(4, 16, H, D), torch.zeros(4, 16, H, D)
def empty_or_value_error(call, shape):  # zero heads may be refused (no KV head to share)
    try:
        out = call()
    except ValueError:
        return
    assert out is None or out.shape == shape, out.shape
tables = torch.zeros(1, 2, dtype=torch.int32)
lens = torch.tensor([5], dtype=torch.int32)
no_new = torch.tensor([0, 0], dtype=torch.int32)
for backend in {backends!r}:
    kc, vc = cache(4, 8)
    out = ops.paged_prefill_attention(torch.zeros(0, 4, 8), kc, vc, tables, no_new, lens,
                                      backend=backend)
    assert out.shape == (0, 4, 8), out.shape
    ops.write_kv_cache(torch.zeros(0, 4, 8), torch.zeros(0, 4, 8), kc, vc,
                       torch.zeros(0, dtype=torch.int64), backend=backend)
    kc, vc = cache(0, 8)
    empty_or_value_error(lambda: ops.paged_decode_attention(
        torch.zeros(1, 0, 8), kc, vc, tables, lens, backend=backend), (1, 0, 8))
    empty_or_value_error(lambda: ops.write_kv_cache(
        torch.zeros(2, 0, 8), torch.zeros(2, 0, 8), kc, vc, torch.tensor([0, 1]),
        backend=backend), None)
    if backend == "cpu":  # the compiled ops directly, without the Python checks
        kc, vc = cache(4, 8)
        out = torch.ops.cbatch.paged_prefill_attention(torch.zeros(0, 4, 8), kc, vc, tables,
                                                       no_new, lens, 1.0)
        assert out.shape == (0, 4, 8)
        kc, vc = cache(0, 8)
        empty_or_value_error(lambda: torch.ops.cbatch.paged_decode_attention(
            torch.zeros(1, 0, 8), kc, vc, tables, lens, 1.0), (1, 0, 8))
print("ok")
"""


@pytest.mark.slow
def test_zero_size_inputs_give_empty_results_never_a_signal():
    backends = [b for b in ("cpu", "torch") if ops.available_backends()[b].available]
    if triton_device() == "cpu":
        backends.append("triton")
    # a fresh process: a signal there fails this test instead of killing the test run
    result = subprocess.run([sys.executable, "-c", ZERO_SIZE.format(backends=backends)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", (
        result.returncode, result.stderr[-2000:])


# ------------------------------------------------------------------ finding 13


def test_the_torch_backend_checks_block_ids_and_slots():
    kc, vc = torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8)
    q = torch.randn(1, 2, 8)
    lens = torch.tensor([5], dtype=torch.int32)
    for bad in (-1, 4):
        tables = torch.tensor([[bad, 0]], dtype=torch.int32)
        with pytest.raises(ValueError, match="block ids outside"):
            ops.paged_decode_attention(q, kc, vc, tables, lens, backend="torch")
    with pytest.raises(ValueError, match="seq_len"):
        ops.paged_decode_attention(q, kc, vc, torch.zeros(1, 1, dtype=torch.int32),
                                   torch.tensor([17], dtype=torch.int32), backend="torch")
    for slot in (-5, 64):
        with pytest.raises(ValueError, match="slot_mapping"):
            ops.write_kv_cache(q, q, kc, vc, torch.tensor([slot]), backend="torch")
    ops.write_kv_cache(q, q, kc, vc, torch.tensor([-1]), backend="torch")  # -1: skip
    assert not kc.any()




# ------------------------------------------------------------------ issue 41, finding 20


@pytest.mark.skipif(not ops.available_backends()["cpu"].available, reason="no CPU extension")
def test_a_meta_tensor_among_cpu_tensors_is_a_clear_error():
    """The raw compiled ops dispatch a call holding any meta tensor to their fake (shapes
    only), which would return uninitialised memory or write nothing: refused instead, naming
    the meta argument; an all-meta call still infers shapes."""
    q, kc = torch.randn(2, 4, 16), torch.randn(8, 16, 4, 16)
    vc, tables = torch.randn_like(kc), torch.tensor([[0], [1]], dtype=torch.int32)
    lens, meta = torch.tensor([3, 5], dtype=torch.int32), torch.device("meta")
    with pytest.raises(ValueError, match="key_cache on the meta device but query on cpu"):
        torch.ops.cbatch.paged_decode_attention(q, kc.to(meta), vc, tables, lens, 0.25)
    with pytest.raises(ValueError, match="block_tables on the meta device"):
        torch.ops.cbatch.paged_prefill_attention(q, kc, vc, tables.to(meta),
                                                 torch.tensor([0, 1, 2], dtype=torch.int32),
                                                 lens, 0.25)
    key, slots = torch.randn(3, 4, 16), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="slot_mapping on the meta device"):
        torch.ops.cbatch.write_kv_cache(key, key, kc, vc, slots.to(meta))
    out = torch.ops.cbatch.paged_decode_attention(*(t.to(meta) for t in (q, kc, vc, tables,
                                                                         lens)), 0.25)
    assert out.device == meta and out.shape == q.shape
