"""cbatch's attention and cache ops, behind one function each with backend selection.

Backends:

- ``"cuda"``   C++/CUDA kernels compiled into ``cbatch._C`` (CUDA tensors)
- ``"triton"`` Triton kernels in ``cbatch.kernels`` (CUDA tensors; CPU under TRITON_INTERPRET=1)
- ``"cpu"``    C++ kernels compiled into ``cbatch._C`` (CPU tensors)
- ``"torch"``  the pure-torch reference in ``cbatch.reference`` (any device; slow)

``backend=None`` picks the fastest one available for the tensors' device; the environment
variable ``CBATCH_ATTENTION_BACKEND`` overrides that choice.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass
from typing import Callable

import torch

from cbatch import _ext, reference

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
    return BackendStatus(True, f"triton {triton.__version__}")


def available_backends() -> dict[str, BackendStatus]:
    """Which backends this install has, and for each missing one the reason.

    >>> available_backends()["torch"].available
    True
    """
    compiled = _ext.compiled_backends()
    info = _ext.build_info()
    status = {}
    if "cuda" in compiled:
        status["cuda"] = BackendStatus(
            True, f"compiled by nvcc {info['nvcc']} for {info['cuda_archs']}")
    elif info is None:
        status["cuda"] = BackendStatus(False, _ext.load_error or "extension not loaded")
    else:
        status["cuda"] = BackendStatus(False, "extension built without CUDA (CPU-only torch, "
                                       "no nvcc, or CBATCH_NO_CUDA=1)")
    status["triton"] = _triton_status()
    if "cpu" in compiled:
        omp = "with OpenMP" if info["openmp"] else "without OpenMP"
        status["cpu"] = BackendStatus(
            True, f"compiled by {info['compiler']} {omp} against torch {info['torch_version']}")
    else:
        status["cpu"] = BackendStatus(False, _ext.load_error or "extension not loaded")
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
for _backend in _ext.compiled_backends():
    for _op in _COMPILED_OPS[_backend]:
        _IMPLS[_op][_backend] = getattr(torch.ops.cbatch, _op)

if _ext.compiled_backends():

    @torch.library.register_fake("cbatch::write_kv_cache")
    def _(key, value, key_cache, value_cache, slot_mapping) -> None:
        return None

    @torch.library.register_fake("cbatch::paged_decode_attention")
    def _(query, key_cache, value_cache, block_tables, seq_lens, scale):
        return query.new_empty(query.shape)

    @torch.library.register_fake("cbatch::paged_prefill_attention")
    def _(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale):
        return query.new_empty(query.shape)


def _triton(op: str) -> Callable:
    """A stand-in for the Triton implementation of ``op``: the first call imports it
    (importing triton is slow) and puts the custom op itself in the table."""

    def first_call(*args):
        from cbatch import triton_ops

        _IMPLS[op]["triton"] = impl = getattr(triton_ops, op)
        return impl(*args)

    return first_call


if importlib.util.find_spec("triton") is not None:
    for _op in _IMPLS:
        _IMPLS[_op]["triton"] = _triton(_op)

_DEVICE_OF = {"cuda": "cuda", "cpu": "cpu"}  # backends tied to one device type


# Kernel limits beyond device and op: (op, backend) -> head dims it handles.
_HEAD_DIMS = {("paged_decode_attention", "cuda"): (64, 128)}


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
    backend = backend or os.environ.get("CBATCH_ATTENTION_BACKEND") or None
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


# ----------------------------------------------------------------------------- checks


def _check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.dim() != 4:
        raise ValueError(f"key_cache must be [num_blocks, block_size, H, D], got shape "
                         f"{tuple(key_cache.shape)}")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache shape {tuple(value_cache.shape)} must equal key_cache shape "
                         f"{tuple(key_cache.shape)}")
    if value_cache.dtype != key_cache.dtype:
        raise TypeError(f"value_cache dtype {value_cache.dtype} must equal key_cache dtype "
                        f"{key_cache.dtype}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache and value_cache must be contiguous")
    if value_cache.device != key_cache.device:
        raise ValueError("key_cache and value_cache must be on the same device")


def _check_same_device(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the cache is on {device}")


def _check_write_args(key, value, key_cache, value_cache, slot_mapping) -> None:
    _check_cache(key_cache, value_cache)
    H, D = key_cache.shape[2:]
    if not (key.dim() == 3 and key.shape[1:] == (H, D)):
        raise ValueError(f"key must be [T, {H}, {D}] to match the cache, got {tuple(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} must equal key shape "
                         f"{tuple(key.shape)}")
    if not (key.dtype == value.dtype == key_cache.dtype):
        raise TypeError(f"key, value and the cache must share a dtype, got {key.dtype}, "
                        f"{value.dtype}, {key_cache.dtype}")
    if slot_mapping.dtype != torch.int64:
        raise TypeError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    if slot_mapping.shape != key.shape[:1]:
        raise ValueError(f"slot_mapping must be [T={key.shape[0]}], got "
                         f"{tuple(slot_mapping.shape)}")
    for name, t in (("key", key), ("value", value)):
        if not (t.stride(2) == 1 and t.stride(1) == D):
            raise ValueError(f"{name} must have dense [H, D] rows per token, got strides "
                             f"{t.stride()}")
    _check_same_device(key_cache.device, key=key, value=value, slot_mapping=slot_mapping)


# ----------------------------------------------------------------------------- ops


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str | None = None,
) -> None:
    """Scatter each new token's key and value into its slot of the paged cache, in place.

    Parameters
    ----------
    key, value : Tensor, ``[T, H, D]``, the cache's dtype
        New keys/values.  Each token's ``[H, D]`` row must be dense; the token stride is
        free, so views of a fused qkv projection are accepted without a copy.
    key_cache, value_cache : Tensor, ``[num_blocks, block_size, H, D]``, contiguous
        The layer's paged cache (modified in place).
    slot_mapping : Tensor, int64 ``[T]``
        ``block_id * block_size + offset`` for each token; ``-1`` writes nothing
        (padding slots of a CUDA graph, tokens whose K/V are already cached).
    backend : {None, "cuda", "triton", "cpu", "torch"}
        None picks the fastest available one (see :func:`available_backends`).

    Backends: all four, for float32, float16 and bfloat16 and any H, D.
    """
    _check_write_args(key, value, key_cache, value_cache, slot_mapping)
    impl = _IMPLS["write_kv_cache"][resolve_backend("write_kv_cache", key_cache.device, backend)]
    impl(key, value, key_cache, value_cache, slot_mapping)


def _check_attention_args(query, key_cache, value_cache, block_tables, seq_lens) -> None:
    _check_cache(key_cache, value_cache)
    H_kv, D = key_cache.shape[2:]
    # grouped-query attention: each of the cache's H_kv heads serves H / H_kv query heads
    if not (query.dim() == 3 and query.shape[2] == D and H_kv > 0 and query.shape[1] % H_kv == 0):
        raise ValueError(f"query must be [*, H, {D}] with H a multiple of {H_kv} to match the "
                         f"cache's heads and head_dim, got {tuple(query.shape)}")
    if query.dtype != key_cache.dtype:
        raise TypeError(f"query dtype {query.dtype} must equal the cache dtype {key_cache.dtype}")
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"query dtype must be float32, float16 or bfloat16, got {query.dtype}")
    if not (block_tables.dtype == seq_lens.dtype == torch.int32):
        raise TypeError(f"block_tables and seq_lens must be int32, got {block_tables.dtype} and "
                        f"{seq_lens.dtype}")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [S, max_blocks], got {tuple(block_tables.shape)}")
    S = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if S < 1:
        raise ValueError(f"seq_lens must be a non-empty [S] tensor, got {tuple(seq_lens.shape)}")
    if block_tables.shape[0] != S:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {S} sequences")
    if not (block_tables.is_contiguous() and seq_lens.is_contiguous()):
        raise ValueError("block_tables and seq_lens must be contiguous")
    _check_same_device(key_cache.device, query=query, block_tables=block_tables,
                       seq_lens=seq_lens)


def check_seq_lens_fit(seq_lens: torch.Tensor, block_tables: torch.Tensor,
                       block_size: int, num_blocks: int | None = None) -> None:
    """Host-side check that every ``seq_len`` fits its block table (and block ids are in range).

    It reads ``seq_lens`` (and ``block_tables``) on the host, so the ops call it only when
    asked (``check_bounds=True``); the engine builds its batches to satisfy it.
    """
    capacity = block_tables.shape[1] * block_size
    lens = seq_lens.tolist()
    for s, n in enumerate(lens):
        if not (0 < n <= capacity):
            raise ValueError(f"seq_lens[{s}] = {n} is outside [1, {capacity}] (block_tables holds "
                             f"{block_tables.shape[1]} blocks of {block_size})")
    if num_blocks is not None:
        for s, n in enumerate(lens):
            used = block_tables[s, : -(-n // block_size)]
            bad = (used < 0) | (used >= num_blocks)
            if bool(bad.any()):
                raise ValueError(f"block_tables[{s}] holds block ids outside [0, {num_blocks}): "
                                 f"{used[bad].tolist()}")


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    backend: str | None = None,
    check_bounds: bool = False,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged KV cache.

    Parameters
    ----------
    query : Tensor, ``[S, H, D]``, float32/float16/bfloat16
        The query of each sequence's newest token (its K/V already written to the cache).
    key_cache, value_cache : Tensor, ``[num_blocks, block_size, H_kv, D]``, query's dtype
        H is a multiple of H_kv: query head h reads KV head ``h // (H // H_kv)``.
    block_tables : Tensor, int32 ``[S, max_blocks]``
        Physical block ids; only the first ``ceil(seq_lens[s] / block_size)`` are read.
    seq_lens : Tensor, int32 ``[S]``
        Context length of each sequence, the new token included: it attends to
        positions ``[0, seq_lens[s])``.
    scale : float, optional
        Softmax scale; default ``1 / sqrt(D)``.
    out : Tensor, ``[S, H, D]``, optional
        Written in place and returned when given.
    backend : {None, "cuda", "triton", "cpu", "torch"}
        "cuda": head_dim 64 and 128 (None falls back to "triton" for others), split-KV
        in partitions of 256 tokens, no host sync (CUDA-graph safe).  "triton": any
        head_dim, split-KV likewise.  "cpu": any head_dim, checks lengths and block ids
        itself.  "torch": the reference, a Python loop over sequences.  The "cuda",
        "triton" and "cpu" kernels sum each (sequence, head) in an order fixed by that
        sequence's length alone: its output is bitwise the same whatever the batch.
    check_bounds : bool
        Also check on the host that every sequence fits its block table and that block
        ids are in range (a device sync; off on the hot path).

    Returns
    -------
    Tensor, ``[S, H, D]`` in query's dtype (accumulation in float32).
    """
    _check_attention_args(query, key_cache, value_cache, block_tables, seq_lens)
    if query.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"query has {query.shape[0]} tokens for {seq_lens.shape[0]} sequences; "
                         f"decode takes exactly one token per sequence")
    if check_bounds:
        check_seq_lens_fit(seq_lens, block_tables, key_cache.shape[1], key_cache.shape[0])
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    impl = _IMPLS["paged_decode_attention"][
        resolve_backend("paged_decode_attention", query.device, backend, query.shape[-1])
    ]
    result = impl(query, key_cache, value_cache, block_tables, seq_lens, scale)
    if out is None:
        return result
    out.copy_(result)
    return out


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    backend: str | None = None,
    check_bounds: bool = False,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's chunk of new tokens over its paged KV cache.

    Sequence s owns query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``: its ``n_s`` newest
    tokens, at positions ``seq_lens[s] - n_s … seq_lens[s] - 1``.  The token at position p
    attends to positions ``[0, p]`` — the cached context plus the causal part of the chunk
    (chunked prefill).  A one-token chunk is a decode step, so any mix works.

    Parameters
    ----------
    query : Tensor, ``[T, H, D]``, float32/float16/bfloat16
    key_cache, value_cache : Tensor, ``[num_blocks, block_size, H_kv, D]``, query's dtype
        Must already hold the K/V of every new token.
    block_tables : Tensor, int32 ``[S, max_blocks]``
    cu_seqlens_q : Tensor, int32 ``[S + 1]``
        Offsets of each sequence's run of tokens in ``query``; ``cu_seqlens_q[-1] == T``.
    seq_lens : Tensor, int32 ``[S]``
        Each sequence's length after this step (cached + new), ``>= n_s``.
    scale, out, backend, check_bounds :
        As in :func:`paged_decode_attention`.
    max_query_len : int, optional
        An upper bound on the longest run ``n_s``, known on the host (the engine knows it).
        It sizes the Triton kernel's grid; without it the grid allows T rows per sequence
        and the surplus programs exit at once.  Other backends do not need it.

    Backends: "triton" (CUDA; any head_dim), "cpu", "torch"; there is no CUDA C++ prefill
    kernel yet, so None picks "triton" for CUDA tensors.

    Returns
    -------
    Tensor, ``[T, H, D]`` in query's dtype.
    """
    _check_attention_args(query, key_cache, value_cache, block_tables, seq_lens)
    if cu_seqlens_q.dtype != torch.int32:
        raise TypeError(f"cu_seqlens_q must be int32, got {cu_seqlens_q.dtype}")
    if cu_seqlens_q.shape != (seq_lens.shape[0] + 1,):
        raise ValueError(f"cu_seqlens_q must be [S + 1 = {seq_lens.shape[0] + 1}], got "
                         f"{tuple(cu_seqlens_q.shape)}")
    _check_same_device(key_cache.device, cu_seqlens_q=cu_seqlens_q)
    if check_bounds:
        check_seq_lens_fit(seq_lens, block_tables, key_cache.shape[1], key_cache.shape[0])
        cu = cu_seqlens_q.tolist()
        if not (cu[0] == 0 and cu[-1] == query.shape[0]):
            raise ValueError(f"cu_seqlens_q must run from 0 to T = {query.shape[0]}, got {cu[0]} … "
                             f"{cu[-1]}")
        for s, n in enumerate(seq_lens.tolist()):
            if not (0 <= cu[s + 1] - cu[s] <= n):
                raise ValueError(f"sequence {s} has {cu[s + 1] - cu[s]} new tokens but "
                                 f"seq_lens[{s}] = {n}")
            if max_query_len is not None and cu[s + 1] - cu[s] > max_query_len:
                raise ValueError(f"sequence {s} has {cu[s + 1] - cu[s]} new tokens > max_query_len "
                                 f"{max_query_len}")
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    name = resolve_backend("paged_prefill_attention", query.device, backend, query.shape[-1])
    args = (query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale)
    if name == "triton":  # the one backend whose grid depends on the longest run
        args += (-1 if max_query_len is None else int(max_query_len),)
    result = _IMPLS["paged_prefill_attention"][name](*args)
    if out is None:
        return result
    out.copy_(result)
    return out


# ----------------------------------------------------------------------------- hot path


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
        if names[op] == "triton":
            from cbatch import triton_ops

            return getattr(triton_ops, op)
        return _IMPLS[op][names[op]]

    prefill_impl = impl("paged_prefill_attention")
    if names["paged_prefill_attention"] == "triton":
        prefill = prefill_impl  # its grid depends on max_query_len
    else:
        def prefill(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                    scale, max_query_len):
            return prefill_impl(query, key_cache, value_cache, block_tables, cu_seqlens_q,
                                seq_lens, scale)
    return BoundKernels(impl("write_kv_cache"), impl("paged_decode_attention"), prefill, names)


# ----------------------------------------------------------------------------- warm-up


def warmup(dtype: torch.dtype, head_dim: int, block_size: int, device: torch.device | str,
           backend: str | None = None, num_heads: int = 1) -> dict[str, str]:
    """Run every kernel a model of this shape class will call, once, on tiny inputs, so
    that compilation (Triton's JIT; its autotuning under CBATCH_TRITON_AUTOTUNE=1) happens
    at start-up and not in the first request's step.

    Covers ``write_kv_cache``, ``paged_decode_attention`` (with the Triton backend on CUDA:
    the single-pass and the split-KV variants) and ``paged_prefill_attention``, each for
    block tables of a width divisible by 16 and of one that is not (Triton specializes on
    that).  Returns ``{op: backend}``, the backend each op resolved to.
    """
    device = torch.device(device)
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    if head_dim < 1 or block_size < 1 or num_heads < 1:
        raise ValueError(f"head_dim, block_size and num_heads must be >= 1, got {head_dim}, "
                         f"{block_size}, {num_heads}")
    num_blocks = 4
    kc = torch.zeros(num_blocks, block_size, num_heads, head_dim, dtype=dtype,
                     device=device)
    vc = torch.zeros_like(kc)
    new = torch.randn(2, num_heads, head_dim, device=device).to(dtype)
    slots = torch.tensor([0, 1], device=device)
    cu_seqlens_q = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    for width in (3, 32):  # max blocks per sequence: one not divisible by 16, one that is
        tables = (torch.arange(2 * width, device=device) % num_blocks).to(torch.int32)
        tables = tables.view(2, width)
        seq_lens = torch.tensor([1, width * block_size], dtype=torch.int32, device=device)
        write_kv_cache(new, new, kc, vc, slots, backend=backend)
        paged_decode_attention(new, kc, vc, tables, seq_lens, backend=backend)
        paged_prefill_attention(new, kc, vc, tables, cu_seqlens_q, seq_lens, backend=backend,
                                max_query_len=1)
        decode = resolve_backend("paged_decode_attention", device, backend, head_dim)
        if decode == "triton" and device.type == "cuda":  # split-KV is chosen per batch
            from cbatch.kernels import decode_attention

            decode_attention.paged_decode_attention(new, kc, vc, tables, seq_lens, 1.0,
                                                    partition_size=128)
    return {op: resolve_backend(op, device, backend, head_dim)
            for op in ("write_kv_cache", "paged_decode_attention", "paged_prefill_attention")}
