"""write_kv_cache: every backend against the pure-torch reference, plus input checks."""

import pytest
import torch

from cbatch import ops
from cbatch.ops import reference
from tests.helpers import triton_device

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HAS_CUDA = torch.cuda.is_available()
# Triton runs on CPU tensors only in its interpreter (conftest sets it when there is no GPU).
CPU_BACKENDS = [b for b in ("cpu", "torch", "triton") if ops.available_backends()[b].available
                and (b != "triton" or triton_device() == "cpu")]
CUDA_BACKENDS = [b for b in ("cuda", "triton")
                 if HAS_CUDA and ops.available_backends()[b].available]


def _inputs(T, H, D, num_blocks, block_size, dtype, gen, fused=False):
    """``fused``: False, True (k, v views of a fused [T, 3, H, D] projection: token stride
    3*H*D) or "gqa" (views of a grouped-query [T, 4H + 2H, D] projection, 4 query heads per
    KV head: token stride 6*H*D)."""
    if fused == "gqa":
        qkv = torch.randn(T, 6 * H, D, generator=gen).to(dtype)
        k, v = qkv[:, 4 * H:5 * H], qkv[:, 5 * H:]
    elif fused:
        k, v = torch.randn(T, 3, H, D, generator=gen).to(dtype).unbind(1)[1:]
    else:
        k, v = (torch.randn(T, H, D, generator=gen).to(dtype) for _ in range(2))
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T]
    slots[torch.rand(T, generator=gen) < 0.2] = -1  # some tokens write nothing
    kc = torch.randn(num_blocks, block_size, H, D, generator=gen).to(dtype)
    vc = torch.randn(num_blocks, block_size, H, D, generator=gen).to(dtype)
    return k, v, kc, vc, slots


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 15, 16, 17, 100])
@pytest.mark.parametrize("fused", [False, True, "gqa"])
def test_matches_reference(backend, dtype, T, fused):
    gen = torch.Generator().manual_seed(T)
    k, v, kc, vc, slots = _inputs(T, 4, 32, 13, 16, dtype, gen, fused)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    reference.write_kv_cache(k, v, kc_ref, vc_ref, slots)
    ops.write_kv_cache(k, v, kc, vc, slots, backend=backend)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)  # a copy: bit-exact
    written = slots[slots >= 0]
    assert torch.equal(kc.view(-1, 4, 32)[written], k[slots >= 0])


@pytest.mark.skipif(not CUDA_BACKENDS, reason="needs a GPU")
@pytest.mark.parametrize("backend", CUDA_BACKENDS or ["cuda"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fused", [False, True, "gqa"])
def test_cuda_matches_reference(backend, dtype, fused):
    gen = torch.Generator().manual_seed(1)
    k, v, kc, vc, slots = (t.cuda() for t in _inputs(77, 4, 32, 13, 16, dtype, gen, fused))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    reference.write_kv_cache(k, v, kc_ref, vc_ref, slots)
    ops.write_kv_cache(k, v, kc, vc, slots, backend=backend)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_empty_batch_is_a_no_op():
    gen = torch.Generator().manual_seed(0)
    k, v, kc, vc, slots = _inputs(0, 2, 8, 3, 4, torch.float32, gen)
    before = kc.clone()
    ops.write_kv_cache(k, v, kc, vc, slots)
    assert torch.equal(kc, before)


@pytest.mark.skipif("cpu" not in CPU_BACKENDS, reason="compiled CPU extension not built")
def test_opcheck():
    gen = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        k, v, kc, vc, slots = _inputs(20, 2, 16, 4, 8, dtype, gen)
        torch.library.opcheck(torch.ops.cbatch.write_kv_cache, (k, v, kc, vc, slots))


@pytest.mark.skipif("cpu" not in CPU_BACKENDS, reason="compiled CPU extension not built")
def test_cpp_rejects_out_of_range_slot():
    gen = torch.Generator().manual_seed(0)
    k, v, kc, vc, slots = _inputs(4, 2, 8, 2, 4, torch.float32, gen)
    slots[2] = 8
    with pytest.raises(ValueError, match=r"slot_mapping\[2\] = 8 is outside"):
        ops.write_kv_cache(k, v, kc, vc, slots, backend="cpu")


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda a: a.update(key=a["key"][:, :1]), ValueError, "key must be"),
    (lambda a: a.update(value=a["value"].half()), TypeError, "share a dtype"),
    (lambda a: a.update(slot_mapping=a["slot_mapping"].int()), TypeError, "int64"),
    (lambda a: a.update(slot_mapping=a["slot_mapping"][:-1]), ValueError, "slot_mapping must"),
    (lambda a: a.update(key_cache=a["key_cache"].transpose(0, 1)), ValueError, "value_cache"),
    (lambda a: a.update(key=a["key"].transpose(1, 2).contiguous().transpose(1, 2)),
     ValueError, "dense"),
])
def test_bad_inputs(mutate, exc, match):
    gen = torch.Generator().manual_seed(0)
    k, v, kc, vc, slots = _inputs(6, 2, 8, 4, 4, torch.float32, gen)
    args = dict(key=k, value=v, key_cache=kc, value_cache=vc, slot_mapping=slots)
    mutate(args)
    with pytest.raises(exc, match=match):
        ops.write_kv_cache(**args)


def test_unknown_and_unavailable_backends():
    gen = torch.Generator().manual_seed(0)
    args = _inputs(2, 2, 8, 4, 4, torch.float32, gen)
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.write_kv_cache(*args, backend="tpu")
    with pytest.raises(ValueError, match="backend 'cuda' cannot run write_kv_cache"):
        ops.write_kv_cache(*args, backend="cuda")


def test_env_override(monkeypatch):
    monkeypatch.setenv("CBATCH_ATTENTION_BACKEND", "torch")
    assert ops.resolve_backend("write_kv_cache", torch.device("cpu")) == "torch"
    monkeypatch.delenv("CBATCH_ATTENTION_BACKEND")
    expected = "cpu" if "cpu" in CPU_BACKENDS else "torch"
    assert ops.resolve_backend("write_kv_cache", torch.device("cpu")) == expected


def test_available_backends_explains_missing_ones():
    status = ops.available_backends()
    assert set(status) == {"cuda", "triton", "cpu", "torch"}
    for s in status.values():
        assert s.detail


def test_cuda_backend_off_without_a_gpu(monkeypatch):
    """A CUDA build on a machine without a GPU: the kernels are compiled, not live."""
    from cbatch.ops import backends, compiled

    info = {"nvcc": "12.8", "cuda_archs": "8.0;9.0", "openmp": True, "compiler": "g++",
            "torch_version": torch.__version__}
    monkeypatch.setattr(compiled, "compiled_backends", lambda: ("cpu", "cuda"))
    monkeypatch.setattr(compiled, "build_info", lambda: info)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    status = backends.available_backends()["cuda"]
    assert not status.available
    assert "no GPU is visible here" in status.detail and "nvcc 12.8" in status.detail
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert backends.available_backends()["cuda"].available
