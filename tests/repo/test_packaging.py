"""Packaging hazards: errors raised from C++ must reach Python as exceptions, not kill it;
the repository's kernels/ folder seen as a top-level `kernels`; the CUDA toolkit behind a
wrapper `nvcc`."""

import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cbatch import ops
from cbatch.ops import compiled
from tests.helpers import triton_interpreter_problem

ROOT = Path(__file__).resolve().parents[2]

# Calls the compiled ops straight through torch.ops with inputs their C++ checks refuse.
# On the H100 image (g++ 13.3, torch 2.11) every such error once killed the interpreter with
# SIGSEGV; in a subprocess a crash fails this test instead of the whole run.
RAISE_FROM_CPP = """
import torch
import cbatch.ops  # loads cbatch._C, whose library registers torch.ops.cbatch.*

def expect(exc, fn, *args):
    try:
        fn(*args)
    except exc as e:
        print(type(e).__name__, str(e).splitlines()[0])
    else:
        raise SystemExit(f"{fn} raised nothing")

devices = ["cpu"] + (["cuda"] if "cuda" in cbatch.ops.compiled.compiled_backends()
                     and torch.cuda.is_available() else [])
for device in devices:
    kc = torch.zeros(4, 4, 2, 16, device=device)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    q = torch.randn(2, 2, 16, device=device)
    k = torch.randn(3, 2, 16, device=device)
    if device == "cpu":  # only the CPU kernel reads lengths on the host
        sl = torch.tensor([5, 9], dtype=torch.int32)
        expect(ValueError, torch.ops.cbatch.paged_decode_attention, q, kc, kc, bt, sl, 0.25)
        slots = torch.tensor([0, 16, 3])
    else:
        sl = torch.tensor([5, 8], dtype=torch.int32)  # on the wrong device
        expect(ValueError, torch.ops.cbatch.paged_decode_attention, q, kc, kc, bt, sl, 0.25)
        slots = torch.tensor([0, 1, 3])  # on the wrong device
    expect(ValueError, torch.ops.cbatch.write_kv_cache, k, k, kc, kc, slots)
    expect(TypeError, torch.ops.cbatch.write_kv_cache, k, k, kc, kc, slots.int())
print("survived")
"""


@pytest.mark.skipif(compiled.build_info() is None, reason="compiled extension not built")
def test_errors_raised_in_cpp_reach_python_as_exceptions():
    result = subprocess.run([sys.executable, "-c", RAISE_FROM_CPP], capture_output=True,
                            text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, f"returncode {result.returncode}: {result.stderr[-2000:]}"
    lines = result.stdout.splitlines()
    assert lines[-1] == "survived"
    assert lines[0].startswith("ValueError seq_lens[1] = 9 is outside [1, 8]"), lines
    assert lines[1].startswith("ValueError slot_mapping[1] = 16 is outside [-1, 16)"), lines
    assert lines[2].startswith("TypeError slot_mapping must be Long"), lines
    if len(lines) > 4:  # the CUDA entry points too
        assert [line.split()[0] for line in lines[3:6]] == ["ValueError", "ValueError",
                                                            "TypeError"], lines
        assert "must be on cuda" in lines[3] and "must be on cuda" in lines[4], lines


@pytest.mark.skipif(compiled.build_info() is None, reason="compiled extension not built")
def test_build_info_names_the_toolchain():
    """The extension says what built it; it has no pybind11 module to clash with torch's."""
    info = compiled.build_info()
    assert info["compiler"].split()[0] in ("gcc", "clang")
    assert any(ch.isdigit() for ch in info["compiler"])
    assert info["pybind11"] is None
    assert info["torch_version"] == torch.__version__.split("+")[0]
    assert ("cuda" in info["backends"]) == (info["nvcc"] is not None)
    assert info["compiler"] in ops.available_backends()["cpu"].detail
    so = Path(compiled._C.__file__).read_bytes()
    assert b"8pybind11" not in so  # no symbol of namespace pybind11 (mangled "N8pybind11")

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
    """The probe runs Triton's interpreter (the kernels' first call imports triton)."""
    problem = triton_interpreter_problem()  # a subprocess on a GPU machine: ask only here
    if problem is not None:
        pytest.skip(problem)
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


def test_gpu_check_script_parses():
    """scripts/gpu_check.sh is run only on a GPU machine: check here at least that bash
    parses it (and shellcheck passes, where installed) and that it refuses unknown stages."""
    script = ROOT / "scripts" / "gpu_check.sh"
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    result = subprocess.run(["bash", str(script), "nonsense"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "usage:" in result.stderr
    if shutil.which("shellcheck"):
        result = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout
