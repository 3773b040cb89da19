"""Seconds from `import cbatch` to the first generated token, in this (cold) process.

    python scripts/first_token.py [--device cuda] [--model random:gpt2]

Run it with an empty TRITON_CACHE_DIR for a cold start (scripts/gpu_check.sh firsttoken
does); the time includes importing torch, building the model and the KV cache, and the
compilation of every kernel the first step needs.
"""

import argparse
import time

t0 = time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="random:gpt2")
    args = parser.parse_args()
    import cbatch

    t_import = time.perf_counter()
    llm = cbatch.LLM(args.model, device=args.device)
    t_built = time.perf_counter()
    out = llm.generate(["Hello"], cbatch.SamplingParams(max_tokens=1, ignore_eos=True),
                       use_tqdm=False)[0]
    t_token = time.perf_counter()
    assert len(out.token_ids) == 1
    print(f"import {t_import - t0:.2f} s, LLM built {t_built - t0:.2f} s, "
          f"first token {t_token - t0:.2f} s")


if __name__ == "__main__":
    main()
