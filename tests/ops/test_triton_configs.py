"""How the Triton launchers choose their configs, and the start-up warm-up of the ops.

Without a GPU the choice is checked by asking the launchers what they would launch; the
configs themselves compile for sm_80 and sm_90 in test_triton_compile.py.
"""

import pytest
import torch

from cbatch import ops
from tests.helpers import triton_device, triton_skip_reason

triton = pytest.importorskip("triton")
from triton.runtime.autotuner import Autotuner  # noqa: E402

from cbatch.kernels import _utils, decode_attention, prefill_attention  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture
def on_gpu_path(monkeypatch):
    """Make the launchers choose as they do on a GPU (the interpreter never autotunes)."""
    monkeypatch.setattr(_utils, "interpreting", lambda: False)


@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_config_per_shape_class_by_default(monkeypatch, on_gpu_path, dtype, head_dim):
    monkeypatch.delenv("CBATCH_TRITON_AUTOTUNE", raising=False)
    kernel, meta = decode_attention.decode_launch(head_dim)
    assert kernel is decode_attention._paged_decode_kernel and not isinstance(kernel, Autotuner)
    assert meta == decode_attention.decode_config(head_dim)
    assert meta["TILE_N"] * triton.next_power_of_2(head_dim) <= 8192  # no register spills
    kernel, meta = prefill_attention.prefill_launch(dtype, head_dim)
    assert kernel is prefill_attention._paged_prefill_kernel
    assert meta == prefill_attention.prefill_config(dtype, head_dim)
    assert {"BLOCK_M", "BLOCK_N", "num_warps"} <= set(meta)


def test_autotune_is_opt_in(monkeypatch, on_gpu_path):
    monkeypatch.setenv("CBATCH_TRITON_AUTOTUNE", "1")
    kernel, meta = decode_attention.decode_launch(64)
    assert isinstance(kernel, Autotuner) and meta == {}
    assert kernel.fn is decode_attention._paged_decode_kernel
    assert len(kernel.configs) == 9 and kernel.keys == ["HEAD_DIM", "PAGE_SIZE"]
    kernel, meta = prefill_attention.prefill_launch(torch.float16, 64)
    assert isinstance(kernel, Autotuner) and meta == {}
    assert kernel.fn is prefill_attention._paged_prefill_kernel and len(kernel.configs) == 12
    monkeypatch.setenv("CBATCH_TRITON_AUTOTUNE", "0")
    assert not isinstance(decode_attention.decode_launch(64)[0], Autotuner)


def test_interpreter_never_autotunes(monkeypatch):
    monkeypatch.setenv("CBATCH_TRITON_AUTOTUNE", "1")
    monkeypatch.setattr(_utils, "interpreting", lambda: True)
    assert decode_attention.decode_launch(64)[0] is decode_attention._paged_decode_kernel


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_warmup_runs_every_op_on_cpu(backend):
    if not ops.available_backends()[backend].available:
        pytest.skip(ops.available_backends()[backend].detail)
    used = ops.warmup(torch.float32, 64, 16, "cpu", backend=backend, num_heads=2)
    assert used == {"write_kv_cache": backend, "paged_decode_attention": backend,
                    "paged_prefill_attention": backend}


def test_warmup_default_backend_and_bad_args():
    expected = "cpu" if ops.available_backends()["cpu"].available else "torch"
    assert set(ops.warmup(torch.bfloat16, 64, 8, "cpu").values()) == {expected}
    with pytest.raises(TypeError, match="dtype must be"):
        ops.warmup(torch.int32, 64, 16, "cpu")
    with pytest.raises(ValueError, match="head_dim, block_size and num_heads"):
        ops.warmup(torch.float32, 0, 16, "cpu")


def test_warmup_triton():
    """On the GPU: compiles every variant the engine will launch; on the CPU: runs them in
    the interpreter."""
    device = triton_device()
    if device is None:
        pytest.skip(triton_skip_reason())
    dtype = torch.float16 if device == "cuda" else torch.float32
    used = ops.warmup(dtype, 64, 16, device, backend="triton")
    assert set(used.values()) == {"triton"}
