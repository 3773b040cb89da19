"""keep_freed_memory: glibc's malloc keeps a step's freed activations for the next step (no
page faults), unless the user chose malloc's thresholds through the environment."""

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

# Three "steps", each allocating three blocks of 24 MB (under the 32 MB mmap threshold),
# touching every page and freeing them: prints whether the thresholds were set, and the page
# faults of the last two steps.
PROBE = """
import ctypes, resource
from cbatch.core.cpu.memory import keep_freed_memory
print(keep_freed_memory())
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 24 << 20
for step in range(3):
    if step == 1:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(size) for _ in range(3)]
    for p in blocks:
        ctypes.memset(p, 1, size)
    for p in blocks:
        libc.free(p)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
PAGES_PER_STEP = 3 * (24 << 20) // 4096


def _probe(env: dict[str, str]) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, check=True,
                         capture_output=True, text=True, timeout=120).stdout.split()
    return out[0], int(out[1])


def test_freed_blocks_are_reused_without_page_faults():
    set_here, faults = _probe({})
    assert set_here == "True"
    assert faults < PAGES_PER_STEP // 10, faults


def test_the_users_malloc_settings_are_left_alone():
    set_here, faults = _probe({"MALLOC_MMAP_THRESHOLD_": "4096"})
    assert set_here == "False"
    assert faults >= 2 * PAGES_PER_STEP, faults  # each block mmapped anew, as asked
