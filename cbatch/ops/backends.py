"""Which backend runs each op: the registry of implementations, what this install has, and
the choice for a device and head_dim (an explicit backend, else ``$CBATCH_ATTENTION_BACKEND``,
else the fastest available one)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

import torch

from cbatch import envs
from cbatch.ops import compiled, reference
from cbatch.ops.checks import check_no_meta_mix

BACKENDS = ("cuda", "triton", "cpu", "torch")
_PREFERENCE = {"cuda": ("cuda", "triton", "torch"), "cpu": ("cpu", "torch")}


@dataclass(frozen=True)
class BackendStatus:
    """Whether a backend is usable in this install, and why (not)."""

    available: bool
    detail: str


def _triton_status() -> BackendStatus:
    try:
        import triton
    except ImportError as e:
        return BackendStatus(False, f"triton is not installed ({e})")
    # the ops it runs beyond attention: the sampling draw and the quantized GEMMs, on CUDA
    return BackendStatus(True, f"triton {triton.__version__}; also the sampling draw and the "
                         "quantized GEMMs (W8A16, W4A16, W8A8) on CUDA")


_TRITON: list[bool] = []  # (not functools.cache: torch.compile warns about it)


def triton_available() -> bool:
    """Whether triton is installed and imports: what the dispatches that run a Triton kernel
    on CUDA tensors ask (the sampling draw, the quantized GEMMs).  Asked once: importing
    triton is slow."""
    if not _TRITON:
        _TRITON.append(_triton_status().available)
    return _TRITON[0]


def available_backends() -> dict[str, BackendStatus]:
    """Which backends this install has and this machine can run, and for each missing one
    the reason (the CUDA kernels are off where no GPU is visible, though compiled).

    >>> available_backends()["torch"].available
    True
    """
    built = compiled.compiled_backends()
    info = compiled.build_info()
    status = {}
    if "cuda" in built:
        compiled_by = f"compiled by nvcc {info['nvcc']} for {info['cuda_archs']}"
        if torch.cuda.is_available():
            status["cuda"] = BackendStatus(True, compiled_by)
        else:  # a CUDA build of torch on a machine without a GPU (or with it hidden)
            status["cuda"] = BackendStatus(
                False, f"built for CUDA ({compiled_by}), but no GPU is visible here")
    elif info is None:
        status["cuda"] = BackendStatus(False, compiled.load_error or "extension not loaded")
    else:
        status["cuda"] = BackendStatus(False, "extension built without CUDA (CPU-only torch, "
                                       "no nvcc, or CBATCH_NO_CUDA=1)")
    status["triton"] = _triton_status()
    if "cpu" in built:
        omp = "with OpenMP" if info["openmp"] else "without OpenMP"
        status["cpu"] = BackendStatus(
            True, f"compiled by {info['compiler']} {omp} against torch {info['torch_version']}")
    else:
        status["cpu"] = BackendStatus(False, compiled.load_error or "extension not loaded")
    status["torch"] = BackendStatus(True, "pure-torch reference")
    return status


# op name -> backend -> implementation: the reference, then the compiled kernels and the
# Triton launchers this install has.
_IMPLS: dict[str, dict[str, Callable]] = {
    "write_kv_cache": {"torch": reference.write_kv_cache},
    "paged_decode_attention": {"torch": reference.paged_decode_attention},
    "paged_prefill_attention": {"torch": reference.paged_prefill_attention},
}
# Compiled kernels: which ops each compiled backend implements.
_COMPILED_OPS = {
    "cpu": ("write_kv_cache", "paged_decode_attention", "paged_prefill_attention"),
    "cuda": ("write_kv_cache", "paged_decode_attention"),
}
for _backend in compiled.compiled_backends():
    for _op in _COMPILED_OPS[_backend]:
        _IMPLS[_op][_backend] = getattr(torch.ops.cbatch, _op)

if compiled.compiled_backends():

    # (each fake refuses meta tensors mixed with real ones: check_no_meta_mix)
    @torch.library.register_fake("cbatch::write_kv_cache")
    def _(key, value, key_cache, value_cache, slot_mapping) -> None:
        check_no_meta_mix("cbatch::write_kv_cache", key=key, value=value, key_cache=key_cache,
                          value_cache=value_cache, slot_mapping=slot_mapping)
        return None

    @torch.library.register_fake("cbatch::paged_decode_attention")
    def _(query, key_cache, value_cache, block_tables, seq_lens, scale):
        check_no_meta_mix("cbatch::paged_decode_attention", query=query, key_cache=key_cache,
                          value_cache=value_cache, block_tables=block_tables,
                          seq_lens=seq_lens)
        return query.new_empty(query.shape)

    @torch.library.register_fake("cbatch::paged_prefill_attention")
    def _(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale):
        check_no_meta_mix("cbatch::paged_prefill_attention", query=query, key_cache=key_cache,
                          value_cache=value_cache, block_tables=block_tables,
                          cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens)
        return query.new_empty(query.shape)


def _triton(op: str) -> Callable:
    """A stand-in for the Triton implementation of ``op``: the first call imports it
    (importing triton is slow) and puts the custom op itself in the table."""

    def first_call(*args):
        from cbatch.ops import triton as triton_ops

        _IMPLS[op]["triton"] = impl = getattr(triton_ops, op)
        return impl(*args)

    return first_call


if importlib.util.find_spec("triton") is not None:
    for _op in _IMPLS:
        _IMPLS[_op]["triton"] = _triton(_op)

_DEVICE_OF = {"cuda": "cuda", "cpu": "cpu"}  # backends tied to one device type


# Kernel limits beyond device and op: (op, backend) -> head dims it handles.
_HEAD_DIMS = {("paged_decode_attention", "cuda"): (64, 128)}


def impl_of(op: str, backend: str) -> Callable:
    """The implementation of ``op`` by ``backend`` (one :func:`resolve_backend` returned)."""
    return _IMPLS[op][backend]


def _backend_ok(op: str, backend: str, device_type: str, head_dim: int | None = None,
                interpret: bool = False) -> bool:
    if backend not in _IMPLS[op]:
        return False
    if head_dim is not None and head_dim not in _HEAD_DIMS.get((op, backend), (head_dim,)):
        return False
    if backend == "triton":
        return device_type == "cuda" or interpret
    return _DEVICE_OF.get(backend, device_type) == device_type


def resolve_backend(op: str, device: torch.device, backend: str | None = None,
                    head_dim: int | None = None) -> str:
    """The backend that runs ``op`` on tensors on ``device`` (with this ``head_dim``).

    An explicit ``backend`` wins, then ``$CBATCH_ATTENTION_BACKEND``, then the fastest
    available one for the device.  Raises ValueError for an unknown name or a backend
    that cannot run this op on these tensors.
    """
    backend = backend or envs.CBATCH_ATTENTION_BACKEND or None
    key = (op, device.type, backend, head_dim, os.environ.get("TRITON_INTERPRET") == "1")
    resolved = _RESOLVED.get(key)  # every op call asks: keep the search off the hot path
    if resolved is None:
        resolved = _RESOLVED[key] = _resolve(*key)
    return resolved


_RESOLVED: dict[tuple, str] = {}  # (not functools.lru_cache: torch.compile warns about it)


def _resolve(op: str, device_type: str, backend: str | None, head_dim: int | None,
             interpret: bool) -> str:
    if backend is None:
        for candidate in _PREFERENCE.get(device_type, ("torch",)):
            if _backend_ok(op, candidate, device_type, head_dim, interpret):
                return candidate
        return "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if not _backend_ok(op, backend, device_type, head_dim, interpret):
        status = available_backends()[backend]
        if not status.available:
            why = status.detail
        elif _backend_ok(op, backend, device_type, None, interpret):
            why = f"its kernel supports head_dim {_HEAD_DIMS[(op, backend)]}, got {head_dim}"
        else:
            why = f"it has no {op} kernel for {device_type} tensors"
        raise ValueError(f"backend {backend!r} cannot run {op} on {device_type}: {why}")
    return backend


@dataclass(frozen=True)
class BoundKernels:
    """The three kernels for one device, head_dim and backend choice, looked up once.

    A model calls these on its hot path instead of the checked public functions above: no
    backend search and no argument checks per call (its step batches are valid by
    construction; the public ops remain the checked entry for everyone else).

    write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    decode(query, key_cache, value_cache, block_tables, seq_lens, scale) -> [S, H, D]
    prefill(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
            max_query_len) -> [T, H, D]
    """

    write_kv_cache: Callable
    decode: Callable
    prefill: Callable
    backends: dict[str, str]  # op name -> the backend it resolved to


def bind_kernels(device: torch.device | str, head_dim: int,
                 backend: str | None = None) -> BoundKernels:
    """Resolve each op's backend for ``device`` and ``head_dim`` (as the public ops would)
    and return its implementation."""
    device = torch.device(device)
    names = {op: resolve_backend(op, device, backend, None if op == "write_kv_cache" else
                                 head_dim) for op in _IMPLS}

    def impl(op: str) -> Callable:
        if names[op] == "triton":  # the custom op itself, not the first-call stand-in
            from cbatch.ops import triton as triton_ops

            return getattr(triton_ops, op)
        return impl_of(op, names[op])

    prefill_impl = impl("paged_prefill_attention")
    if names["paged_prefill_attention"] == "triton":
        prefill = prefill_impl  # its grid depends on max_query_len
    else:
        def prefill(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                    scale, max_query_len):
            return prefill_impl(query, key_cache, value_cache, block_tables, cu_seqlens_q,
                                seq_lens, scale)
    return BoundKernels(impl("write_kv_cache"), impl("paged_decode_attention"), prefill, names)
