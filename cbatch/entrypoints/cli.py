"""The ``cbatch`` command line: ``cbatch demo`` and ``cbatch generate``.

One subparser per command (``add_<command>_parser``) and one ``run_<command>`` function that
it calls.  Parsing imports neither torch nor the engine, so ``cbatch --help`` and argument
errors answer at once; each ``run_*`` imports what it needs.  Errors are one line,
``cbatch: error: <message>`` (exit 2); ``--debug`` or ``CBATCH_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

from cbatch.core.scheduler import POLICIES  # plain Python: no torch
from cbatch.entrypoints.openai.cli_args import add_server_args  # argparse only
from cbatch.sampling_params import SamplingParams


def load_llm(args: argparse.Namespace, **kwargs):
    """The ``LLM`` for the shared model flags; device None = CUDA when present, dtype None =
    float16 on CUDA, float32 on the CPU."""
    import torch

    from cbatch.config import check_device
    from cbatch.entrypoints.llm import LLM

    device = check_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = args.dtype or ("float16" if device.startswith("cuda") else "float32")
    print(f"loading {args.model} on {device} ({dtype}) …", file=sys.stderr, flush=True)
    return LLM(args.model, device=device, dtype=dtype, tokenizer=args.tokenizer, **kwargs)


# ------------------------------------------------------------------------ demo

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
    import torch

    from cbatch import workloads

    if args.threads:
        torch.set_num_threads(args.threads)
    continuous = load_llm(args, max_num_seqs=8, seed=0)
    wl = workloads.seed(continuous.tokenizer, scale=args.scale)
    static = load_llm(args, max_num_seqs=wl.batch_size, scheduling_policy="static", seed=0)
    print("warming up both engines …", flush=True)
    continuous.generate(wl.prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)
    static.generate(wl.prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)
    static.occupancy_trace.clear()
    continuous.occupancy_trace.clear()
    n_batches = -(-len(wl.prompts) // wl.batch_size)
    print(f"workload 'seed': {len(wl.prompts)} requests, batch size {wl.batch_size}, "
          f"{wl.num_output_tokens} output tokens")
    print(f"static batching: {n_batches} batches of {wl.batch_size}, each decoded until its "
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


def add_demo_parser(sub, parents: list[argparse.ArgumentParser]) -> None:
    demo = sub.add_parser("demo", parents=parents,
                          help="static vs continuous batching on the `seed` workload")
    demo.add_argument("--scale", type=float, default=1.0, help="fraction of the 32 requests")
    demo.add_argument("--plot", default="cbatch-demo-occupancy.png")
    demo.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    demo.set_defaults(run=run_demo)


# -------------------------------------------------------------------- generate

def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The ``generate`` flags as SamplingParams (validated there, before any model loads)."""
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          stop_token_ids=args.stop_token_id, ignore_eos=args.ignore_eos,
                          stop=args.stop)


def _summary(out) -> str:
    m = out.metrics
    rate = f", {len(out.token_ids) / m.e2e:.1f} tokens/s" if m.e2e else ""
    return (f"({out.finish_reason}, {len(out.token_ids)} tokens, ttft {m.ttft * 1e3:.0f} ms"
            f"{rate})")


def stream(llm, prompt: str, params: SamplingParams):
    """Run one request, writing its text to stdout as it grows (the engine's incremental
    detokenizer holds back a character until its last byte); returns the final output."""
    sys.stdout.write(prompt)
    sys.stdout.flush()
    printed = [0]

    def write(out) -> None:
        text = out.text
        sys.stdout.write(text[printed[0]:])
        sys.stdout.flush()
        printed[0] = len(text)

    (final,) = llm.engine.generate([prompt], params, on_output=write)
    sys.stdout.write("\n")
    return final


