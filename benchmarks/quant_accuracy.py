"""How far online quantization moves a model: int8 / int4 against the same model unquantized
(an accuracy measurement, not a timing).

Two numbers per method, on the same token-id prompts:
- teacher-forced logits: the unquantized model's greedy continuation fed to both models in one
  prefill; per position the largest |logit difference| (and relative to the reference logits'
  standard deviation) and whether the top-1 tokens agree;
- greedy agreement: both engines generate greedily; the share of requests whose tokens are
  identical and the mean length of the common prefix.

A method may also be a dtype (``float32``): the model unquantized in that dtype, against the
same reference, which shows how far the reference's own rounding moves the same numbers.

    python benchmarks/quant_accuracy.py --model random:smollm2-360m --dtype bfloat16 \\
        --methods int8 int4 float32 --prompts 8 --prompt-len 32 --max-tokens 32
"""

from __future__ import annotations

import argparse

import torch

from cbatch import LLM, SamplingParams
from cbatch.core.input_batch import prefill_logits


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, min(vocab, 50000), (length,), generator=gen).tolist()
            for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:smollm2-360m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--methods", nargs="+", default=["int8", "int4"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    base = LLM(args.model, dtype=args.dtype, seed=args.seed, max_num_seqs=args.prompts)
    prompts = _prompts(args.prompts, args.prompt_len, base.engine.model.config.vocab_size,
                       args.seed)
    base_tokens = [o.token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    seqs = [p + t[:-1] for p, t in zip(prompts, base_tokens)]
    base_logits = [x.float() for x in prefill_logits(base.engine.model, seqs)]
    del base
    print(f"{args.model} ({args.dtype}), {args.prompts} prompts of {args.prompt_len} tokens, "
          f"{args.max_tokens} greedy tokens each")
    for method in args.methods:
        quantized = method in ("int8", "int4")
        llm = LLM(args.model, dtype=args.dtype if quantized else method, seed=args.seed,
                  max_num_seqs=args.prompts, quantization=method if quantized else None)
        tokens = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        logits = [x.float() for x in prefill_logits(llm.engine.model, seqs)]
        n = args.prompt_len - 1  # the generated positions (and the last prompt token)
        diffs, rel, top1 = [], [], []
        for ours, ref in zip(logits, base_logits):
            ours, ref = ours[n:], ref[n:]
            d = (ours - ref).abs().amax(dim=-1)
            diffs.append(d)
            rel.append(d / ref.std(dim=-1))
            top1.append(ours.argmax(-1) == ref.argmax(-1))
        diffs, rel, top1 = torch.cat(diffs), torch.cat(rel), torch.cat(top1).float()
        same = sum(a == b for a, b in zip(tokens, base_tokens))
        common = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                  for a, b in zip(tokens, base_tokens)]
        print(f"  {method}: teacher-forced top-1 agreement {top1.mean():.4f} over {len(top1)} "
              f"positions; max |dlogit| mean {diffs.mean():.4f}, max {diffs.max():.4f} "
              f"({rel.mean():.3f} / {rel.max():.3f} of the logits' std); greedy: "
              f"{same}/{len(prompts)} identical, common prefix {sum(common) / len(common):.1f}"
              f" of {args.max_tokens} tokens")
        print(f"    {llm.engine.runner.describe()['quantized linear']}")
        del llm


if __name__ == "__main__":
    main()
