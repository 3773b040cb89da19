"""Time to first token of long prompts: cbatch beside llama-server on the same model (issue 72).

Cells (``--cells``): one prompt of N tokens (``2048``), or C prompts of N sent at once
(``8x2048``).  Each prompt is seeded random token ids (a new draw for every round, so that
neither engine's prefix cache holds it) and asks for one output token.  Reported per cell and
engine: the TTFT of its requests (p50 and the slowest), the minimum over ``--reps`` rounds, the
engines alternated within a round (cbatch, then llama-server, cell by cell).

cbatch: one engine per ``--max-num-batched-tokens`` value (``2048``, the default, chunks a long
prompt into steps of 2048 tokens; a budget as large as the longest cell runs each prompt in one
step: their ratio is what chunking costs), built and warmed once; a request's TTFT is its
``RequestMetrics.ttft`` (from ``LLM.generate``'s arrival to its first token).  llama-server
(``--llama-server PATH``, ``--model`` a ``.gguf``): started once with 2 threads, ``--parallel``
the widest cell's count, and a context of that many times the longest prompt; each request to
``/completion`` (token ids, ``n_predict`` 1, greedy, ``cache_prompt`` off) timed from its send
to its reply, on a connection of its own.

    python benchmarks/bench_ttft.py --model llama-3.2-1b-Q4_0.gguf --cells 512 2048 8192 8x2048 \\
        --reps 2 --max-num-batched-tokens 2048 8192 --llama-server llama-server --out ttft.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_load import _free_port  # noqa: E402
from benchmarks.peers.bench_llama_cpp import post, wait_ready  # noqa: E402


def id_range(vocab_size: int) -> tuple[int, int]:
    """Prompt ids: ordinary tokens of every real vocabulary measured (no special tokens), or
    a tiny test model's whole vocabulary."""
    return (1000, 30000) if vocab_size > 30000 else (0, vocab_size)


def parse_cell(cell: str) -> tuple[int, int]:
    """``"8x2048"`` -> (8, 2048); ``"512"`` -> (1, 512)."""
    count, _, length = cell.rpartition("x")
    try:
        count, length = int(count or 1), int(length)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a cell is N or CxN (prompts x tokens), got "
                                         f"{cell!r}") from None
    if count < 1 or length < 1:
        raise argparse.ArgumentTypeError(f"a cell's counts are positive, got {cell!r}")
    return count, length


def prompts_for(cell: str, rep: int, vocab_size: int) -> list[list[int]]:
    """The cell's prompts for round ``rep``: seeded, new every round."""
    count, length = parse_cell(cell)
    rng = random.Random(f"{cell}/{rep}")
    low, high = id_range(vocab_size)
    return [[rng.randrange(low, high) for _ in range(length)] for _ in range(count)]


def summary(ttfts: list[float]) -> dict:
    return {"ttft_p50": statistics.median(ttfts), "ttft_max": max(ttfts)}


