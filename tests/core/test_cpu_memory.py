"""keep_freed_memory: glibc's malloc keeps a step's freed activations (no page faults next
step), unless the user chose malloc's thresholds through the environment."""

import os
import platform
import subprocess
import sys

import pytest

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

PROBE = """
import resource, sys
import torch
from cbatch.core.cpu_memory import keep_freed_memory
print(keep_freed_memory())
def faults_of_four_steps():
    for _ in range(8):  # steps' activations (24 MB, under 32 MB): the heap grows to its peak
        torch.ones(6 << 20).sum()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        torch.ones(6 << 20).sum()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(faults_of_four_steps())
"""


def _probe(env: dict[str, str]) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, check=True,
                         capture_output=True, text=True, timeout=120).stdout.split()
    return out[0], int(out[1])


@glibc
def test_freed_blocks_are_reused_without_page_faults():
    set_here, faults = _probe({})
    assert set_here == "True"
    # 4 allocations of 24 MB fault ~24k pages when each one's pages come anew from the OS
    assert faults < 1000, faults


@glibc
def test_the_users_malloc_settings_are_left_alone():
    set_here, faults = _probe({"MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_MMAP_THRESHOLD_": "4096"})
    assert set_here == "False"
    assert faults > 4 * 6000, faults  # trimmed or mmapped every time, as asked: each page anew
