"""The Triton quantized GEMMs (kernels/quant_matmul.py) on a GPU, beside the dense fp16/bf16
GEMM (cuBLAS through ``F.linear``) and the weight-streaming floor.

    python benchmarks/bench_quant_matmul.py [--quick] [--rows 1 8 512 2048]

Shapes are SmolLM2-360M's and Llama-3.2-1B's projections (``N x K``: fused qkv, fused
gate_up, down) at decode-shaped (M = 1, 8) and prefill-shaped (M = 512, 2048) row counts.
Routes:

- ``dense``: ``F.linear`` on the fp16/bf16 weight (cuBLAS);
- ``w8a16``: int8 weights per output channel (online int8's), ``cbatch_triton::
  quantized_linear``;
- ``w4a16``: int4 weights in groups of 128 (online int4's), the same op;
- ``w8a8``: per-token int8 x (``scaled_int8_quant``) then ``w8a8_linear`` on
  ``pack_w8a8``'s layout (``QuantizedLinear(act_bits=8)``'s), both timed.

Each point is the median over ``--reps`` calls (CUDA events, L2 flushed before each call);
``floor_us`` is the route's weight bytes (with scales) over the measured read bandwidth, the
time to stream the weight once, and ``floor_over_time`` its share of the measured time (1.0:
at the floor).  ``max_rel_err`` is the largest error against the float64 product of the same
(dequantized) weight, over the largest magnitude of that product.  Without a GPU only
``--quick`` runs, on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1): it checks the
harness, it measures nothing.  Results in quant_matmul.*, written to a new folder under
benchmarks/runs/ or to --out.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (  # noqa: E402
    Timer, base_parser, environment, publish, pyplot, read_bandwidth, save_figure)

COLUMNS = ["layer", "N", "K", "M", "dtype", "route", "median_us", "weight_MB", "floor_us",
           "floor_over_time", "TFLOPs", "max_rel_err", "status"]
SHAPES = {"smollm2-360m.qkv": (1600, 960), "smollm2-360m.gate_up": (5120, 960),
          "smollm2-360m.down": (960, 2560), "llama-3.2-1b.qkv": (3072, 2048),
          "llama-3.2-1b.gate_up": (16384, 2048), "llama-3.2-1b.down": (2048, 8192)}
ROUTES = ("dense", "w8a16", "w4a16", "w8a8")


def routes(weight: torch.Tensor) -> dict:
    """Route -> (callable(x), weight bytes, float64 weight it computes with)."""
    from cbatch.layers.quantization import quantize
    from cbatch.layers.quantization.weight import pack_w8a8
    from cbatch.ops.quantized import triton_linear

    out = {"dense": (lambda x: F.linear(x, weight), weight.numel() * weight.element_size(),
                     weight.double())}
    for name, bits, group in (("w8a16", 8, None), ("w4a16", 4, 128)):
        qw = quantize(weight, bits, group)
        args = (name, qw.qweight, qw.scales, qw.zeros, qw.group_size, qw.out_features, None)
        nbytes = sum(t.numel() * t.element_size() for t in (qw.qweight, qw.scales))
        out[name] = (lambda x, args=args: triton_linear(x, *args), nbytes,
                     qw.dequantize().double())
    qw = quantize(weight, 8, None)
    args = ("w8a8", pack_w8a8(qw), qw.scales, None, qw.in_features, qw.out_features, None)
    out["w8a8"] = (lambda x: triton_linear(x, *args),
                   sum(t.numel() * t.element_size() for t in args[1:3]), qw.dequantize().double())
    return out


def run(args) -> Path:
    device = torch.device(args.device)
    if device.type != "cuda" and not args.quick:
        raise SystemExit("bench_quant_matmul times GPU kernels: --device cuda (or --quick, "
                         "which checks the harness in Triton's interpreter)")
    bw = read_bandwidth(device, (64 << 20) if device.type != "cuda" else None)
    timer = Timer(device, warmup=2 if args.quick else 5, reps=args.reps)
    gen = torch.Generator().manual_seed(0)
    shapes = {"tiny": (40, 96)} if args.quick else {k: SHAPES[k] for k in args.layers}
    rows_list = [1, 17] if args.quick else args.rows
    dtypes = ["float32"] if device.type != "cuda" else args.dtypes
    rows = []
    for layer, (N, K) in shapes.items():
        w32 = torch.randn(N, K, generator=gen) * 0.02
        for dtype in dtypes:
            dt = getattr(torch, dtype)
            fns = routes(w32.to(device=device, dtype=dt))
            for M in rows_list:
                x = torch.randn(M, K, generator=gen).to(device=device, dtype=dt)
                for name, (fn, nbytes, w) in fns.items():
                    row = {"layer": layer, "N": N, "K": K, "M": M, "dtype": dtype,
                           "route": name, "weight_MB": nbytes / 1e6}
                    try:
                        truth = x.double() @ w.t()
                        err = (fn(x).double() - truth).abs().max() / truth.abs().max()
                        seconds = timer(lambda fn=fn: fn(x))
                    except Exception as e:  # a route that fails is a row, not a crash
                        rows.append({**row, "status": f"error: {type(e).__name__}: {e}"[:200]})
                        continue
                    floor = nbytes / bw
                    rows.append({**row, "median_us": seconds * 1e6, "floor_us": floor * 1e6,
                                 "floor_over_time": floor / seconds,
                                 "TFLOPs": 2 * M * N * K / seconds / 1e12,
                                 "max_rel_err": float(err), "status": "ok"})
                line = "  ".join(f"{r['route']} {r.get('median_us', float('nan')):8.1f}"
                                 for r in rows[-len(fns):])
                print(f"{layer:22s} {dtype:8s} M={M:5d} | {line}", flush=True)
    meta = {**environment(device), "read_bandwidth_GBps": bw / 1e9, "reps": args.reps,
            "floor": "weight bytes (int8/int4 integers + fp32 scales) / measured read "
                     "bandwidth",
            "timing": "median of CUDA-event times, L2 flushed before each call"
                      if device.type == "cuda" else "Triton's interpreter: not a timing"}
    return publish("quant_matmul", device, rows, meta, COLUMNS, args.out, plot)


def plot(rows, path):
    plt = pyplot()
    ok = [r for r in rows if r["status"] == "ok"]
    keys = list(dict.fromkeys((r["layer"], r["dtype"]) for r in ok))
    fig, axes = plt.subplots(1, max(1, len(keys)), figsize=(3 * max(1, len(keys)), 3.2),
                             squeeze=False)
    for ax, (layer, dtype) in zip(axes[0], keys):
        mine = [r for r in ok if (r["layer"], r["dtype"]) == (layer, dtype)]
        for route in dict.fromkeys(r["route"] for r in mine):
            pts = [r for r in mine if r["route"] == route]
            ax.plot([r["M"] for r in pts], [r["median_us"] for r in pts], marker="o",
                    label=route)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{layer} {dtype}", fontsize=8)
        ax.set_xlabel("M (rows)")
    axes[0][0].set_ylabel("µs (median)")
    axes[0][-1].legend(fontsize=6)
    save_figure(fig, path)


def main(argv=None):
    parser = base_parser(__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 512, 2048])
    parser.add_argument("--layers", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"],
                        choices=["float16", "bfloat16"])
    args = parser.parse_args(argv)
    return run(args)


if __name__ == "__main__":
    main()
