"""The standard workloads of docs/design.md, shared by the demo and the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cbatch.sampling_params import SamplingParams

SEED_PROMPT = "The quick brown fox jumped over the"


@dataclass
class Workload:
    name: str
    prompts: list  # strings or token-id lists
    params: list[SamplingParams]
    batch_size: int  # the static baseline's batch (and the engine's max_num_seqs)

    @property
    def num_output_tokens(self) -> int:
        return sum(p.max_tokens for p in self.params)


def seed(tokenizer=None, scale: float = 1.0) -> Workload:
    """32 requests of one prompt; every 8th wants 100 tokens, the rest 10; batch size 8."""
    n = max(8, int(32 * scale))
    params = [SamplingParams(max_tokens=100 if i % 8 == 0 else 10, ignore_eos=True)
              for i in range(n)]
    prompt = tokenizer.encode(SEED_PROMPT) if tokenizer is not None else SEED_PROMPT
    return Workload("seed", [prompt] * n, params, batch_size=8)


def _random_prompts(rng: np.random.Generator, lens, vocab: int) -> list[list[int]]:
    return [rng.integers(0, vocab, int(n)).tolist() for n in lens]


def longtail(vocab: int = 50257, scale: float = 1.0, max_len: int = 512) -> Workload:
    """512 requests, prompts uniform in [16, 512], outputs lognormal (median 64) in [8, 512]."""
    rng = np.random.default_rng(0)
    n = max(1, int(512 * scale))
    prompt_lens = rng.integers(16, max_len + 1, n)
    out_lens = np.clip(rng.lognormal(np.log(64), 1.0, n), 8, max_len).astype(int)
    params = [SamplingParams(max_tokens=int(m), ignore_eos=True) for m in out_lens]
    return Workload("longtail", _random_prompts(rng, prompt_lens, vocab), params, batch_size=64)


def uniform(vocab: int = 50257, scale: float = 1.0, max_len: int = 512) -> Workload:
    """256 requests, prompt and output lengths uniform in [100, 512]."""
    rng = np.random.default_rng(0)
    n = max(1, int(256 * scale))
    lo = min(100, max_len)
    prompt_lens = rng.integers(lo, max_len + 1, n)
    out_lens = rng.integers(lo, max_len + 1, n)
    params = [SamplingParams(max_tokens=int(m), ignore_eos=True) for m in out_lens]
    return Workload("uniform", _random_prompts(rng, prompt_lens, vocab), params, batch_size=64)


def sharedprefix(vocab: int = 50257, scale: float = 1.0, max_len: int = 512) -> Workload:
    """256 requests = 8 system prompts of 400 tokens x 32 questions of 20-60 tokens, 64 output
    tokens each, in shuffled order (prefix caching).  ``scale`` scales the number of system
    prompts (each keeps its 32 questions, so the share of cached tokens stays that of the full
    run); ``max_len`` caps the system prompt, question and output lengths."""
    rng = np.random.default_rng(0)
    num_systems, per_system = max(1, round(8 * scale)), 32
    systems = _random_prompts(rng, [min(400, max_len)] * num_systems, vocab)
    question_lens = rng.integers(min(20, max_len), min(60, max_len) + 1,
                                 num_systems * per_system)
    questions = _random_prompts(rng, question_lens, vocab)
    prompts = [systems[i // per_system] + q for i, q in enumerate(questions)]
    order = rng.permutation(len(prompts))
    params = SamplingParams(max_tokens=min(64, max_len), ignore_eos=True)
    return Workload("sharedprefix", [prompts[i] for i in order], [params] * len(prompts),
                    batch_size=64)


def repeat(vocab: int = 50257, scale: float = 1.0, max_len: int = 512) -> Workload:
    """64 requests whose prompts repeat a passage (a random passage of 16 to 64 tokens, 2 to
    4 times: a document quoted again, what prompt lookup finds), 128 output tokens each,
    greedy, ignore_eos; batch size 8 (speculative decoding's n-gram workload).  Random-weight
    models' greedy outputs also fall into loops, which the lookup over the output catches.
    ``max_len`` caps the prompt and output lengths."""
    rng = np.random.default_rng(0)
    n = max(1, int(64 * scale))
    passages = _random_prompts(rng, rng.integers(16, 65, n), vocab)
    reps = rng.integers(2, 5, n)
    prompts = [(p * int(r))[:max_len] for p, r in zip(passages, reps)]
    params = SamplingParams(max_tokens=min(128, max_len), ignore_eos=True)
    return Workload("repeat", prompts, [params] * n, batch_size=8)
