"""The batched sampler: greedy, filters, and per-request seeds independent of the batch."""

import torch

from cbatch.core.sampler import SamplingBatch, sample


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
