"""The batch-invariant linear layer: a row's result never depends on how many rows share the
call (cbatch.layers.linear; the CUDA half is the fixed-config Triton matmul)."""

import pytest
import torch
import torch.nn.functional as F

from cbatch.layers import linear as invariant
from cbatch.ops import cpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k, n", [(64, 192), (256, 64), (64, 512), (768, 768)])
def test_cpu_linear_rows_do_not_depend_on_the_number_of_rows(k, n, dtype):
    if dtype == torch.bfloat16 and cpu.has_amx() and k >= 768:
        # oneDNN's bf16 GEMM on AMX sums a row differently from ~44 rows on, padded or not;
        # a batch-invariant engine never runs this fallback there: cbatch's kernel runs bf16
        # on every AMX CPU (AMX came after AVX512-BF16), and an engine forced off it is
        # refused (tests/core/test_batch_invariance.py)
        assert cpu.route_available("cbatch", torch.bfloat16)
        pytest.skip("bf16 F.linear on AMX is not batch-invariant; the engine runs cbatch's "
                    "kernel here instead")
    gen = torch.Generator().manual_seed(k + n)
    weight = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    x = torch.randn(2100, k, generator=gen).to(dtype)
    full = invariant.batch_invariant_linear(x, weight, bias)
    torch.testing.assert_close(full, F.linear(x, weight, bias))
    sizes = list(range(1, 40)) + [63, 64, 65, 100, 257, 1000, 2047]
    for M in sizes:
        start = int(torch.randint(0, 2100 - M, (1,), generator=gen))
        rows = invariant.batch_invariant_linear(x[start:start + M], weight, bias)
        assert torch.equal(rows, full[start:start + M]), f"M={M}"


def test_triton_matmul_matches_torch():
    """The fixed-config Triton matmul against F.linear (on the CPU in Triton's interpreter)."""
    pytest.importorskip("triton")
    from cbatch.kernels import matmul

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 80, generator=gen).to(device)  # N, K not multiples of the tiles
    bias = torch.randn(96, generator=gen).to(device)
    x = torch.randn(150, 80, generator=gen).to(device)
    torch.testing.assert_close(matmul.matmul(x, weight, bias), F.linear(x, weight, bias),
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(matmul.matmul(x[:1], weight), F.linear(x[:1], weight),
                               atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="x must be"):
        matmul.matmul(x[:, :10], weight)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the interpreter's dot "
                    "is numpy's, whose result for a row depends on its place in the tile")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_matmul_rows_do_not_depend_on_the_number_of_rows(dtype):
    from cbatch.kernels import matmul

    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(2304, 768, generator=gen) * 0.05).to("cuda", dtype)
    bias = torch.randn(2304, generator=gen).to("cuda", dtype)
    x = torch.randn(1100, 768, generator=gen).to("cuda", dtype)
    full = matmul.matmul(x, weight, bias)
    for M in (1, 2, 5, 16, 63, 64, 65, 127, 300, 1000):
        start = int(torch.randint(0, 1100 - M, (1,), generator=gen))
        assert torch.equal(matmul.matmul(x[start:start + M], weight, bias),
                           full[start:start + M]), f"M={M}"
