"""Keep the memory a CPU step frees for the next step, instead of handing it back to the OS.

A long prefill step allocates activations of tens of MB (``[2048, 3072]`` fp32 is 25 MB) and
frees them at its end.  glibc's malloc serves such blocks with ``mmap`` or returns the top of
its heap to the OS once more than its trim threshold is free, so the next step faults every
page back in, zeroed by the kernel (benchmarks/NOTES.md, "CPU memory", counts the page
faults with and without the settings below).  A caching
allocator (the CUDA one, or tcmalloc and jemalloc, which vLLM's and IPEX's CPU backends
preload) keeps such memory; :func:`keep_freed_memory` makes glibc's malloc do the same: blocks
up to its largest mmap threshold (32 MB) come from the heap, and the heap is not trimmed
while less than :data:`TRIM_THRESHOLD` of it is free.  The process then holds on to its peak
step's activations, as an engine on a GPU holds its cache.

Settings the user chose (``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` in the
environment) are left alone, as is any C library other than glibc.

The bytes every decode step streams, the packed weights and the KV cache, live on 2 MB
transparent huge pages where Linux gives them (:class:`HugePages`, :func:`huge_page_zeros`):
a decode step walks hundreds of MB, tens of thousands of 4 KB pages and as many TLB misses,
where 2 MB pages need a few hundred.  torch's own allocations stay on malloc (torch's
``THP_MEM_ALLOC_ENABLE`` would move every allocation of 2 MB or more, and is read once, before
an engine exists).  ``$CBATCH_HUGE_PAGES=0`` keeps them on malloc too (benchmarks/NOTES.md,
"CPU memory").

The KV pool is then zeroed by the kernel a page at a time as blocks are first written, not
at start-up (an engine starts sooner and holds only the pages it used); the price is
that the first use of each 2 MB page happens inside a step, and that a machine short of
memory says so then rather than when the engine is made.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import platform

import torch

from cbatch import envs

M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 1 << 30

_done = False


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds as above (once per process).  Returns whether
    they are set now (False: not glibc, or the user set them through the environment)."""
    global _done
    if _done:
        return True
    if platform.libc_ver()[0] != "glibc" or any(
            f"MALLOC_{name}_THRESHOLD_" in os.environ for name in ("MMAP", "TRIM")):
        return False
    libc = ctypes.CDLL(None)
    _done = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _done


def trim_heap() -> None:
    """Give the memory freed so far back to the system (glibc's ``malloc_trim``; nothing
    elsewhere): once the model is loaded, quantized and placed, what loading freed (a float
    copy of every quantized weight) would otherwise stay resident under the trim threshold
    above (benchmarks/bench_load.py measures it).  (The grammar worker has its own copy: it
    imports nothing of cbatch.)"""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


HUGE_PAGE = 2 << 20
CHUNK = 64 << 20  # HugePages maps this much at a time (a larger tensor gets its own mapping)
ALIGN = 4096  # each tensor starts on its own 4 KB page


def huge_pages_available() -> bool:
    """Whether a private mapping can ask Linux for transparent huge pages (THP ``always`` or
    ``madvise``) and ``$CBATCH_HUGE_PAGES`` is not ``0``."""
    if not envs.CBATCH_HUGE_PAGES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _mapping(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeros (uint8) starting on a 2 MB boundary, in a private anonymous mapping
    that asks for huge pages; untouched pages cost no memory."""
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # no THP in this kernel: 4 KB pages, still zeroed on first touch
        pass
    flat = torch.frombuffer(buf, dtype=torch.uint8)  # keeps buf mapped while it lives
    start = -flat.data_ptr() % HUGE_PAGE
    return flat[start:start + nbytes]


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on huge pages (its own mapping), zeroed by the
    kernel page by page on first touch; plain ``torch.zeros`` where huge pages are not
    available."""
    if not huge_pages_available():
        return torch.zeros(shape, dtype=dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    return _mapping(max(nbytes, 1))[:nbytes].view(dtype).view(shape)


class HugePages:
    """Copies of long-lived CPU tensors on huge pages: :meth:`copy` places each after the last
    in a mapping of :data:`CHUNK` bytes (a new one when it is full), so a model's weights share
    ~2 MB pages rather than each rounding up to its own."""

    def __init__(self) -> None:
        self.enabled = huge_pages_available()
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of the CPU ``tensor`` on huge pages (``tensor`` itself where they
        are not available)."""
        if not self.enabled:
            return tensor
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > CHUNK:
            out = _mapping(nbytes)
        else:
            if self._chunk is None or self._used + nbytes > CHUNK:
                self._chunk, self._used = _mapping(CHUNK), 0
            out = self._chunk[self._used:self._used + nbytes]
            self._used += -(-nbytes // ALIGN) * ALIGN
        out = out.view(tensor.dtype).view(tensor.shape)
        out.copy_(tensor)
        return out
