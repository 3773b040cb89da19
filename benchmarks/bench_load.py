"""A model's resident memory, unquantized and quantized (a measurement, not a timing).

Each method runs in a process of its own: after ``import cbatch`` its resident set (VmRSS) is
read, then the model is loaded (quantized at load where the method is one), one short greedy
request is served through ``LLM.generate`` (so every lazily built structure exists: packed
weights, caches of the engine are sized by ``--num-blocks``), and the resident set is read
again.  Reported per method: the weights' bytes (parameters, and a quantized layer's packed
integers, scales and zero points), the growth of the resident set, its peak (VmHWM, which
shows what quantizing at load costs on the way), and both against the first method's.

    python benchmarks/model_memory.py --model random:smollm2-360m --dtype bfloat16 \\
        --methods none int8 int4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def _status(field: str) -> int:
    """A field of /proc/self/status in bytes (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(model: str, dtype: str, method: str, num_blocks: int) -> dict:
    """This process: load ``model`` with ``method`` (``none``: unquantized), serve one
    request, and return the sizes in bytes."""
    import torch

    import cbatch
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.bench_decode_step import model_weight_bytes

    before = _status("VmRSS")
    llm = cbatch.LLM(model, dtype=getattr(torch, dtype), num_blocks=num_blocks,
                     quantization=None if method == "none" else method)
    llm.generate([[1, 2, 3, 4]], cbatch.SamplingParams(max_tokens=4, ignore_eos=True))
    return {"method": method, "weight_bytes": model_weight_bytes(llm.engine.model),
            "rss_growth": _status("VmRSS") - before, "peak_rss": _status("VmHWM"),
            "rss_after_import": before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:smollm2-360m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--methods", nargs="+", default=["none", "int8", "int4"])
    parser.add_argument("--num-blocks", type=int, default=64,
                        help="KV-cache blocks (small: the cache is not the model)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process's method
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.model, args.dtype, args.one, args.num_blocks)))
        return
    rows = []
    for method in args.methods:
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--dtype",
                              args.dtype, "--num-blocks", str(args.num_blocks), "--one", method],
                             check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    base = rows[0]
    print(f"{args.model} {args.dtype}; MB, and the ratio to {base['method']}'s")
    print(f"{'method':8s} {'weights':>16s} {'RSS growth':>16s} {'peak RSS':>10s}")
    for r in rows:
        weights, growth = r["weight_bytes"], r["rss_growth"]
        print(f"{r['method']:8s} {weights / 1e6:9.1f} ({weights / base['weight_bytes']:.3f}) "
              f"{growth / 1e6:9.1f} ({growth / base['rss_growth']:.3f}) "
              f"{r['peak_rss'] / 1e6:10.1f}")


if __name__ == "__main__":
    main()
