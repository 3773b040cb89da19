"""cbatch's `seed` and `longtail(scale=0.125, max_len=256)` as token ids, for peer engines:

    python benchmarks/peers/workloads.py workloads.json [--model random:smollm2-360m]

{"seed": {"prompts": [[ids], ...], "max_tokens": [...], "batch_size": 8}, "longtail": ...}:
the same prompts and output lengths that ``benchmarks/bench_throughput.py --model MODEL
--workload seed`` and ``--workload longtail --scale 0.125 --max-len 256`` run: `seed`'s
text through MODEL's tokenizer (a ``random:`` model's is the byte tokenizer), `longtail`'s
random ids drawn within MODEL's vocabulary (default ``random:gpt2``, GPT-2's).  Run in
cbatch's environment.
"""

import argparse
import json

from cbatch import workloads
from cbatch.models.gpt2 import MODEL_CONFIGS
from cbatch.models.registry import random_llama_configs
from cbatch.tokenizer import load_tokenizer


def vocab_size(model: str) -> int:
    """A ``random:`` model's vocabulary, read from its config (no weights built)."""
    name = model.removeprefix("random:")
    llama = random_llama_configs()
    if name in llama:
        return llama[name][1].vocab_size
    if name in MODEL_CONFIGS:
        return MODEL_CONFIGS[name].vocab_size
    raise SystemExit(f"{model}: not a random: model (known: {sorted(MODEL_CONFIGS)} + "
                     f"{sorted(llama)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the JSON file to write")
    ap.add_argument("--model", default="random:gpt2",
                    help="the random: model bench_throughput.py runs (its tokenizer, vocabulary)")
    args = ap.parse_args()
    if not args.model.startswith("random:"):
        raise SystemExit("--model: a random: name (the peers run its checkpoint, "
                         "make_gpt2_random.py / make_random_checkpoint.py)")
    vocab = vocab_size(args.model)
    tokenizer = load_tokenizer(args.model, None, eos_token_id=vocab - 1)
    out = {}
    for wl in (workloads.seed(tokenizer), workloads.longtail(vocab, 0.125, 256)):
        prompts = [tokenizer.encode(p) if isinstance(p, str) else p for p in wl.prompts]
        out[wl.name] = {"prompts": prompts, "max_tokens": [p.max_tokens for p in wl.params],
                        "batch_size": wl.batch_size}
        print(f"{wl.name}: {len(prompts)} requests, {sum(out[wl.name]['max_tokens'])} "
              f"output tokens, ids < {vocab}")
    with open(args.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