class Cbatch:
    """cbatch engines on ``args.model``, one per step budget."""

    def __init__(self, args, longest: int, widest: int):
        import torch

        import cbatch

        self.cbatch = cbatch
        kv_tokens = widest * (longest + 16) + 64
        self.engines = {}
        for budget in args.max_num_batched_tokens:
            llm = cbatch.LLM(args.model, dtype=getattr(torch, args.dtype), threads=args.threads,
                             quantization=args.quantization, max_num_seqs=max(widest, 8),
                             max_num_batched_tokens=budget, block_size=16,
                             num_blocks=-(-kv_tokens // 16), max_model_len=args.max_model_len)
            self.vocab_size = llm.engine.model.config.vocab_size
            llm.generate([[id_range(self.vocab_size)[0]] * 16], self.params(),
                         use_tqdm=False)  # warm-up
            self.engines[budget] = llm

    def params(self):
        return self.cbatch.SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)

    def run(self, budget: int, prompts: list[list[int]]) -> dict:
        llm = self.engines[budget]
        llm.engine.block_manager.reset_prefix_cache()
        start = time.perf_counter()
        outs = llm.generate(prompts, self.params(), use_tqdm=False)
        wall = time.perf_counter() - start
        assert all(len(o.token_ids) == 1 for o in outs)
        return {"wall_s": wall, **summary([o.metrics.ttft for o in outs])}


class LlamaServer:
    """llama-server on ``args.model`` (a .gguf), for every cell."""

    def __init__(self, args, longest: int, widest: int):
        self.slots = widest
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port),
             "-t", str(args.threads), "-c", str(widest * (longest + 16)), "--parallel",
             str(widest), "--cache-ram", "0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_ready(self.url, self.proc)
        self.one([1000] * 16)  # warm-up

    def one(self, prompt: list[int]) -> float:
        start = time.perf_counter()
        reply = post(f"{self.url}/completion",
                     {"prompt": prompt, "n_predict": 1, "ignore_eos": True, "temperature": 0.0,
                      "cache_prompt": False, "stream": False})
        elapsed = time.perf_counter() - start
        assert reply.get("tokens_predicted", 1) == 1 and \
            reply.get("tokens_evaluated", len(prompt)) >= len(prompt) - 1, reply
        return elapsed

    def run(self, prompts: list[list[int]]) -> dict:
        start = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            ttfts = list(pool.map(self.one, prompts))
        return {"wall_s": time.perf_counter() - start, **summary(ttfts)}

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def report(rows: list[dict]) -> None:
    """The minimum over rounds of each (cell, engine)'s TTFT p50 and slowest."""
    best: dict[tuple, dict] = {}
    for row in rows:
        key = (row["cell"], row["engine"])
        if key not in best or row["ttft_p50"] < best[key]["ttft_p50"]:
            best[key] = row
    print(f"{'cell':>9} {'engine':<22} {'TTFT p50 s':>10} {'slowest s':>10} {'wall s':>8}")
    for (cell, engine), row in sorted(best.items(), key=lambda kv: (parse_cell(kv[0][0]),
                                                                    kv[0][1])):
        print(f"{cell:>9} {engine:<22} {row['ttft_p50']:>10.3f} {row['ttft_max']:>10.3f} "
              f"{row['wall_s']:>8.2f}")


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a .gguf, a checkpoint directory or random:name")
    ap.add_argument("--cells", nargs="+", default=["512", "2048", "8192", "8x2048"])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, nargs="+", default=[2048])
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="cbatch's context (a model's own is the ceiling)")
    ap.add_argument("--llama-server", default=None, help="llama-server binary (--model a .gguf)")
    ap.add_argument("--out", default=None, help="append each row as a JSON line")
    args = ap.parse_args(argv)
    try:
        shapes = [parse_cell(c) for c in args.cells]
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    longest, widest = max(n for _, n in shapes), max(c for c, _ in shapes)
    if args.llama_server and not args.model.endswith(".gguf"):
        ap.error("--llama-server runs a .gguf: --model must be one")
    engines = [Cbatch(args, longest, widest)]
    server = LlamaServer(args, longest, widest) if args.llama_server else None
    rows = []
    try:
        for rep in range(args.reps):
            for cell in args.cells:
                prompts = prompts_for(cell, rep, engines[0].vocab_size)
                for budget in args.max_num_batched_tokens:
                    rows.append({"engine": f"cbatch (budget {budget})",
                                 **engines[0].run(budget, prompts)} | {"cell": cell, "rep": rep})
                    print(json.dumps({"model": args.model, **rows[-1]}), flush=True)
                if server is not None:
                    rows.append({"engine": "llama-server", **server.run(prompts), "cell": cell,
                                 "rep": rep})
                    print(json.dumps({"model": args.model, **rows[-1]}), flush=True)
    finally:
        if server is not None:
            server.close()
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps({"model": args.model, **row}) + "\n")
    report(rows)
    return rows


if __name__ == "__main__":
    main()
