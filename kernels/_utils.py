"""Helpers shared by the Triton launchers."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (the CPU interpreter used by the tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def configs(space: list[dict], num_warps: list[int], default: dict) -> list[triton.Config]:
    """Autotune configs: the whole explicit space on a GPU, one default config under the
    interpreter (where benchmarking them is meaningless and slow)."""
    if interpreting():
        return [triton.Config(default, num_warps=4)]
    return [triton.Config(kw, num_warps=w) for kw in space for w in num_warps]


def upcast(dtype: torch.dtype) -> bool:
    """Do the dots in fp32: for fp32 inputs, and always under the interpreter (its bf16
    arithmetic is wrong)."""
    return dtype == torch.float32 or interpreting()


@triton.jit
def paged_offsets(table, offs_n, mask_n, PAGE_SIZE: tl.constexpr, stride_c_block,
                  stride_c_tok):
    """Element offsets in the cache of a sequence's token positions ``offs_n`` (masked by
    ``mask_n``), through its block table ``table``: the start of each token's [H, D] row."""
    block = tl.load(table + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
    return block * stride_c_block + (offs_n % PAGE_SIZE) * stride_c_tok
