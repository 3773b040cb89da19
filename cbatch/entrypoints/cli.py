"""The ``cbatch`` command line: ``cbatch demo`` and ``cbatch generate``."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from cbatch import workloads
from cbatch.entrypoints.llm import LLM
from cbatch.sampling_params import SamplingParams


def _run(llm: LLM, wl: workloads.Workload, label: str) -> dict:
    start = time.perf_counter()
    outs = llm.generate(wl.prompts, wl.params, use_tqdm=True)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    e2e = sorted(o.metrics.e2e for o in outs)
    ttft = sorted(o.metrics.ttft for o in outs)
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


def cmd_demo(args: argparse.Namespace) -> None:
    """The `seed` workload, static batching vs continuous batching, in one run."""
    if args.threads:
        torch.set_num_threads(args.threads)
    kw = dict(device=args.device, dtype=args.dtype, seed=0)
    print(f"loading {args.model} on {args.device} ({args.dtype}) …", flush=True)
    continuous = LLM(args.model, max_num_seqs=8, **kw)
    wl = workloads.seed(continuous.tokenizer, scale=args.scale)
    static = LLM(args.model, max_num_seqs=wl.batch_size, scheduling_policy="static", **kw)
    continuous.generate(wl.prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    static.generate(wl.prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)
    static.occupancy_trace.clear()
    continuous.occupancy_trace.clear()
    print(f"workload 'seed': {len(wl.prompts)} requests, batch size {wl.batch_size}, "
          f"{wl.num_output_tokens} output tokens")
    results = [_run(static, wl, "static"), _run(continuous, wl, "continuous")]
    same = results[0]["outputs"] == results[1]["outputs"]
    print(f"\n| {'engine':<10} | wall s | tokens/s | e2e p50 s | e2e max s | ttft p50 s | steps |")
    print("|------------|--------|----------|-----------|-----------|------------|-------|")
    for r in results:
        print(f"| {r['label']:<10} | {r['wall_s']:6.2f} | {r['tokens_per_s']:8.1f} | "
              f"{r['e2e_p50']:9.2f} | {r['e2e_max']:9.2f} | {r['ttft_p50']:10.2f} | "
              f"{len(r['trace']):5d} |")
    speedup = results[0]["wall_s"] / results[1]["wall_s"]
    print(f"\ncontinuous batching is {speedup:.2f}x faster; greedy outputs identical: {same}")
    for r in results:
        trace = r["trace"]
        print(f"{r['label']:>10}: {len(trace)} steps, mean occupancy "
              f"{sum(trace) / len(trace) / wl.batch_size:.0%} of the batch")
    print(f"continuous engine: Python work outside the model "
          f"{continuous.engine.stats().host_overhead:.1%} of step time")
    out = Path(args.plot)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot_occupancy(results, wl.batch_size, out)
    print(f"occupancy plot: {out}")


def cmd_generate(args: argparse.Namespace) -> None:
    llm = LLM(args.model, device=args.device, dtype=args.dtype)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    for prompt, out in zip(args.prompt, llm.generate(args.prompt, params)):
        print(f"--- {prompt!r} ({out.finish_reason}, {len(out.token_ids)} tokens, "
              f"ttft {out.metrics.ttft * 1e3:.0f} ms)\n{prompt}{out.text}")


def add_serve_command(sub, common: argparse.ArgumentParser) -> None:
    """`cbatch serve`: the OpenAI-compatible server (imported only when it runs)."""
    from cbatch.entrypoints.openai.api_server import add_server_args

    def cmd_serve(args: argparse.Namespace) -> None:
        from cbatch.entrypoints.openai.api_server import run_server

        run_server(args)

    serve = sub.add_parser("serve", parents=[common], help="serve the OpenAI API over HTTP")
    add_server_args(serve)
    serve.set_defaults(func=cmd_serve)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="cbatch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default="random:gpt2",
                        help="random:<size>, a local HF checkpoint dir, or a hub id")
    common.add_argument("--device", default="cpu")
    common.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])

    demo = sub.add_parser("demo", parents=[common],
                          help="static vs continuous batching on the `seed` workload")
    demo.add_argument("--scale", type=float, default=1.0, help="fraction of the 32 requests")
    demo.add_argument("--plot", default="cbatch-demo-occupancy.png")
    demo.add_argument("--threads", type=int, default=None)
    demo.set_defaults(func=cmd_demo)

    gen = sub.add_parser("generate", parents=[common], help="generate for prompts")
    gen.add_argument("--prompt", action="append", required=True)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.set_defaults(func=cmd_generate)
    add_serve_command(sub, common)

    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
