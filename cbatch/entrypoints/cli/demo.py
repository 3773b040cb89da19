"""``cbatch demo``: static vs continuous batching on the ``seed`` workload, side by side."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from cbatch.entrypoints.cli.engine_args import load_llm
from cbatch.sampling_params import SamplingParams


def _run_workload(llm, wl, label: str) -> dict:
    import statistics

    start = time.perf_counter()
    outs = llm.generate(wl.prompts, wl.params, use_tqdm=True)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    e2e = sorted(o.metrics.e2e for o in outs)
    ttft = sorted(o.metrics.ttft for o in outs)
    print(f"{label}: done in {wall:.1f} s", flush=True)
    return {"label": label, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "e2e_p50": statistics.median(e2e), "e2e_max": e2e[-1],
            "ttft_p50": statistics.median(ttft), "trace": list(llm.occupancy_trace),
            "outputs": [o.token_ids for o in outs]}


def plot_occupancy(results: list[dict], batch_size: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for r in results:
        ax.step(range(len(r["trace"])), r["trace"], where="post",
                label=f"{r['label']} ({len(r['trace'])} steps)")
    ax.axhline(batch_size, color="gray", lw=0.8, ls="--")
    ax.set_xlabel("step")
    ax.set_ylabel("sequences doing useful work")
    ax.set_title("batch occupancy per step: static vs continuous batching")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_demo(args: argparse.Namespace) -> None:
    """The `seed` workload, static batching vs continuous batching, in one run."""
    if not args.scale > 0:
        raise ValueError(f"--scale must be > 0, got {args.scale}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    from cbatch import workloads

    continuous = load_llm(args, max_num_seqs=8, seed=0, threads=args.threads)
    wl = workloads.seed(continuous.tokenizer, scale=args.scale)
    static = load_llm(args, max_num_seqs=wl.batch_size, scheduling_policy="static", seed=0,
                      threads=args.threads)
    print("warming up both engines …", flush=True)
    continuous.generate(wl.prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)
    static.generate(wl.prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)
    static.occupancy_trace.clear()  # the warm-up's steps
    continuous.occupancy_trace.clear()
    n_batches = -(-len(wl.prompts) // wl.batch_size)
    print(f"workload 'seed': {len(wl.prompts)} requests, batch size {wl.batch_size}, "
          f"{wl.num_output_tokens} output tokens")
    print(f"static batching: {n_batches} batch{'es' if n_batches != 1 else ''} of "
          f"{wl.batch_size}, each decoded until its "
          "longest request ends …", flush=True)
    results = [_run_workload(static, wl, "static")]
    print("continuous batching: requests join and leave the batch at every step …", flush=True)
    results.append(_run_workload(continuous, wl, "continuous"))
    same = results[0]["outputs"] == results[1]["outputs"]
    print(f"\n| {'engine':<10} | wall s | tokens/s | e2e p50 s | e2e max s | ttft p50 s | steps |")
    print("|------------|--------|----------|-----------|-----------|------------|-------|")
    for r in results:
        print(f"| {r['label']:<10} | {r['wall_s']:6.2f} | {r['tokens_per_s']:8.1f} | "
              f"{r['e2e_p50']:9.2f} | {r['e2e_max']:9.2f} | {r['ttft_p50']:10.2f} | "
              f"{len(r['trace']):5d} |")
    print(f"\ncontinuous batching is {speed_phrase(results[0]['wall_s'], results[1]['wall_s'])}"
          f"; greedy outputs identical: {same}")
    for r in results:
        trace = r["trace"]
        print(f"{r['label']:>10}: {len(trace)} steps, mean occupancy "
              f"{sum(trace) / len(trace) / wl.batch_size:.0%} of the batch")
    print(f"continuous engine: Python work outside the model "
          f"{continuous.engine.stats().host_overhead:.1%} of step time")
    try:  # the plot is the one part a plain install (no [bench] extra) cannot make
        import matplotlib  # noqa: F401
    except ImportError:
        print("cbatch demo: matplotlib is not installed, so no plot (pip install "
              "'cbatch[bench]', or pip install matplotlib)", file=sys.stderr)
        return
    out = Path(args.plot)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot_occupancy(results, wl.batch_size, out)
    print(f"occupancy plot: {out}")


def add_demo_parser(sub, parents: list[argparse.ArgumentParser]) -> None:
    demo = sub.add_parser("demo", parents=parents,
                          help="static vs continuous batching on the `seed` workload")
    demo.add_argument("--scale", type=float, default=1.0, help="fraction of the 32 requests")
    demo.add_argument("--plot", default="cbatch-demo-occupancy.png",
                      help="where to write the plot of batch occupancy per step")
    demo.add_argument("--threads", type=int, default=None,
                      help="CPU threads per step (default: the cores this process may run "
                           "on, fewer while other processes take them)")
    demo.set_defaults(run=run_demo)


def speed_phrase(static_s: float, continuous_s: float) -> str:
    """How continuous batching compares with static, in words that are true either way."""
    if continuous_s <= static_s:
        return f"{static_s / continuous_s:.2f}x faster"
    return f"{continuous_s / static_s:.2f}x slower"
