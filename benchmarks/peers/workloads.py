"""cbatch's `seed` and `longtail(scale=0.125, max_len=256)` as token ids, for peer engines:

    python benchmarks/peers/workloads.py workloads.json     # in cbatch's environment

{"seed": {"prompts": [[ids], ...], "max_tokens": [...], "batch_size": 8}, "longtail": ...}:
the same prompts (``random:gpt2``'s tokenizer for `seed`'s text) and output lengths that
``benchmarks/bench_throughput.py --workload seed`` and ``--workload longtail --scale 0.125
--max-len 256`` run.
"""

import json
import sys

from cbatch import LLM, workloads


def main(path: str) -> None:
    tokenizer = LLM("random:gpt2").tokenizer
    out = {}
    for wl in (workloads.seed(tokenizer), workloads.longtail(scale=0.125, max_len=256)):
        prompts = [tokenizer.encode(p) if isinstance(p, str) else p for p in wl.prompts]
        out[wl.name] = {"prompts": prompts, "max_tokens": [p.max_tokens for p in wl.params],
                        "batch_size": wl.batch_size}
        print(f"{wl.name}: {len(prompts)} requests, {sum(out[wl.name]['max_tokens'])} "
              "output tokens")
    with open(path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1])
