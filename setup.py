"""Build cbatch and its compiled extension ``cbatch._C``.

C++ CPU kernels are always compiled; CUDA kernels are added when the installed torch
is a CUDA build and nvcc is found.  Knobs (environment variables; cbatch's own are read
through cbatch/envs.py, the one list of them):

- ``CBATCH_NO_EXT=1``         skip the compiled extension (pure-torch / Triton paths only)
- ``CBATCH_NO_CUDA=1``        compile the CPU kernels only, even with a CUDA torch
- ``TORCH_CUDA_ARCH_LIST``    CUDA archs, e.g. ``"9.0"``; default ``"8.0;9.0"``
- ``MAX_JOBS``                parallel compile jobs; default: the number of CPUs
- ``CUDA_HOME``               the CUDA toolkit; default: where the ``nvcc`` on PATH says it lives
"""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent


def _load_envs():
    """cbatch/envs.py by its path: the package itself is not importable while it builds."""
    spec = importlib.util.spec_from_file_location("cbatch_envs", ROOT / "cbatch" / "envs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


envs = _load_envs()
# Every package under cbatch/ ships (a new subpackage needs only its __init__.py), plus the
# Triton code, which lives in kernels/ and installs as cbatch.kernels: never a top-level
# `kernels`.  Metadata and the version (cbatch.__version__) are in pyproject.toml.
PACKAGES = find_packages(str(ROOT), include=["cbatch", "cbatch.*"]) + ["cbatch.kernels"]
PACKAGE_DIR = {"cbatch.kernels": "kernels"}


def toolkit_root_from_nvcc() -> str | None:
    """The CUDA toolkit's root as the ``nvcc`` on PATH reports it (``nvcc -dryrun``), if its
    runtime library is there.  torch guesses the root as nvcc's parent folder, which is wrong
    when that nvcc is a wrapper script (``/usr/local/bin/nvcc`` on some images): the link
    then fails with ``cannot find -lcudart``."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    try:
        dry = subprocess.run([nvcc, "-dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    for line in (dry.stdout + dry.stderr).splitlines():
        if line.startswith("#$ TOP="):
            root = os.path.normpath(line.split("=", 1)[1].strip())
            if any(os.path.exists(os.path.join(root, lib, "libcudart.so"))
                   for lib in ("lib64", "lib")):
                return root
    return None


def _extensions():
    if envs.CBATCH_NO_EXT:
        return [], {}
    import torch

    if torch.version.cuda and not (os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")):
        root = toolkit_root_from_nvcc()  # before cpp_extension reads the environment
        if root:
            os.environ["CUDA_HOME"] = root
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    with_cuda = (
        torch.version.cuda is not None
        and CUDA_HOME is not None
        and not envs.CBATCH_NO_CUDA
    )
    sources = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "csrc").glob("*.cpp"))]
    sources += [str(p.relative_to(ROOT)) for p in sorted((ROOT / "csrc" / "cpu").glob("*.cpp"))]
    torch_version = torch.__version__.split("+")[0]
    cxx_flags = ["-O3", "-fopenmp", f"-DCBATCH_TORCH_VERSION={torch_version}"]
    nvcc_flags = ["-O3", "--use_fast_math", "-lineinfo"]
    if with_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        archs = os.environ["TORCH_CUDA_ARCH_LIST"].replace(" ", ";").strip(";")
        sources += [str(p.relative_to(ROOT)) for p in sorted((ROOT / "csrc" / "cuda").glob("*.cu"))]
        cxx_flags += ["-DCBATCH_WITH_CUDA", "-DCBATCH_CUDA_ARCHS=" + archs.replace(";", ",")]
        ext = CUDAExtension(
            "cbatch._C",
            sources,
            extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags + ["-DCBATCH_WITH_CUDA"]},
            extra_link_args=["-fopenmp"],
        )
    else:
        ext = CppExtension("cbatch._C", sources, extra_compile_args={"cxx": cxx_flags},
                           extra_link_args=["-fopenmp"])
    return [ext], {"build_ext": BuildExtension}


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import the helpers
    ext_modules, cmdclass = _extensions()
    setup(
        packages=PACKAGES,
        package_dir=PACKAGE_DIR,
        ext_modules=ext_modules,
        cmdclass=cmdclass,
    )