def run_generate(args: argparse.Namespace) -> None:
    params = sampling_params(args)
    llm = load_llm(args, scheduling_policy=args.policy)
    if len(args.prompt) == 1:
        out = stream(llm, args.prompt[0], params)
        print(_summary(out), file=sys.stderr)
        return
    outs = llm.generate(args.prompt, params, use_tqdm=len(args.prompt) > 1)
    for prompt, out in zip(args.prompt, outs):
        print(f"--- {prompt!r} {_summary(out)}\n{prompt}{out.text}")


def add_generate_parser(sub, parents: list[argparse.ArgumentParser]) -> None:
    gen = sub.add_parser("generate", parents=parents, help="generate for prompts",
                         description="Generate for each --prompt.  One prompt streams its "
                         "text as it is generated; several run as one batch.")
    gen.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--policy", default="fcfs", choices=POLICIES + ("static",),
                     help="scheduling policy (static: the static-batching baseline)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="stop before this text (repeatable)")
    gen.add_argument("--stop-token-id", action="append", type=int, default=[], metavar="ID",
                     help="stop after this token (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="keep going past the end-of-sequence token")
    gen.set_defaults(run=run_generate)


# ------------------------------------------------------------------------ serve

def run_serve(args: argparse.Namespace) -> None:
    import torch

    from cbatch.config import check_device
    from cbatch.entrypoints.openai.api_server import run_server

    args.device = check_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.dtype = args.dtype or ("float16" if args.device.startswith("cuda") else "float32")
    run_server(args)


def add_serve_parser(sub, parents: list[argparse.ArgumentParser]) -> None:
    """`cbatch serve`: the OpenAI-compatible server (its packages load only when it runs)."""
    parser = sub.add_parser("serve", parents=parents, help="serve the OpenAI API over HTTP")

    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients use (default: --model)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority", "sjf"])
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-waiting", type=int, default=1024,
                        help="requests waiting beyond this are refused with 503")
    parser.add_argument("--shutdown-timeout", type=float, default=5.0,
                        help="seconds running requests get to finish at shutdown (SIGTERM, "
                             "Ctrl-C); a second signal exits at once")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="a request's output never depends on what it is batched with")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="recompute every prompt from its first token")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="run decode steps op by op (debugging; graphs are on for CUDA)")
    parser.add_argument("--no-async-scheduling", action="store_true",
                        help="read each step's tokens before scheduling the next (debugging; "
                             "async is on for CUDA)")
    parser.add_argument("--num-replicas", type=int, default=1,
                        help="> 1: that many engines behind one route with Ray Serve")
    add_server_args(parser)  # limits, timeouts, authentication
    parser.set_defaults(run=run_serve)


# ------------------------------------------------------------------------ main

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cbatch", description="Continuous-batching inference for GPT-2-family models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    model = argparse.ArgumentParser(add_help=False)
    model.add_argument("--model", default="random:gpt2",
                       help="random:<size>, a local HF checkpoint dir, or a hub id")
    model.add_argument("--tokenizer", default=None,
                       help="a tokenizer dir or hub id (default: the model's own)")
    model.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda when "
                       "available, else cpu)")
    model.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                       help="default: float16 on CUDA, float32 on the CPU")
    model.add_argument("--debug", action="store_true",
                       help="show the Python traceback of an error (or CBATCH_DEBUG=1)")
    add_demo_parser(sub, [model])
    add_generate_parser(sub, [model])
    add_serve_parser(sub, [model])
    return parser


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"cbatch: warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get("CBATCH_DEBUG", "") not in ("", "0")
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warning_line
            args.run(args)
    except KeyboardInterrupt:
        if debug:
            raise
        print("\ncbatch: interrupted", file=sys.stderr)
        sys.exit(130)
    except (ValueError, TypeError, FileNotFoundError) as e:  # what the user asked for
        if debug:
            raise
        print(f"cbatch: error: {e}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:
        if debug:
            raise
        print(f"cbatch: error: {type(e).__name__}: {e} (--debug shows the traceback)",
              file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
