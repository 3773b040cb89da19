"""The ``cbatch`` command line."""

from __future__ import annotations

import argparse
import time

import torch

from cbatch.models.gpt2 import load_model
from cbatch.tokenizer import ByteTokenizer

DEMO_PROMPTS = [
    "The quick brown fox jumped over the",
    "Hello",
    "Continuous batching schedules every iteration: requests join and leave the running "
    "batch as soon as they arrive or finish, so no slot idles while the longest one ends.",
    "Paged attention",
    "GPT-2 is a decoder-only transformer trained on WebText.",
]


def cmd_demo(args: argparse.Namespace) -> None:
    """Greedy generation of prompts of different lengths through the paged KV cache."""
    torch.set_num_threads(args.threads or torch.get_num_threads())
    print(f"loading {args.model} ({args.dtype}) on {args.device} …", flush=True)
    model = load_model(args.model, device=args.device, dtype=getattr(torch, args.dtype))
    tokenizer = ByteTokenizer(model.config.eos_token_id)
    prompts = [tokenizer.encode(p) for p in DEMO_PROMPTS]
    model.generate(prompts[:1], max_new_tokens=2)  # warm-up
    start = time.perf_counter()
    outputs = model.generate(prompts, max_new_tokens=args.max_tokens)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outputs):
        print(f"  [{len(prompt):3d} prompt tokens] -> {len(out)} new: {out[:8]} …")
    total = sum(map(len, outputs))
    print(f"{len(prompts)} prompts, {total} tokens in {elapsed:.2f} s: "
          f"{total / elapsed:.1f} tokens/s (paged KV cache, packed prefill, batched decode)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="cbatch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="generate several prompts with random:gpt2 on the CPU")
    demo.add_argument("--model", default="random:gpt2")
    demo.add_argument("--device", default="cpu")
    demo.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.add_argument("--threads", type=int, default=None)
    demo.set_defaults(func=cmd_demo)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
