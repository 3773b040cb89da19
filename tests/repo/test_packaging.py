"""Packaging: the sdist -> wheel -> fresh virtualenv path a user installing from PyPI takes;
and its hazards: errors raised from C++ must reach Python as exceptions, not kill it; the
repository's kernels/ folder on the path as a top-level `kernels` (Hugging Face's package's
name); the CUDA toolkit behind a wrapper `nvcc`."""

import os
import re
import runpy
import shutil
import site
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
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


@pytest.mark.slow
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


# cbatch._C present but failing to load, as an extension built against another torch does.
BROKEN_EXTENSION = """
import importlib.abc, importlib.machinery, sys, warnings

class Broken(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name == "cbatch._C" else None
    def create_module(self, spec):
        raise ImportError("/site/cbatch/_C.so: undefined symbol: _ZN3c1015SmallVectorBase")
    def exec_module(self, module):
        pass

sys.meta_path.insert(0, Broken())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import cbatch.ops
    status = cbatch.ops.available_backends()
    cbatch.ops.available_backends()
    import cbatch.ops.compiled
print(len(caught))
print(caught[0].category.__name__)
print(status["cpu"].available, status["torch"].available)
print("detail:", status["cpu"].detail)
print(caught[0].message)
"""


@pytest.mark.slow
def test_an_extension_that_fails_to_load_warns_once_with_the_fix():
    env = {k: v for k, v in os.environ.items() if k != "CBATCH_NO_EXT"}
    result = subprocess.run([sys.executable, "-c", BROKEN_EXTENSION], capture_output=True,
                            text=True, cwd=ROOT, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    count, category, available, detail, *message = result.stdout.splitlines()
    message = "\n".join(message)
    assert count == "1" and category == "RuntimeWarning"
    assert available == "False True"
    assert "undefined symbol" in detail and "--no-build-isolation" in detail
    assert "undefined symbol" in message  # the reason, in the loader's words
    assert "another torch" in message and torch.__version__ in message  # what it means
    assert f"pip install --no-build-isolation --no-deps --force-reinstall -e {ROOT}" in message


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
sys.path.insert(0, {str(ROOT)!r})  # first, as from the checkout's root
import torch
import kernels  # Hugging Face's package, which transformers imports
assert os.path.dirname(os.path.realpath(kernels.__file__)) != {str(ROOT / "kernels")!r}
from kernels import CUDAProperties  # what transformers 5.25 imports from it
from transformers import LlamaForCausalLM
try:
    import kernels.decode_attention
except ImportError:
    pass
else:
    raise SystemExit("cbatch's kernels/ imported as a top-level `kernels`")
import cbatch.kernels.decode_attention
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

# The checkout's root with no Hugging Face `kernels` installed: the folder still does not
# answer to that name.
PROBE_WITHOUT_HF_KERNELS = f"""
import sys
sys.path[:] = [{str(ROOT)!r}] + [p for p in sys.path if "-packages" not in p]
try:
    import kernels
except ModuleNotFoundError as e:
    assert e.name == "kernels" and "kernels" not in sys.modules, e
    print("ok")
"""


@pytest.mark.slow
def test_hf_kernels_and_cbatch_kernels_import_from_the_checkout_root():
    """From the checkout's root, `import kernels` is Hugging Face's package (transformers
    imports it) and cbatch's Triton kernels import only as cbatch.kernels, and run (Triton's
    interpreter: the kernels' first call imports triton)."""
    problem = triton_interpreter_problem()  # a subprocess on a GPU machine: ask only here
    if problem is not None:
        pytest.skip(problem)
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                            cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")


def test_kernels_folder_is_not_a_top_level_package_without_hf_kernels():
    result = subprocess.run([sys.executable, "-c", PROBE_WITHOUT_HF_KERNELS],
                            capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"


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


def _clean_copy(dest: Path) -> None:
    """The checkout's files as a fresh clone would have them (tracked and new files that git
    does not ignore): no .venv, no build folders, no compiled extension."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, timeout=60)
    if listed.returncode != 0:  # not a git checkout: copy all but what builds leave behind
        shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*.so", "runs"))
        return
    for name in listed.stdout.decode().split("\0"):
        if name and (ROOT / name).is_file():  # a file deleted but not yet committed is skipped
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)


def _run(cmd, **kwargs) -> str:
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                            timeout=900, **kwargs)
    assert result.returncode == 0, (
        f"{cmd} exited {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result.stdout


def _fresh_venv(path: Path) -> Path:
    """A new virtualenv that sees the packages this interpreter has (torch among them), so
    installing cbatch's wheel downloads nothing.  ``--system-site-packages`` exposes the base
    interpreter's; when this interpreter is itself a virtualenv, a .pth file adds its
    site-packages too (a .pth line only extends sys.path: the editable cbatch installed there
    is not activated)."""
    _run([sys.executable, "-m", "venv", "--system-site-packages", path])
    python = path / "bin" / "python"
    inner = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    outer = dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()["purelib"],
                           sysconfig.get_paths()["platlib"]])
    Path(inner.strip(), "_cbatch_test_outer_site.pth").write_text("\n".join(outer) + "\n")
    return python


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("CBATCH_NO_EXT") == "1", reason="CBATCH_NO_EXT=1 set")
def test_sdist_builds_a_wheel_that_installs_and_runs(tmp_path):
    """From a clean copy of the tree: sdist, a wheel built from that sdist (compiling the
    extension against the installed torch), installed into a fresh virtualenv; from a folder
    outside the checkout, the `cbatch` command and `cbatch.LLM` run and the C++ kernels load."""
    pytest.importorskip("build", reason="needs the `build` package (requirements-dev.txt)")
    import cbatch

    src, dist = tmp_path / "src", tmp_path / "dist"
    _clean_copy(src)
    _run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", dist, src])
    (sdist,) = dist.glob("cbatch-*.tar.gz")
    assert sdist.name == f"cbatch-{cbatch.__version__}.tar.gz"
    with tarfile.open(sdist) as tar:
        in_sdist = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    for needed in ("csrc/checks.h", "csrc/ops.h", "csrc/cpu/attention.cpp",
                   "csrc/cuda/decode_attention.cu", "kernels/decode_attention.py",
                   "README.md", "LICENSE", "cbatch/core/engine.py", "pyproject.toml"):
        assert needed in in_sdist, f"{needed} missing from the sdist"
    assert not [n for n in in_sdist if n.endswith((".so", ".o", ".pyc"))]

    # the wheel from the sdist, the way `pip install cbatch-<version>.tar.gz` builds it
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CBATCH_NO_EXT")}
    _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
          "--no-index", "--wheel-dir", dist, sdist], env=env, cwd=tmp_path)
    (wheel,) = dist.glob("cbatch-*.whl")
    with zipfile.ZipFile(wheel) as whl:
        in_wheel = set(whl.namelist())
    packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "cbatch").rglob("__init__.py")}
    for package in packages | {"cbatch/kernels"}:  # every package of the tree, found not listed
        assert f"{package}/__init__.py" in in_wheel, f"{package} missing from the wheel"
    assert any(n.startswith("cbatch/_C") and n.endswith(".so") for n in in_wheel)
    assert not [n for n in in_wheel if n.startswith("kernels/")]  # never a top-level kernels
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in in_wheel)

    venv = tmp_path / "venv"
    python = _fresh_venv(venv)
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed",
          wheel], env=env)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = dict(env=env, cwd=elsewhere)

    version = _run([venv / "bin" / "cbatch", "--version"], **run)
    assert version.startswith(f"cbatch {cbatch.__version__}"), version
    assert re.search(r"^\s*cpu\s+live\b", version, flags=re.M), version
    generated = _run([venv / "bin" / "cbatch", "generate", "--model", "random:tiny",
                      "--prompt", "hi", "--max-tokens", "4"], **run)
    assert generated.startswith("hi") and len(generated) > len("hi"), generated
    probe = ("import cbatch, cbatch.ops; print(cbatch.__file__); "
             "print(cbatch.ops.available_backends()['cpu'].available); "
             "print(repr(cbatch.LLM('random:tiny').generate('hi')[0].text))")
    where, cpu_loaded, text = _run([python, "-W", "error::RuntimeWarning", "-c", probe],
                                   **run).splitlines()[-3:]
    assert Path(where).resolve().is_relative_to(venv.resolve()), where  # not the checkout
    assert cpu_loaded == "True"
    assert text.startswith("'") and len(text) > 2, text


def test_every_folder_of_python_files_under_cbatch_is_a_package():
    """setup.py ships the packages find_packages sees: a folder of .py files without an
    __init__.py would silently stay out of the wheel."""
    helpers = runpy.run_path(str(ROOT / "setup.py"), run_name="not_main")
    folders = {p.parent for p in (ROOT / "cbatch").rglob("*.py") if "__pycache__" not in p.parts}
    missing = [str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").exists()]
    assert not missing, f"no __init__.py (so not shipped): {missing}"
    found = {name for name in helpers["PACKAGES"]}
    expected = {".".join(f.relative_to(ROOT).parts) for f in folders} | {"cbatch.kernels"}
    assert found == expected
