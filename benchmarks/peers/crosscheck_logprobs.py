"""The same quantized checkpoint through vLLM CPU and through cbatch: do they compute the same
model?  (Issue 50 item 4: a benchmark-side check, not a test.)

Each engine, in its own virtualenv, runs the same token-id prompts and writes a JSON file:
the log-probability of every prompt token given the ones before it (``prompt_logprobs``,
teacher-forced: the logits' comparison, one number per position) and 16 greedy tokens.
``--compare`` reads two such files and prints the largest and mean |difference| of the prompt
log-probabilities and whether the greedy tokens agree.

    /work/peers/vllm/bin/python benchmarks/peers/crosscheck_logprobs.py --engine vllm \\
        --model /work/peers/smollm2-360m-w8a8 --out /tmp/vllm.json
    .venv/bin/python benchmarks/peers/crosscheck_logprobs.py --engine cbatch \\
        --model /work/peers/smollm2-360m-w8a8 --out /tmp/cbatch.json
    python benchmarks/peers/crosscheck_logprobs.py --compare /tmp/vllm.json /tmp/cbatch.json
"""

from __future__ import annotations

import argparse
import json
import random


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def _prompt_logprobs(entries, ids) -> list[float]:
    """The log-probability of each prompt token after the first (engines give None first)."""
    out = []
    for pos, entry in enumerate(entries[1:], start=1):
        lp = entry[ids[pos]]
        out.append(float(getattr(lp, "logprob", lp)))
    return out


def run_vllm(model: str, batch: list[list[int]], dtype: str) -> dict:
    from vllm import LLM, SamplingParams, __version__
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype=dtype, max_model_len=1024, seed=0, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params)
    return {"engine": f"vllm {__version__}",
            "prompt_logprobs": [_prompt_logprobs(o.prompt_logprobs, p)
                                for o, p in zip(outs, batch)],
            "greedy": [list(o.outputs[0].token_ids) for o in outs]}


def run_cbatch(model: str, batch: list[list[int]], dtype: str,
               quantization: str | None = None) -> dict:
    import torch

    import cbatch

    llm = cbatch.LLM(model, dtype=getattr(torch, dtype), quantization=quantization)
    params = cbatch.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                   prompt_logprobs=0)
    outs = llm.generate(batch, params)
    return {"engine": f"cbatch {cbatch.__version__}" + (f" {quantization}" if quantization
                                                         else ""),
            "prompt_logprobs": [_prompt_logprobs(o.prompt_logprobs, p)
                                for o, p in zip(outs, batch)],
            "greedy": [list(o.token_ids) for o in outs]}


def compare(a: dict, b: dict) -> None:
    diffs = [abs(x - y) for pa, pb in zip(a["prompt_logprobs"], b["prompt_logprobs"])
             for x, y in zip(pa, pb)]
    same = sum(ga == gb for ga, gb in zip(a["greedy"], b["greedy"]))
    print(f"{a['engine']} vs {b['engine']}: prompt log-probabilities over {len(diffs)} positions: "
          f"max |diff| {max(diffs):.4f}, mean {sum(diffs) / len(diffs):.5f}; greedy tokens "
          f"identical in {same} of {len(a['greedy'])} requests")
    for ga, gb in zip(a["greedy"], b["greedy"]):
        common = next((i for i, (x, y) in enumerate(zip(ga, gb)) if x != y), len(ga))
        print(f"  first {common} of {len(ga)} greedy tokens agree")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["vllm", "cbatch"])
    ap.add_argument("--model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--quantization", help="cbatch's (e.g. w4a8 on a GPTQ checkpoint)")
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2, metavar="JSON")
    args = ap.parse_args()
    if args.compare:
        a, b = (json.load(open(path)) for path in args.compare)
        return compare(a, b)
    batch = prompts(args.prompts, args.prompt_len, args.vocab)
    if args.engine == "vllm":
        if args.quantization:
            ap.error("--quantization is cbatch's (vLLM reads the checkpoint's own)")
        result = run_vllm(args.model, batch, args.dtype)
    else:
        result = run_cbatch(args.model, batch, args.dtype, args.quantization)
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
