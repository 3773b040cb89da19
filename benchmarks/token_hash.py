"""A hash of every token a standard workload generates, to show that a change of code left the
outputs alone (greedy, so the tokens are a function of the code and the weights alone).

    python benchmarks/token_hash.py                          # seed and longtail x 1/16, fp32, bf16
    python benchmarks/token_hash.py --workload seed --dtype float32

Prints one line per cell: workload, scale, dtype, requests, tokens, sha256 of the token ids.
Run it before and after a change on the same machine: the lines must be equal.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cbatch import LLM, workloads  # noqa: E402


def token_hash(model: str, workload: str, scale: float, dtype: str, device: str) -> dict:
    """The sha256 of the token ids of ``workload`` at ``scale`` with continuous batching."""
    if workload == "seed":
        wl = workloads.seed(scale=scale)
    else:
        wl = getattr(workloads, workload)(scale=scale)
    llm = LLM(model, dtype=dtype, device=device, max_num_seqs=wl.batch_size)
    outs = llm.generate(wl.prompts, wl.params, use_tqdm=False)
    ids = [o.token_ids for o in outs]
    digest = hashlib.sha256(json.dumps(ids).encode()).hexdigest()
    return {"workload": workload, "scale": scale, "dtype": dtype, "requests": len(ids),
            "tokens": sum(map(len, ids)), "sha256": digest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--workload", choices=("seed", "longtail", "uniform", "sharedprefix"),
                        action="append", help="default: seed and longtail")
    parser.add_argument("--scale", type=float, default=None,
                        help="default: 1 for seed, 1/16 for the others")
    parser.add_argument("--dtype", action="append", help="default: float32 and bfloat16")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    for workload in args.workload or ["seed", "longtail"]:
        scale = args.scale if args.scale is not None else (1.0 if workload == "seed" else 1 / 16)
        for dtype in args.dtype or ["float32", "bfloat16"]:
            row = token_hash(args.model, workload, scale, dtype, args.device)
            print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
