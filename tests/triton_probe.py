"""The smallest kernel that takes the path where Triton 3.6's interpreter breaks under
numpy >= 2.4: a loop bound loaded at a program-id offset goes through `int()` of a
one-element array, which numpy 2.4 refuses (triton-lang/triton #9171, fixed by #9172).
Import it only with TRITON_INTERPRET=1 (the variable acts when triton.jit decorates)."""

import torch
import triton
import triton.language as tl


@triton.jit
def _probe(n_ptr, out_ptr):
    n = tl.load(n_ptr + tl.program_id(0))
    acc = tl.zeros([], dtype=tl.float32)
    for _ in range(0, n, 2):
        acc += 1.0
    tl.store(out_ptr + tl.program_id(0), acc)


def run() -> None:
    out = torch.zeros(2)
    _probe[(2,)](torch.tensor([3, 4], dtype=torch.int32), out)
    assert out.tolist() == [2.0, 2.0], out
