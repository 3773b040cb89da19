"""Build cbatch and its compiled extension ``cbatch._C``.

C++ CPU kernels are always compiled; CUDA kernels are added when the installed torch
is a CUDA build and nvcc is found.  Knobs (environment variables):

- ``CBATCH_NO_EXT=1``         skip the compiled extension (pure-torch / Triton paths only)
- ``CBATCH_NO_CUDA=1``        compile the CPU kernels only, even with a CUDA torch
- ``TORCH_CUDA_ARCH_LIST``    CUDA archs, e.g. ``"9.0"``; default ``"8.0;9.0"``
- ``MAX_JOBS``                parallel compile jobs; default: the number of CPUs
"""

import os
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent
PACKAGES = ["cbatch", "cbatch.models", "cbatch.kernels"]
PACKAGE_DIR = {"cbatch.kernels": "kernels"}  # Triton code: never a top-level `kernels`


def _extensions():
    if os.environ.get("CBATCH_NO_EXT", "0") == "1":
        return [], {}
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    with_cuda = (
        torch.version.cuda is not None
        and CUDA_HOME is not None
        and os.environ.get("CBATCH_NO_CUDA", "0") != "1"
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


ext_modules, cmdclass = _extensions()

setup(
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
