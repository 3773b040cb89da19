"""Loads the compiled extension ``cbatch._C`` once and remembers why it is missing."""

from __future__ import annotations

import importlib
import json
import os

import torch  # the extension links against libtorch: load it first

_C = None
load_error: str | None = None

if os.environ.get("CBATCH_NO_EXT", "0") == "1":
    load_error = "disabled by CBATCH_NO_EXT=1"
else:
    try:
        _C = importlib.import_module("cbatch._C")
    except ImportError as e:  # not built (CBATCH_NO_EXT at install time) or ABI mismatch
        load_error = f"cbatch._C is not importable ({e}); reinstall with " \
            "`pip install --no-build-isolation -e .`"

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
