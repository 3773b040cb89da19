"""The model's linear layers on the CPU: every GEMM route torch reaches, beside the
weight-streaming floor.

    python benchmarks/bench_linear.py [--quick] [--threads 2] [--rows 1 8 64 256]

Shapes are GPT-2 small's (``N x K`` weights: c_attn 2304x768, attn c_proj 768x768, c_fc
3072x768, mlp c_proj 768x3072, lm_head 50257x768) at M = 1, 8, 64, 256 rows.  Routes:

- ``torch``: ``F.linear`` on the dense weight (fp32: MKL's sgemm; bf16: oneDNN);
- ``mkl-packed``: ``torch.ops.mkl._mkl_linear`` with the weight packed by MKL for M rows;
- ``onednn``: ``torch.ops.mkldnn._linear_pointwise`` on the dense weight;
- ``onednn-packed``: the same with the weight reordered once by
  ``torch.ops.mkldnn._reorder_linear_weight`` into oneDNN's blocked layout;
- ``cbatch``: cbatch's own kernel (csrc/cpu/linear.cpp, gemm.h) on its packed layout, on CPUs with
  AVX-512 or AVX2 (``cbatch.ops.cpu``, which picks the route the model runs);
- ``cbatch-greedy`` (the lm_head; fp32 on CPUs with AVX2 or AVX-512, bf16 on those with
  AVX512-BF16 and AVX512-VNNI): what a greedy step runs instead of the lm_head, its tokens
  through the screen (a bf16 copy of an fp32 weight, an int8 one of a bf16 weight:
  ``cbatch.ops.cpu.greedy_head``); its error column counts the rows whose token is not the
  argmax of ``cbatch``'s logits (0 expected).

Each in fp32 and bf16 (bf16 weights and activations, fp32 accumulation).  Every route runs
once per round, round-robin, with the last-level cache flushed before each call, so that a
busy machine's load falls on all routes alike; the table gives the minimum and the median
over rounds, the floor (weight bytes / measured copy bandwidth, the time to stream the
weights once) and ``floor / min`` (1.0 = at the floor).  The error column is the largest
absolute difference to the float64 product.  Results in linear.*, written to a new folder
under benchmarks/runs/ or to --out.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (  # noqa: E402
    base_parser, copy_bandwidth, environment, publish, pyplot, save_figure)

COLUMNS = ["layer", "N", "K", "M", "dtype", "route", "min_us", "median_us", "floor_us",
           "floor_over_min", "GFLOPs", "max_abs_err", "status"]
SHAPES = {"c_attn": (2304, 768), "attn.c_proj": (768, 768), "c_fc": (3072, 768),
          "mlp.c_proj": (768, 3072), "lm_head": (50257, 768)}


def routes(weight: torch.Tensor, bias: torch.Tensor | None, M: int) -> dict:
    """Route name -> callable(x) for one weight ``[N, K]`` and bias ``[N]`` (or None)."""
    out = {"torch": lambda x: F.linear(x, weight, bias)}
    if weight.dtype == torch.float32 and torch.backends.mkl.is_available():
        mkl = torch.ops.mkl._mkl_reorder_linear_weight(weight, M)
        out["mkl-packed"] = lambda x: torch.ops.mkl._mkl_linear(x, mkl, weight, bias, M)
    from cbatch.ops import cpu
    # oneDNN's bf16 linear needs AVX-512 (or AVX-NE-CONVERT): its reorder refuses otherwise
    if torch.backends.mkldnn.is_available() and (
            weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        out["onednn"] = lambda x: torch.ops.mkldnn._linear_pointwise(
            x, weight, bias, "none", [], "")
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        out["onednn-packed"] = lambda x: torch.ops.mkldnn._linear_pointwise(
            x, packed, bias, "none", [], "")
    if cpu.route_available("cbatch", weight.dtype):
        ours = cpu.pack(weight, "cbatch")
        out["cbatch"] = lambda x: cpu.packed_linear(x, ours, bias, weight.shape[0])
        if bias is None and cpu.screen_available(weight.dtype):
            screen = cpu.pack_screen(weight)
            out["cbatch-greedy"] = lambda x: cpu.greedy_head(x, ours, screen,
                                                                      weight.shape[0])
    return out


def measure(fns: dict, x: torch.Tensor, rounds: int, flush: torch.Tensor) -> dict:
    """Route -> list of seconds, one per round, the routes interleaved within each round."""
    for fn in fns.values():  # warm-up: oneDNN creates its primitive on the first call
        fn(x)
        fn(x)
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            flush.add_(1)
            start = time.perf_counter()
            fn(x)
            times[name].append(time.perf_counter() - start)
    return times


def run(args) -> Path:
    device = torch.device("cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    bw = copy_bandwidth(device, (64 << 20) if args.quick else None)
    flush = torch.empty(64 << 18, dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    shapes = {"tiny": (96, 64)} if args.quick else {k: SHAPES[k] for k in args.layers}
    rows_list = [1, 8] if args.quick else args.rows
    rows = []
    for layer, (N, K) in shapes.items():
        w32 = torch.randn(N, K, generator=gen) * 0.02
        b32 = None if layer in ("lm_head", "tiny") else torch.randn(N, generator=gen) * 0.02
        for dtype in args.dtypes:
            dt = getattr(torch, dtype)
            weight = w32.to(dt)
            bias = None if b32 is None else b32.to(dt)
            for M in rows_list:
                x = torch.randn(M, K, generator=gen).to(dt)
                truth = F.linear(x.double(), weight.double(),
                                 None if bias is None else bias.double())
                fns = routes(weight, bias, M)
                times = measure(fns, x, args.reps, flush)
                floor = weight.numel() * weight.element_size() / bw
                for name, fn in fns.items():
                    best, med = min(times[name]), statistics.median(times[name])
                    if name == "cbatch-greedy":  # tokens: rows that are not the argmax
                        err = float((fn(x) != fns["cbatch"](x).argmax(-1)).sum())
                    else:
                        err = (fn(x).double() - truth).abs().max().item()
                    rows.append({"layer": layer, "N": N, "K": K, "M": M, "dtype": dtype,
                                 "route": name, "min_us": best * 1e6, "median_us": med * 1e6,
                                 "floor_us": floor * 1e6, "floor_over_min": floor / best,
                                 "GFLOPs": 2 * M * N * K / best / 1e9, "max_abs_err": err,
                                 "status": "ok"})
                line = "  ".join(f"{n} {min(t) * 1e6:8.0f}" for n, t in times.items())
                print(f"{layer:11s} {dtype:8s} M={M:3d} floor {floor * 1e6:7.0f} us | {line}",
                      flush=True)
    loadavg = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() \
        else "?"
    meta = {**environment(device), "threads": torch.get_num_threads(),
            "copy_bandwidth_GBps": bw / 1e9, "rounds": args.reps,
            "load_average_at_end": " ".join(loadavg),
            "floor": "weight bytes / measured copy bandwidth (read + write bytes per second)",
            "timing": "routes round-robin within each round, LLC flushed before every call; "
                      "min and median over rounds"}
    return publish("linear", device, rows, meta, COLUMNS, args.out,
                   lambda rows, path: plot(rows, path))


def plot(rows, path):
    plt = pyplot()
    ok = [r for r in rows if r["status"] == "ok"]
    keys = list(dict.fromkeys((r["layer"], r["dtype"]) for r in ok))
    fig, axes = plt.subplots(1, len(keys), figsize=(3 * len(keys), 3.2), squeeze=False)
    for ax, (layer, dtype) in zip(axes[0], keys):
        mine = [r for r in ok if (r["layer"], r["dtype"]) == (layer, dtype)]
        for route in dict.fromkeys(r["route"] for r in mine):
            pts = [r for r in mine if r["route"] == route]
            ax.plot([r["M"] for r in pts], [r["min_us"] for r in pts], marker="o", label=route)
        pts = [r for r in mine if r["route"] == mine[0]["route"]]
        ax.plot([r["M"] for r in pts], [r["floor_us"] for r in pts], ls="--", label="floor")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{layer} {dtype}", fontsize=8)
        ax.set_xlabel("M (rows)")
    axes[0][0].set_ylabel("µs (min)")
    axes[0][-1].legend(fontsize=6)
    save_figure(fig, path)


def main(argv=None):
    parser = base_parser(__doc__)
    parser.set_defaults(reps=15)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: "
                        "torch's)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--layers", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    return run(args)


if __name__ == "__main__":
    main()
