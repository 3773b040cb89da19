"""Helpers shared by the Triton launchers."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from cbatch import envs


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (the CPU interpreter used by the tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def autotuning() -> bool:
    """True under CBATCH_TRITON_AUTOTUNE=1 (and not in the interpreter): the launchers then
    benchmark every config of their space on each new key, which compiles 9-12 variants per
    (dtype, head_dim, page size, split), so that a first call takes minutes on a GPU.
    Otherwise each launch takes the one config its shape class's heuristic picks."""
    return envs.CBATCH_TRITON_AUTOTUNE and not interpreting()


def configs(space: list[dict], num_warps: list[int]) -> list[triton.Config]:
    """The autotune space (CBATCH_TRITON_AUTOTUNE=1): every tile in ``space`` x warps."""
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
