"""Keep the memory a CPU step frees for the next step, instead of handing it back to the OS.

A long prefill step allocates activations of tens of MB (``[2048, 3072]`` fp32 is 25 MB) and
frees them at its end.  glibc's malloc serves such blocks with ``mmap`` or returns the top of
its heap to the OS once more than its trim threshold is free, so the next step faults every
page back in, zeroed by the kernel: 55k-333k page faults in one ``longtail(0.125, 256)`` run
in fp32, 17k-24k with the settings below (benchmarks/NOTES.md, "Long prefill chunks on
cbatch's kernel").  A caching
allocator (the CUDA one, or tcmalloc and jemalloc, which vLLM's and IPEX's CPU backends
preload) keeps such memory; :func:`keep_freed_memory` makes glibc's malloc do the same: blocks
up to its largest mmap threshold (32 MB) come from the heap, and the heap is not trimmed
while less than :data:`TRIM_THRESHOLD` of it is free.  The process then holds on to its peak
step's activations, as an engine on a GPU holds its cache.

Settings the user chose (``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` in the
environment) are left alone, as is any C library other than glibc.
"""

from __future__ import annotations

import ctypes
import os
import platform

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
