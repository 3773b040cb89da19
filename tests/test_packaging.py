"""Packaging hazards: the repository's kernels/ folder seen as a top-level `kernels`; the
CUDA toolkit behind a wrapper `nvcc`."""

import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = f"""
import gc, os, sys
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, {str(ROOT)!r})
import torch
import kernels  # what transformers does when it finds this folder on sys.path
assert [n for n in vars(kernels) if not n.startswith("__")] == [], "kernels/ must stay inert"
from transformers.utils.import_utils import is_kernels_available
assert not is_kernels_available()
from cbatch import ops
q = torch.randn(2, 2, 16)
kc = torch.randn(4, 4, 2, 16)
bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
sl = torch.tensor([5, 8], dtype=torch.int32)
for _ in range(3):
    ops.paged_decode_attention(q, kc, kc, bt, sl, backend="triton")
    gc.collect()
print("ok")
"""


def test_top_level_kernels_import_is_inert():
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                            cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on PATH")
def test_setup_finds_the_toolkit_behind_nvcc():
    """setup.py asks nvcc for the toolkit root (torch's guess, nvcc's parent folder, has no
    libcudart when nvcc is a wrapper script such as /usr/local/bin/nvcc)."""
    helpers = runpy.run_path(str(ROOT / "setup.py"), run_name="not_main")  # no setup() call
    root = helpers["toolkit_root_from_nvcc"]()
    assert root is not None
    assert any(os.path.exists(os.path.join(root, lib, "libcudart.so")) for lib in ("lib64", "lib"))
    assert os.path.exists(os.path.join(root, "bin", "nvcc"))
