"""One cell run again and again: how far its slowest run is from its fastest, and how many
threads each run's steps took (issue 72: "no run at half speed on a quiet machine").

    python benchmarks/bench_spread.py --model random:tinyllama-1.1b --quantization w4a8 \\
        --workload seed --runs 10 [--temperature 0.8 --top-p 0.95] [--out spread.jsonl]

One engine, built and warmed once (as ``bench_throughput.py`` builds its cbatch engine), then
the workload ``--runs`` times, the prefix cache emptied before each: per run its wall time and
how many of its steps ran on each thread count (``Engine.stats().steps_by_threads``: the
adaptive thread policy's choices, :mod:`cbatch.core.cpu.threads`), the shares of the machine
that other processes and the hypervisor (``steal``) took meanwhile (both from
``/proc/stat``), the host's memory read measured just before it (``read_gb_s``: a sum over
256 MB, ``benchmarks.common.read_bandwidth``), and what the cores compute just before and
just after it (``fma_before`` / ``fma_after``, GFLOP/s: ``bench_peak.py``'s register-only
``vfmadd231ps`` loop on every allowed CPU at once for 0.2 s; no memory, so it moves only with
the cores' own speed: a sibling thread or a vCPU descheduled on the host, which this guest
neither counts as its own processes nor, always, as ``steal``; None without a C compiler).
The last line: the slowest run over the fastest (issue 72's target on a quiet machine: at
most 1.15).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from benchmarks import bench_peak  # noqa: E402
from benchmarks.bench_throughput import make_workload, settle  # noqa: E402
from benchmarks.common import read_bandwidth  # noqa: E402
from cbatch import LLM  # noqa: E402
from cbatch.core.cpu.threads import allowed_cpus, busy_seconds, stat_seconds  # noqa: E402
from cbatch.quantization import ONLINE  # noqa: E402


BATCH = {"seed": 8, "longtail": 64}  # cbatch.workloads' batch sizes


def steal_seconds(cpus: list[int]) -> float | None:
    """The hypervisor's ``steal`` of ``cpus`` since boot, seconds (None where unreadable)."""
    seconds = stat_seconds(cpus)
    return None if seconds is None else seconds["steal"]


def fma_probe(cpus: list[int]):
    """A function measuring the cores' fp32 FMA rate now (GFLOP/s on ``len(cpus)`` threads,
    0.2 s; the loop built once, its library loaded before its directory goes); without a C
    compiler the function returns None."""
    try:
        with tempfile.TemporaryDirectory() as where:
            libs = {"avx2": bench_peak.compile_loops(Path(where), "avx2")}
    except (SystemExit, OSError, subprocess.SubprocessError) as e:  # no compiler, or it failed
        print(f"no FMA probe: {e}", file=sys.stderr)
        return lambda: None
    return lambda: bench_peak.peak(libs, "fma", len(cpus), seconds=0.2) / 1e9


def run_once(llm: LLM, wl, cpus: list[int], probe=lambda: None) -> dict:
    """One timed run of ``wl``: wall seconds, steps by thread count, others' CPU share, the
    memory read (GB/s) measured just before it, and ``probe()`` just before and after."""
    llm.engine.block_manager.reset_prefix_cache()
    # the host's memory read just before: a run's speed follows it where the steps stream
    # their weights (benchmarks/NOTES.md, "The weights' read as a yardstick")
    read_gb_s = read_bandwidth(torch.device("cpu")) / 1e9
    before = dict(llm.engine.stats().steps_by_threads)
    settle()
    fma_before = probe()
    busy0, mine0, steal0 = busy_seconds(cpus), time.process_time(), steal_seconds(cpus)
    start = time.perf_counter()
    llm.generate(wl.prompts, wl.params, use_tqdm=False)
    wall = time.perf_counter() - start
    busy1, mine1, steal1 = busy_seconds(cpus), time.process_time(), steal_seconds(cpus)
    fma_after = probe()
    after = llm.engine.stats().steps_by_threads
    steps = {n: after[n] - before.get(n, 0) for n in sorted(after) if after[n] > before.get(n, 0)}
    others = None if busy0 is None or busy1 is None else \
        max(0.0, (busy1 - busy0) - (mine1 - mine0)) / (wall * len(cpus))
    stolen = None if steal0 is None or steal1 is None else (steal1 - steal0) / (wall * len(cpus))
    return {"wall_s": wall, "steps_by_threads": steps, "others_share": others,
            "steal_share": stolen, "read_gb_s": read_gb_s, "fma_before": fma_before,
            "fma_after": fma_after}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:smollm2-360m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", choices=ONLINE, default=None)
    parser.add_argument("--workload", choices=["seed", "longtail"], default="seed")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", help="append one JSON line per run here")
    args = parser.parse_args(argv)

    batch = BATCH[args.workload]  # the workload's batch, as bench_throughput.py's engine
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, max_num_seqs=batch)
    wl = make_workload(args.workload, llm.tokenizer, llm.engine.model.config.vocab_size, args)
    assert wl.batch_size == batch, (wl.batch_size, batch)
    wl.prompts = [llm.tokenizer.encode(p) if isinstance(p, str) else p for p in wl.prompts]
    llm.generate(wl.prompts[:2], wl.params[:2], use_tqdm=False)  # warm-up
    cpus = allowed_cpus()
    probe = fma_probe(cpus)
    what = (f"{args.model} {args.quantization or args.dtype} {args.workload}"
            + (f" T {args.temperature} top-p {args.top_p}" if args.temperature else " greedy"))
    print(f"{what}: {args.runs} runs on {len(cpus)} CPUs", flush=True)
    rows = []
    for i in range(args.runs):
        row = {"cell": what, "run": i, **run_once(llm, wl, cpus, probe)}
        rows.append(row)
        share = "?" if row["others_share"] is None else f"{100 * row['others_share']:.1f}%"
        stolen = "?" if row["steal_share"] is None else f"{100 * row['steal_share']:.1f}%"
        fma = "?" if row["fma_before"] is None else \
            f"{row['fma_before']:.0f} / {row['fma_after']:.0f}"
        print(f"  run {i}: {row['wall_s']:.2f} s, steps by threads {row['steps_by_threads']}, "
              f"others took {share} of the machine, the hypervisor {stolen}, read "
              f"{row['read_gb_s']:.1f} GB/s before, FMA {fma} GFLOP/s before / after",
              flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    walls = [r["wall_s"] for r in rows]
    print(f"slowest / fastest: {max(walls) / min(walls):.3f} ({max(walls):.2f} / "
          f"{min(walls):.2f} s)")
    return rows


if __name__ == "__main__":
    main()
