"""Loads the compiled extension ``cbatch._C`` once and remembers why it is missing."""

from __future__ import annotations

import os

import torch  # noqa: F401  (the extension links against libtorch: load it first)

_C = None
load_error: str | None = None

if os.environ.get("CBATCH_NO_EXT", "0") == "1":
    load_error = "disabled by CBATCH_NO_EXT=1"
else:
    try:
        from cbatch import _C  # type: ignore[attr-defined,no-redef]
    except ImportError as e:  # not built (CBATCH_NO_EXT at install time) or ABI mismatch
        load_error = f"cbatch._C is not importable ({e}); reinstall with " \
            "`pip install --no-build-isolation -e .`"


def build_info() -> dict | None:
    """What the compiled extension was built with, or None when it is not loaded."""
    return None if _C is None else dict(_C.build_info())


def compiled_backends() -> list[str]:
    """Backends compiled into the extension: a subset of ["cpu", "cuda"]."""
    info = build_info()
    return [] if info is None else list(info["backends"])
