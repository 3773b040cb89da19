"""Batched token sampling: greedy, temperature, top-k, top-p, per-request seeds.

All filtering is done on the whole ``[S, vocab]`` logits at once.  Randomness comes from an
exponential race (``argmax(p / E)`` with ``E ~ Exp(1)`` draws the categorical ``p``), and each
row's noise comes from its own generator seeded by (request seed, output position), so a
request's tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cbatch.core.structured_output import apply_bitmask
from cbatch.layers.step_batch import to_device
from cbatch.ops import cpu


@dataclass
class SamplingBatch:
    """Per-row settings for one step's ``[S, vocab]`` logits (host lists, built by the runner)."""

    temperatures: list[float]
    top_ks: list[int]
    top_ps: list[float]
    seeds: list[int]
    positions: list[int]  # how many tokens each request has generated so far
    # structured outputs: int32 [S, ceil(vocab / 32)], bit t of row s set where token t may
    # be sampled (xgrammar's token bitmask; rows without a grammar all ones); None: no row
    # has a grammar
    bitmask: torch.Tensor | None = None

    @property
    def all_greedy(self) -> bool:
        return all(t == 0.0 for t in self.temperatures)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
                        ) -> torch.Tensor:
    # logits: [S, V] fp32; top_k: int64 [S] (0 = off); top_p: fp32 [S] (1 = off)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    V = logits.shape[-1]
    rank = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k.clamp(max=V), V)[:, None]  # a k past the vocab = all
    drop = rank >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    drop |= before >= top_p[:, None]  # the top token always survives (before = 0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _noise(batch: SamplingBatch, rows: list[int], vocab: int, device: torch.device
           ) -> torch.Tensor:
    """Exp(1) noise ``[len(rows), vocab]``, each row from its own (seed, position) stream."""
    out = torch.empty(len(rows), vocab, device=device)
    gen = torch.Generator(device=device)
    for i, r in enumerate(rows):  # one generator call per request, never per token
        gen.manual_seed((batch.seeds[r] * 1_000_003 + batch.positions[r]) % (2**63))
        out[i].exponential_(generator=gen)
    return out


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``logits: [S, V]`` → int64 token ids ``[S]``."""
    if batch.bitmask is not None:  # structured outputs: what a grammar forbids is -inf
        apply_bitmask(logits, batch.bitmask)
    tokens = cpu.argmax(logits)
    if batch.all_greedy:
        return tokens
    logits = logits.float()
    rows = [r for r, t in enumerate(batch.temperatures) if t > 0]
    dev = logits.device
    idx = to_device(rows, dev)
    temps = to_device([batch.temperatures[r] for r in rows], dev, torch.float32)
    top_k = to_device([batch.top_ks[r] for r in rows], dev)
    top_p = to_device([batch.top_ps[r] for r in rows], dev, torch.float32)
    scaled = _filter_top_k_top_p(logits[idx] / temps[:, None], top_k, top_p)
    probs = scaled.softmax(dim=-1)
    tokens[idx] = (probs / _noise(batch, rows, logits.shape[-1], dev)).argmax(dim=-1)
    return tokens


def logprobs_tensors(logits: torch.Tensor, tokens: torch.Tensor,
                     num_logprobs: list[int | None]) -> tuple[torch.Tensor, ...] | None:
    """Log-probabilities of the sampled tokens and the most likely alternatives, on the
    device (no host sync; :func:`logprobs_lists` reads them).

    ``logits: [S, V]`` are the rows :func:`sample` drew ``tokens: [S]`` from; row s asks for
    ``num_logprobs[s]`` alternatives (None: nothing).  The log-probabilities are the
    log-softmax of the model's raw logits in fp32, before temperature, top-k and top-p (what
    vLLM returns by default), so they do not depend on how a request is sampled.  For the R
    rows that ask: ``(top values [R, k], top ids [R, k], sampled ids [R], sampled values
    [R])``, k the most any row asks for; None when no row asks (nothing is computed then)."""
    rows = [s for s, k in enumerate(num_logprobs) if k is not None]
    if not rows:
        return None
    idx = to_device(rows, logits.device)
    logprobs = logits[idx].float().log_softmax(dim=-1)  # [R, V]
    top_values, top_ids = logprobs.topk(max(num_logprobs[s] for s in rows), dim=-1)
    sampled_ids = tokens[idx]
    sampled = logprobs.gather(-1, sampled_ids[:, None])[:, 0]
    return top_values, top_ids, sampled_ids, sampled


def logprobs_lists(tensors: tuple[torch.Tensor, ...] | None, num_logprobs: list[int | None]
                   ) -> list[dict[int, float] | None] | None:
    """:func:`logprobs_tensors`' result on the host: per row, ``{token id: logprob}`` holding
    the k most likely tokens, most likely first, then the sampled token if it is not among
    them; None for rows that asked for nothing, and None for the whole step when no row
    asked."""
    if tensors is None:
        return None
    top_values, top_ids, sampled_ids, sampled = (t.tolist() for t in tensors)
    out: list[dict[int, float] | None] = [None] * len(num_logprobs)
    rows = [s for s, k in enumerate(num_logprobs) if k is not None]
    for i, (s, token, value) in enumerate(zip(rows, sampled_ids, sampled)):
        k = num_logprobs[s]
        entry = dict(zip(top_ids[i][:k], top_values[i][:k]))
        entry.setdefault(token, value)
        out[s] = entry
    return out
