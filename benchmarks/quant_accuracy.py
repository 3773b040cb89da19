"""How far a quantized model moves from the same model unquantized (an accuracy measurement,
not a timing): cbatch's online methods and GGUF files of the same weights, against a float
reference, on the same token-id prompts.

Per method, as llama.cpp's ``llama-perplexity --kl-divergence`` reports them:
- teacher-forced: the reference's greedy continuation fed to both models in one prefill; per
  position the KL divergence of the next-token distributions, KL(p_ref || p_method) (mean,
  99th percentile, max), the share of positions whose top-1 tokens agree, and the largest
  |logit difference| relative to the reference logits' standard deviation;
- greedy: both generate greedily; the share of prompts whose tokens are identical and the
  mean length of the common prefix.

A method is an online quantization (``int8``, ``int4``, ``w8a8``, ``w4a8``), a dtype
(``float32``: the reference's own rounding, for scale), or ``gguf:<file>`` (a GGUF file of the
same weights as cbatch runs it by default: every layer with int8 activations per group;
``gguf:<file>@gguf``: every layer with float activations).  ``random:<shape>-outliers``
models (cbatch/models/registry.py) carry a few residual channels at 20-50x, as real models do.

    python benchmarks/quant_accuracy.py --model random:smollm2-360m-outliers \\
        --methods int4 w4a8 int8 w8a8 gguf:/work/peers/gguf-models/x-Q4_K_M.gguf \\
        --out acc.jsonl
"""

from __future__ import annotations

import argparse
import json

import torch

from cbatch import LLM, SamplingParams
from cbatch.core.input_batch import prefill_logits

METRICS = ("kl_mean", "kl_p99", "kl_max", "top1", "rel_dlogit_mean", "greedy_identical",
           "common_prefix")


def prompts_of(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, min(vocab, 50000), (length,), generator=gen).tolist()
            for _ in range(n)]


def compare(ref: list[torch.Tensor], ours: list[torch.Tensor], start: int) -> dict[str, float]:
    """The teacher-forced metrics of logits ``ours`` against ``ref`` (each ``[T, V]`` per
    prompt; positions from ``start`` on)."""
    ref = torch.cat([r[start:] for r in ref]).double()
    ours = torch.cat([o[start:] for o in ours]).double()
    log_p, log_q = ref.log_softmax(-1), ours.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    rel = (ours - ref).abs().amax(-1) / ref.std(-1)
    return {"kl_mean": kl.mean().item(), "kl_p99": kl.quantile(0.99).item(),
            "kl_max": kl.max().item(), "top1": (ours.argmax(-1) == ref.argmax(-1)).double()
            .mean().item(), "rel_dlogit_mean": rel.mean().item(), "positions": len(kl)}


def load(method: str, args) -> LLM:
    kwargs = dict(seed=args.seed, max_num_seqs=args.prompts)
    if method.startswith("gguf:"):
        path, _, kernel = method.removeprefix("gguf:").partition("@")
        return LLM(path, dtype=args.dtype, quantization=kernel or None, **kwargs)
    if method in ("float32", "bfloat16", "float16"):
        return LLM(args.model, dtype=method, **kwargs)
    return LLM(args.model, dtype=args.dtype, quantization=method, **kwargs)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:smollm2-360m-outliers")
    parser.add_argument("--dtype", default="bfloat16", help="the reference's and the methods'")
    parser.add_argument("--methods", nargs="+", default=["int8", "int4", "w8a8", "w4a8"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write one JSON line per method here")
    args = parser.parse_args(argv)

    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    base = LLM(args.model, dtype=args.dtype, seed=args.seed, max_num_seqs=args.prompts)
    prompts = prompts_of(args.prompts, args.prompt_len, base.engine.model.config.vocab_size,
                         args.seed)
    base_tokens = [o.token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    seqs = [p + t[:-1] for p, t in zip(prompts, base_tokens)]
    base_logits = [x.float() for x in prefill_logits(base.engine.model, seqs)]
    del base
    print(f"{args.model} ({args.dtype} reference), {args.prompts} prompts of "
          f"{args.prompt_len} tokens, {args.max_tokens} greedy tokens each")
    rows = []
    for method in args.methods:
        llm = load(method, args)
        tokens = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        logits = [x.float() for x in prefill_logits(llm.engine.model, seqs)]
        row = {"model": args.model, "dtype": args.dtype, "method": method,
               **compare(base_logits, logits, args.prompt_len - 1),
               "greedy_identical": sum(a == b for a, b in zip(tokens, base_tokens)) / len(
                   prompts),
               "common_prefix": sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                                         len(a)) for a, b in zip(tokens, base_tokens))
               / len(prompts),
               "layers": llm.engine.runner.describe().get("quantized linear", "")}
        rows.append(row)
        if args.out:  # as each is measured: a method that fails later loses nothing
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        print(f"  {method}: KL mean {row['kl_mean']:.5f}, p99 {row['kl_p99']:.4f}, max "
              f"{row['kl_max']:.4f}; top-1 {row['top1']:.4f} over {row['positions']} "
              f"positions; |dlogit| {row['rel_dlogit_mean']:.3f} of the logits' std; greedy "
              f"{row['greedy_identical']:.2f} identical, common prefix "
              f"{row['common_prefix']:.1f} of {args.max_tokens}\n    {row['layers']}")
        del llm
    return rows


if __name__ == "__main__":
    main()
