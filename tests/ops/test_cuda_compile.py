"""Compile-only check of the CUDA sources with nvcc, for sm_80 and sm_90a, on machines with no
GPU and a CPU-only torch (then setup.py leaves the .cu files out of the build).

The nvcc is the CUDA 13.0 compiler that requirements-dev.txt installs from PyPI
(``cuda-toolkit[nvcc,cccl]``, the toolkit torch's CUDA 13.0 wheels pin), so every CI run
compiles every .cu file with the same compiler; without that wheel, the nvcc on PATH, then
CUDA_HOME's.  With none the tests skip, except under CI=true (.ci/run sets it), where they
fail: the compile must not vanish from CI silently.
"""

import importlib.metadata
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from torch.utils import cpp_extension

ROOT = Path(__file__).resolve().parents[2]
CU_SOURCES = sorted((ROOT / "csrc" / "cuda").glob("*.cu"))


def wheel_nvcc() -> str | None:
    """bin/nvcc of the nvidia-cuda-nvcc wheel installed for this interpreter, if any."""
    try:
        files = importlib.metadata.files("nvidia-cuda-nvcc") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name == "nvcc" and file.parent.name == "bin" and Path(file.locate()).is_file():
            return str(file.locate())
    return None


WHEEL_NVCC = wheel_nvcc()
NVCC = WHEEL_NVCC or shutil.which("nvcc") or (
    str(Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc") if cpp_extension.CUDA_HOME else None)
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _nvcc() -> str:
    """The nvcc to compile with; skips without one, fails under CI=true without the wheel's."""
    if IN_CI:
        assert WHEEL_NVCC is not None, (
            "CI=true but the nvidia-cuda-nvcc wheel is not installed: requirements-dev.txt "
            f"installs it (cuda-toolkit[nvcc,cccl]); the nvcc found otherwise: {NVCC}")
    if NVCC is None:
        pytest.skip("nvcc not found (requirements-dev.txt installs it: cuda-toolkit[nvcc,cccl])")
    return NVCC


def test_nvcc_is_found_and_runs():
    """Quick (not slow): a CI run without the compiler fails here too, under -m 'not slow'."""
    nvcc = _nvcc()
    result = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "Cuda compilation tools" in result.stdout, (
        nvcc, result.stdout, result.stderr)


def _include_dirs(tmp_path: Path) -> list[str]:
    dirs = list(cpp_extension.include_paths())
    macros = Path(dirs[0]) / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    if not macros.exists():
        # A CPU-only torch ships the c10/cuda headers but not this generated one; it only
        # says whether c10_cuda is a shared library (it is, in every CUDA wheel).
        shim = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
        shim.parent.mkdir(parents=True)
        shim.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        dirs.append(str(tmp_path))
    return dirs


def _compile(nvcc: str, source: Path, out_dir: Path,
             includes: list[str]) -> subprocess.CompletedProcess:
    cmd = [nvcc, "-c", str(source), "-o", str(out_dir / (source.stem + ".o")), "-std=c++20",
           "-O3", "--use_fast_math", "-DCBATCH_WITH_CUDA", "-Xcompiler", "-fPIC",
           "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90a,code=sm_90a",
           *cpp_extension.COMMON_NVCC_FLAGS, *(f"-I{d}" for d in includes)]
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.mark.slow
def test_cuda_sources_compile(tmp_path):
    nvcc = _nvcc()
    assert CU_SOURCES, "no .cu files found"
    includes = _include_dirs(tmp_path)
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda s: _compile(nvcc, s, tmp_path, includes), CU_SOURCES))
    failures = [f"{s.name}:\n{r.stderr[-3000:]}" for s, r in zip(CU_SOURCES, results)
                if r.returncode != 0]
    assert not failures, f"{nvcc}:\n" + "\n\n".join(failures)
    for source in CU_SOURCES:
        assert (tmp_path / (source.stem + ".o")).stat().st_size > 0
