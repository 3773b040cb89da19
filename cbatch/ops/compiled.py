"""Loads the compiled extension ``cbatch._C`` once and remembers why it is missing."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import warnings
from pathlib import Path

import torch  # the extension links against libtorch: load it first

from cbatch import envs


def reinstall_command() -> str:
    """The pip command that rebuilds the extension against the torch installed here: in a
    source checkout (an editable install) that checkout, else the sdist of this version."""
    checkout = Path(__file__).resolve().parents[2]  # cbatch/ops/compiled.py
    if (checkout / "setup.py").is_file():
        source = f"-e {checkout}"
    else:
        from importlib.metadata import version  # the installed distribution's

        source = f"cbatch-{version('cbatch')}.tar.gz (the sdist) or a checkout of it"
    return f"{Path(sys.executable).name} -m pip install --no-build-isolation --no-deps " \
        f"--force-reinstall {source}"


def _why(error: ImportError) -> str:
    """What an ImportError of cbatch._C usually means, in words a user can act on."""
    text = str(error)
    if "undefined symbol" in text or "version `" in text:
        return ("it was built against another torch (or C++ ABI) than the torch "
                f"{torch.__version__} that loads it now; a pip build with build isolation "
                "compiles against the newest torch on the index, not the installed one")
    if "cannot open shared object file" in text:
        return "a library it was linked against (e.g. the CUDA runtime) is not found here"
    return "the extension does not match this Python, torch or machine"


def _load():
    """cbatch._C, or None and the reason; warns once, loudly, when a built extension fails."""
    if envs.CBATCH_NO_EXT:
        return None, "disabled by CBATCH_NO_EXT=1"
    if importlib.util.find_spec("cbatch._C") is None:  # installed with CBATCH_NO_EXT=1
        return None, ("not built (cbatch was installed with CBATCH_NO_EXT=1); to build it: "
                      + reinstall_command())
    try:
        module = importlib.import_module("cbatch._C")
    except ImportError as e:
        reason = f"cbatch._C failed to load: {e}"
        warnings.warn(
            f"{reason}\n  Why: {_why(e)}.\n  So the C++ CPU and CUDA kernels are off and "
            "attention runs the much slower pure-torch reference (or Triton on a GPU).\n  Fix: "
            f"{reinstall_command()}\n  (cbatch.ops.available_backends() says what is live.)",
            RuntimeWarning, stacklevel=2)
        return None, f"{reason}; rebuild it: {reinstall_command()}"
    return module, None


_C, load_error = _load()  # a module is imported once: the warning is given once


def _cpu_options() -> tuple[str, str]:
    """``$CBATCH_CPU_ISA`` and ``$CBATCH_CPU_ATTENTION``, as ``set_cpu_options`` takes them
    (a value they do not take: warned about, and the CPU's own paths run)."""
    return envs.CBATCH_CPU_ISA, envs.CBATCH_CPU_ATTENTION


if _C is not None:  # the kernels read no environment: their options are handed over here
    if hasattr(torch.ops.cbatch, "set_cpu_options"):
        torch.ops.cbatch.set_cpu_options(*_cpu_options())
    else:  # an extension built from older sources (an editable install not rebuilt)
        load_error = f"cbatch._C is older than this cbatch; rebuild it: {reinstall_command()}"
        warnings.warn(f"{load_error}\n  So the C++ CPU and CUDA kernels are off.",
                      RuntimeWarning, stacklevel=2)
        _C = None


_BUILD_INFO: dict | None = None


def build_info() -> dict | None:
    """What the compiled extension was built with, or None when it is not loaded.

    Keys: ``backends`` (subset of ["cpu", "cuda"]), ``compiler`` (e.g. "gcc 13.3.0"),
    ``libstdcxx`` (its major release), ``cxx11_abi``, ``cuda_archs`` and ``nvcc`` (None
    without CUDA), ``torch_version`` (the torch it was compiled against), ``openmp``, and
    ``pybind11`` (None: the extension has no pybind11 module).
    """
    global _BUILD_INFO
    if _C is not None and _BUILD_INFO is None:
        _BUILD_INFO = json.loads(torch.ops.cbatch.build_info())
    return _BUILD_INFO


def compiled_backends() -> list[str]:
    """Backends compiled into the extension: a subset of ["cpu", "cuda"]."""
    info = build_info()
    return [] if info is None else list(info["backends"])
