"""Helpers shared by the Triton launchers."""

from __future__ import annotations

import functools
import os

import torch
import triton


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (the CPU interpreter used by the tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def configs(space: list[dict], num_warps: list[int], default: dict) -> list[triton.Config]:
    """Autotune configs: the whole explicit space on a GPU, one default config under the
    interpreter (where benchmarking them is meaningless and slow)."""
    if interpreting():
        return [triton.Config(default, num_warps=4)]
    return [triton.Config(kw, num_warps=w) for kw in space for w in num_warps]


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def upcast(dtype: torch.dtype) -> bool:
    """Do the dots in fp32: for fp32 inputs, and always under the interpreter (its bf16
    arithmetic is wrong)."""
    return dtype == torch.float32 or interpreting()
