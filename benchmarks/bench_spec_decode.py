"""Speculative decoding's decode speed (issue 40, item 5): the same greedy requests of the
`repeat` workload (cbatch.workloads: prompts that repeat a passage) through one engine per
method, at batch 1 and batch 8, in rounds (A B A B ...; tokens/s: the median round; the ratio to
plain: the median of each round's ratio to plain's in that round).

Methods, k = --k drafts per step:
  plain             no speculation (the baseline every other row is divided by)
  replay            the verifier's ceiling: drafts replayed from plain's recorded greedy
                    outputs (ReplayProposer: free to draft, always right), so the row
                    measures what the verification path gives away and nothing else
  ngram             speculative_config {"method": "ngram"} (prompt lookup, min 2, max 4),
                    with the adaptive draft length (its default)
  never             drafts that never agree (RandomProposer: uniform random tokens), with
                    the adaptive draft length off: the full cost of wasted verification
  never-adaptive    the same drafts with the adaptive draft length on
  draft             speculative_config {"method": "draft_model", "model": --draft-model}
                    (default random:distilgpt2: random weights, so its drafts do not agree
                    with random:gpt2's), adaptive off: wasted verification and drafting
  draft-adaptive    the same draft model with the adaptive draft length on (issue 40's
                    target: within 5% of plain)

The benchmark-only proposers enter through the engine's documented hook: an engine built with a
speculative_config gets its ``Engine.spec_decoder.proposer`` replaced by any
:class:`cbatch.core.spec_decode.proposer.Proposer` (here with ``propose(token_ids) ->
list[int]``: up to k drafts to follow a request's prompt + output; the engine keeps as many as
the adaptive rule grants).  The engines live through every round, so the adaptive rule's
engine-wide prior (spec_decode.adaptive.AdaptiveDraftLength) is learnt in the first:
``vs_plain_first_round`` reports that round alone.

Each row: decode tokens/s (output tokens after every request has its first token, over the
time they took), its ratio to plain's at that batch, the acceptance rate and mean accepted
length (Engine.stats()), the verifications (a request verifying drafts in a step), drafting
and verifying seconds, and the share of requests whose tokens equal plain's (greedy: every
method must give 1.0).  Results in spec_decode.*.

    python benchmarks/bench_spec_decode.py --dtype bfloat16
    python benchmarks/bench_spec_decode.py --quick            # random:tiny: the harness only
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (base_parser, environment, publish, pyplot,  # noqa: E402
                               save_figure)
from cbatch import Engine, SamplingParams, workloads  # noqa: E402
from cbatch.core.spec_decode.proposer import Proposer  # noqa: E402
from cbatch.core.stats import EngineStats  # noqa: E402

COLUMNS = ["method", "batch", "k", "adaptive", "decode_tok_per_s", "vs_plain",
           "vs_plain_first_round",
           "acceptance_rate", "mean_accepted_length", "drafts", "draft_s", "verify_s",
           "outputs_equal_plain", "rounds"]
SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                 "spec_decode_num_accepted_tokens", "spec_decode_draft_s",
                 "spec_decode_verify_s")
METHODS = ["plain", "replay", "ngram", "never", "never-adaptive", "draft", "draft-adaptive"]


class ReplayProposer(Proposer):
    """Drafts replayed from recorded greedy runs: for a request whose prompt is one of
    ``recorded``'s, the next up to ``k`` tokens of that recording after the request's own
    (free to draft and, while the engine's greedy tokens equal the recording's, always
    right).  ``recorded``: (prompt ids, output ids) pairs."""

    def __init__(self, recorded: list[tuple[list[int], list[int]]], k: int):
        self.k = k
        self.full: dict[int, dict[tuple, list[int]]] = {}  # prompt length -> prompt -> ids
        for prompt, output in recorded:
            known = self.full.setdefault(len(prompt), {}).get(tuple(prompt), [])
            if len(prompt) + len(output) > len(known):  # the longest recording of a prompt
                self.full[len(prompt)][tuple(prompt)] = list(prompt) + list(output)

    def propose(self, token_ids: list[int]) -> list[int]:
        n = len(token_ids)
        for length, by_prompt in self.full.items():
            full = by_prompt.get(tuple(token_ids[:length])) if n > length else None
            if full is not None:
                return full[n:n + self.k]
        return []


class RandomProposer(Proposer):
    """``k`` uniform random tokens of a ``vocab``-token vocabulary: drafts that (but by
    chance) never agree with the target."""

    def __init__(self, vocab: int, k: int, seed: int = 0):
        self.vocab, self.k = vocab, k
        self.rng = np.random.default_rng(seed)

    def propose(self, token_ids: list[int]) -> list[int]:
        return self.rng.integers(0, self.vocab, self.k).tolist()


def decode_run(engine: Engine, prompts: list[list[int]], params) -> tuple[float, int, list]:
    """Run ``prompts`` to the end, all submitted at once; returns (seconds after every
    request had its first token, output tokens in them, each request's output ids)."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    outputs: dict[str, list[int]] = {}
    start, tokens_at_start = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
        if start is None and len(outputs) == len(ids):  # every request has its first token
            start, tokens_at_start = time.perf_counter(), sum(map(len, outputs.values()))
    elapsed = time.perf_counter() - start
    return elapsed, sum(map(len, outputs.values())) - tokens_at_start, \
        [outputs[i] for i in ids]


def build_engines(args, vocab: int, num_blocks: int) -> dict[str, Engine]:
    """One engine per method, the same weights (seed 0) and KV pool."""
    common = dict(dtype=args.dtype, max_num_seqs=max(args.batch_sizes), num_blocks=num_blocks,
                  seed=0)
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2,
             "prompt_lookup_max": 4}
    draft = {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": args.k}
    spec = {"plain": None, "replay": ngram, "ngram": ngram,
            "never": {**ngram, "adaptive": False}, "never-adaptive": ngram,
            "draft": {**draft, "adaptive": False}, "draft-adaptive": draft}
    engines = {m: Engine(args.model, speculative_config=spec[m], **common) for m in METHODS}
    engines["never"].spec_decoder.proposer = RandomProposer(vocab, args.k, seed=1)
    engines["never-adaptive"].spec_decoder.proposer = RandomProposer(vocab, args.k, seed=1)
    return engines


def since(before: EngineStats, after: EngineStats) -> EngineStats:
    """``after`` with its spec_decode counters counted from ``before`` (one round's)."""
    return dataclasses.replace(after, **{name: getattr(after, name) - getattr(before, name)
                                         for name in SPEC_COUNTERS})


def measure(args, engines: dict[str, Engine], batch: int, wl) -> list[dict]:
    prompts, params = wl.prompts[:batch], wl.params[:batch]
    timings: dict[str, list[float]] = {m: [] for m in METHODS}
    stats, equal = {}, {}
    plain_out = None
    for _ in range(args.reps):
        for method in METHODS:  # A B C ... A B C ...
            engine = engines[method]
            before = engine.stats()
            if method == "replay":
                engine.spec_decoder.proposer = ReplayProposer(list(zip(prompts, plain_out)),
                                                              args.k)
            seconds, tokens, out = decode_run(engine, prompts, params)
            if method == "plain":
                plain_out = out
            timings[method].append(tokens / seconds)
            stats[method] = since(before, engine.stats())
            equal[method] = sum(a == b for a, b in zip(out, plain_out)) / len(out)
    rows = []
    first = timings["plain"][0]
    for method in METHODS:
        st, tps = stats[method], statistics.median(timings[method])
        # each round against plain's of the same round (this host's speed drifts by 10%
        # over minutes): the median of those ratios
        ratio = statistics.median(t / p for t, p in zip(timings[method], timings["plain"]))
        spec = engines[method].config.speculative_config
        rows.append({"method": method, "batch": batch, "k": 0 if spec is None else args.k,
                     "adaptive": None if spec is None else spec.adaptive,
                     "decode_tok_per_s": tps, "vs_plain": ratio,
                     "vs_plain_first_round": timings[method][0] / first,
                     "acceptance_rate": st.spec_decode_acceptance_rate,
                     "mean_accepted_length": st.spec_decode_mean_accepted_length,
                     "drafts": st.spec_decode_num_drafts, "draft_s": st.spec_decode_draft_s,
                     "verify_s": st.spec_decode_verify_s,
                     "outputs_equal_plain": equal[method], "rounds": args.reps})
        print(f"batch {batch:2d} {method:15s} {tps:8.1f} tok/s  x{ratio:.2f}  "
              f"acceptance {st.spec_decode_acceptance_rate:.2f}  "
              f"equal {equal[method]:.2f}  rounds "
              f"{' '.join(f'{t / p:.2f}' for t, p in zip(timings[method], timings['plain']))}",
              flush=True)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    batches = sorted({r["batch"] for r in rows})
    width = 0.8 / len(METHODS)
    for j, method in enumerate(METHODS):
        values = [next(r["vs_plain"] for r in rows if r["batch"] == b and r["method"] == method)
                  for b in batches]
        ax.bar([i + j * width for i in range(len(batches))], values, width, label=method)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(batches))])
    ax.set_xticklabels([f"batch {b}" for b in batches])
    ax.set_ylabel("decode tokens/s vs plain")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> Path:
    parser = base_parser(__doc__)
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--draft-model", default="random:distilgpt2",
                        help="the draft_model rows' draft")
    parser.add_argument("--batch-sizes", type=lambda s: [int(b) for b in s.split(",")],
                        default=[1, 8])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-prompt-len", type=int, default=256,
                        help="the repeat workload's prompts cut to this length")
    parser.set_defaults(reps=5)
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.dtype, args.output_len, args.reps = "random:tiny", "float32", 24, 1
        args.draft_model = "random:tiny"
        args.batch_sizes, args.max_prompt_len = [1, 4], 96
    device = torch.device(args.device)
    vocab = 512 if args.model == "random:tiny" else 50257
    wl = workloads.repeat(vocab, scale=max(args.batch_sizes) / 64, max_len=args.max_prompt_len)
    wl.params = [SamplingParams(max_tokens=args.output_len, ignore_eos=True)] * len(wl.prompts)
    longest = max(map(len, wl.prompts)) + args.output_len + args.k + 1
    num_blocks = max(args.batch_sizes) * (-(-longest // 16) + 1) + 16
    engines = build_engines(args, vocab, num_blocks)
    rows = [row for batch in args.batch_sizes for row in measure(args, engines, batch, wl)]
    meta = {**environment(device), "model": args.model, "dtype": args.dtype, "k": args.k,
            "workload": "repeat", "max_prompt_len": args.max_prompt_len,
            "output_len": args.output_len, "rounds": args.reps}
    return publish("spec_decode", device, rows, meta, COLUMNS, args.out, plot)


if __name__ == "__main__":
    main()
