"""The batched sampler: greedy, filters, and per-request seeds independent of the batch."""

import pytest
import torch

from cbatch.core.sampler import SamplingBatch, sample
from cbatch.ops.cpu import argmax


def _batch(n, temperature=1.0, top_k=0, top_p=1.0, seeds=None, positions=None):
    return SamplingBatch([temperature] * n, [top_k] * n, [top_p] * n,
                         seeds or list(range(n)), positions or [0] * n)


def test_greedy_is_argmax():
    logits = torch.randn(5, 100)
    assert torch.equal(sample(logits, _batch(5, temperature=0.0)), logits.argmax(-1))


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(6, 300)
    assert torch.equal(sample(logits, _batch(6, top_k=1)), logits.argmax(-1))
    assert torch.equal(sample(logits, _batch(6, top_p=1e-6)), logits.argmax(-1))


def test_top_k_restricts_support():
    logits = torch.randn(1, 50)
    allowed = set(logits[0].topk(5).indices.tolist())
    for seed in range(200):
        tok = sample(logits, _batch(1, top_k=5, seeds=[seed])).item()
        assert tok in allowed


def test_top_p_restricts_support():
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0, -2.0]])  # p ~ [.71, .26, .013, ...]
    seen = {sample(logits, _batch(1, top_p=0.9, seeds=[s])).item() for s in range(300)}
    assert seen == {0, 1}


def test_same_seed_same_token_whatever_the_batch():
    gen = torch.Generator().manual_seed(0)
    row = torch.randn(1, 1000, generator=gen)
    alone = sample(row, _batch(1, seeds=[42], positions=[3])).item()
    crowd = torch.cat([torch.randn(4, 1000, generator=gen), row, torch.randn(3, 1000)])
    mixed = SamplingBatch([1.0, 0.0, 0.7, 1.0, 1.0, 0.0, 1.0, 1.0], [0] * 8, [1.0] * 8,
                          [1, 2, 3, 4, 42, 5, 6, 7], [0, 0, 0, 0, 3, 0, 0, 0])
    assert sample(crowd, mixed)[4].item() == alone


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().expand(4000, 3)
    counts = torch.bincount(sample(logits, _batch(4000)), minlength=3).float() / 4000
    assert torch.allclose(counts, probs, atol=0.03)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("V", [1, 15, 16, 17, 50257])
def test_greedy_is_torch_argmax_ties_nans_and_infinities_included(dtype, V):
    """The sampler's argmax (cbatch's CPU kernel where the extension is loaded) gives
    torch.argmax's answer: the first index of the maximum, the first NaN if a row has one;
    rows of a wider tensor (row stride > V) too."""
    gen = torch.Generator().manual_seed(V)
    wide = torch.randn(6, V + 5, generator=gen).to(dtype)
    cases = [torch.randn(4, V, generator=gen).to(dtype),
             torch.randint(0, 3, (4, V), generator=gen).to(dtype),  # ties everywhere
             torch.full((2, V), float("-inf"), dtype=dtype),
             wide[:, :V]]
    with_nan = torch.randn(3, V, generator=gen).to(dtype)
    with_nan[1, V // 2] = float("nan")
    with_nan[2, V - 1] = float("nan")
    with_inf = torch.randn(3, V, generator=gen).to(dtype)
    with_inf[0, V - 1] = float("inf")
    with_inf[1, 0] = float("inf")
    for logits in cases + [with_nan, with_inf]:
        assert torch.equal(argmax(logits), logits.argmax(dim=-1))
    assert argmax(torch.empty(0, V, dtype=dtype)).shape == (0,)
