"""Prompt GEMMs against this CPU's measured peak (issue 72 item 1): how close a model's linears
come, at the row counts of a prompt, to the rate of the instruction they multiply with.

    python benchmarks/bench_peak.py --model random:smollm2-360m --methods none w4a8 w8a8 int4 \\
        --rows 512 2048 4096 [--dtype bfloat16] [--attention [--cached 0 6144]] [--threads 2] \\
        [--reps 3] [--out peak.jsonl]

**The peaks** (``benchmarks/peak/avx2_loops.c``, and ``avx512_loops.c`` where the CPU has
AVX512-VNNI and AVX512-BF16; compiled here with the system's C compiler): each loop of
independent register-only chains, run on every thread at once (one Python thread each: ctypes
lets go of the GIL), its rate the sum over threads.  AVX2: ``fma`` (``vfmadd231ps`` ymm, 16
flops an instruction: the fp32 route, bf16 widened to fp32 on AVX2, and int4 with float
activations), ``int8`` (``vpmaddubsw`` + ``vpmaddwd`` + ``vpaddd``, 64 integer ops a pair:
W8A8, W4A8, W8A8 per group), and ``vpmaddubsw`` alone.  AVX-512: ``fma512``
(``vfmadd231ps`` zmm, 32 flops), ``vnni`` (``vpdpbusd`` ymm, 64 integer ops) and ``bf16``
(``vdpbf16ps`` zmm, 64 flops).  Best of ``--reps`` runs before the linears and as many after
them: a shared host's cores run some seconds slower, and a fraction held to a slow moment's
peak would flatter the kernel.

**The linears**: the model loaded by cbatch (``LLM``: packed and placed as a step runs them)
under each method, in ``--dtype``; layer 0's ``qkv_proj``, ``o_proj``, ``gate_up_proj`` and
``down_proj`` called on ``M`` rows of x (that dtype), the best of ``--reps`` calls after one
warm-up; ``GFLOP/s = 2 M N K / t`` and its fraction of the peak of the instruction its kernel
multiplies with, named by the kernel path the warm-up ran (:func:`ran`, the counter that moved;
:func:`route`: ``int8`` or ``vnni`` for the int8-activation kernels, ``bf16`` for a bf16 x on
AVX512-BF16, ``fma`` or ``fma512`` for the rest; ``CBATCH_CPU_ISA=avx2`` forces AVX2's).  AMX
tiles and the pure-torch reference get no fraction.

**The prefill attention** (``--attention``): the model's heads, KV heads and head size through
the CPU kernel the runner calls (``torch.ops.cbatch.paged_prefill_attention``, fp32), one
sequence's chunk of ``M`` new tokens over ``--cached`` tokens already in a shuffled paged cache
(blocks of 16); ``GFLOP/s = 4 H D M (cached + (M + 1) / 2) / t`` (q K^T and P V over each
row's visible keys) against the FMA peak.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import shutil
import subprocess
import tempfile
import threading
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LOOPS = {"avx2": Path(__file__).resolve().parent / "peak" / "avx2_loops.c",
         "avx512": Path(__file__).resolve().parent / "peak" / "avx512_loops.c"}
FLAGS = {"avx2": ["-mavx2", "-mfma"],
         "avx512": ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512vnni", "-mavx512bf16"]}
# per loop: (its file, C function, its return type, ops per iteration: 12 FMAs x 16 flops, 5
# pairs x 64 integer ops (32 multiply-adds), 5 vpmaddubsw x 64; 12 zmm FMAs x 32, 12 ymm
# vpdpbusd x 64, 12 zmm vdpbf16ps x 64)
PEAKS = {"fma": ("avx2", "fma_loop", ctypes.c_float, 12 * 16),
         "int8": ("avx2", "int8_loop", ctypes.c_int, 5 * 64),
         "vpmaddubsw": ("avx2", "maddubs_loop", ctypes.c_int, 5 * 64),
         "fma512": ("avx512", "fma512_loop", ctypes.c_float, 12 * 32),
         "vnni": ("avx512", "vnni_loop", ctypes.c_int, 12 * 64),
         "bf16": ("avx512", "bf16_loop", ctypes.c_float, 12 * 64)}
LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def compile_loops(where: Path, isa: str) -> ctypes.CDLL:
    """``<isa>_loops.c`` (``avx2`` or ``avx512``) as a shared library (cc -O2 and the ISA's
    flags)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit(f"no C compiler (cc or gcc) to build {LOOPS[isa]}")
    lib = where / f"{isa}_loops.so"
    subprocess.run([cc, "-O2", *FLAGS[isa], "-shared", "-fPIC", str(LOOPS[isa]), "-o",
                    str(lib)], check=True)
    return ctypes.CDLL(str(lib))


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags")
            for f in line.split(":", 1)[1].split()}


def peak(libs: dict[str, ctypes.CDLL], name: str, threads: int, seconds: float = 0.3) -> float:
    """Ops a second of loop ``name`` on ``threads`` threads at once."""
    isa, function, restype, per_iteration = PEAKS[name]
    fn = getattr(libs[isa], function)
    fn.restype, fn.argtypes = restype, [ctypes.c_long]
    fn(1000)
    n = 1000
    while True:  # iterations for about `seconds` on one thread
        start = time.perf_counter()
        fn(n)
        if time.perf_counter() - start > seconds / 4:
            break
        n *= 4
    n = int(n * seconds / max(time.perf_counter() - start, 1e-9))
    barrier = threading.Barrier(threads + 1)

    def worker():
        barrier.wait()
        fn(n)

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in pool:
        t.join()
    return threads * n * per_iteration / (time.perf_counter() - start)


def ran(call) -> str:
    """Call ``call()`` once and name the C++ kernel path it ran (the counter of
    :func:`cbatch.ops.cpu.kernel_paths` that moved, e.g. ``linear.avx512`` or
    ``quantized_linear.w4a8.avx512vnni``; "" where none did: the pure-torch reference)."""
    from cbatch.ops import cpu

    before = cpu.kernel_paths()
    call()
    moved = [name for name, n in cpu.kernel_paths().items() if n != before.get(name, 0)]
    return moved[0] if moved else ""


def route(path: str, dtype) -> str | None:
    """The peak a kernel path is held to (the instruction it multiplies with): ``vnni``
    (``vpdpbusd``) or ``int8`` (``vpmaddubsw`` + ``vpmaddwd``) for the int8-activation kernels;
    ``bf16`` (``vdpbf16ps``) for a bf16 x on AVX512-BF16 (the dense kernel, W4A16);
    ``fma512`` or ``fma`` for the rest (fp32, bf16 widened on AVX2, W8A16); None on AMX
    tiles or the reference, which no loop here measures."""
    import torch

    isa = path.rsplit(".", 1)[-1]
    if not path or isa == "amx":
        return None
    if any(f".{kind}." in path for kind in ("w8a8", "w4a8", "w8a8g")):
        return "vnni" if isa == "avx512vnni" else "int8"
    if isa == "avx512bf16" or (path == "linear.avx512" and dtype == torch.bfloat16):
        return "bf16"
    return "fma512" if isa == "avx512" else "fma"


def linears(args, method: str) -> list[dict]:
    import torch

    import cbatch

    dtype = getattr(torch, args.dtype)
    llm = cbatch.LLM(args.model, dtype=dtype, threads=args.threads,
                     quantization=None if method == "none" else method,
                     num_blocks=8, block_size=16)
    layer = llm.engine.model.model.layers[0]
    modules = {"qkv_proj": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj,
               "gate_up_proj": layer.mlp.gate_up_proj, "down_proj": layer.mlp.down_proj}
    rows = []
    with torch.no_grad():
        for M in args.rows:
            for name, module in modules.items():
                N, K = module.out_features, module.in_features
                x = torch.randn(M, K, dtype=dtype)
                path = ran(functools.partial(module, x))  # and a warm-up
                best = float("inf")
                for _ in range(args.reps):
                    start = time.perf_counter()
                    module(x)
                    best = min(best, time.perf_counter() - start)
                rate = 2 * M * N * K / best
                kind = route(path, dtype)
                rows.append({"model": args.model, "method": method, "dtype": args.dtype,
                             "layer": name, "M": M, "N": N, "K": K,
                             "kernel": getattr(module, "kind", "dense"), "path": path,
                             "ms": best * 1e3, "GFLOPs": rate / 1e9, "peak": kind})
                print(json.dumps(rows[-1]), flush=True)
    del llm
    return rows


def attention(args) -> list[dict]:
    import torch

    import cbatch
    from benchmarks.common import paged_inputs

    config = cbatch.LLM(args.model, dtype=torch.float32, num_blocks=8,
                        block_size=16).engine.model.config
    H, H_kv = config.num_attention_heads, config.num_key_value_heads
    D = getattr(config, "head_dim", None) or config.hidden_size // H
    rows = []
    for cached in args.cached:
        for M in args.rows:
            _, key_cache, value_cache, tables, cu, lens = paged_inputs(
                [cached + M], H_kv, D, torch.float32, "cpu", num_new=[M])
            query = torch.randn(M, H, D)
            call = functools.partial(torch.ops.cbatch.paged_prefill_attention, query,
                                     key_cache, value_cache, tables, cu, lens, D ** -0.5)
            path = ran(call)  # and a warm-up
            fma = route(path, torch.float32)
            best = float("inf")
            for _ in range(args.reps):
                start = time.perf_counter()
                call()
                best = min(best, time.perf_counter() - start)
            rate = 4 * H * D * M * (cached + (M + 1) / 2) / best
            rows.append({"model": args.model, "method": "attention", "layer": "attention",
                         "M": M, "cached": cached, "H": H, "H_kv": H_kv, "D": D,
                         "kernel": "prefill", "path": path, "ms": best * 1e3, "GFLOPs": rate / 1e9,
                         "peak": fma})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:smollm2-360m")
    ap.add_argument("--methods", nargs="*", default=["none", "w4a8", "w8a8", "int4"],
                    help="the linears' quantizations (none: the fp32 weights)")
    ap.add_argument("--rows", type=int, nargs="+", default=[512, 2048, 4096])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the model's and x's dtype (bfloat16: vdpbf16ps on AVX512-BF16)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None, help="append the rows as JSON lines")
    ap.add_argument("--attention", action="store_true",
                    help="also the prefill attention of chunks of --rows tokens")
    ap.add_argument("--cached", type=int, nargs="+", default=[0],
                    help="tokens already cached before each attention chunk")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from cbatch.ops import cpu

    isa = cpu.cpu_isa()
    # the loops this CPU runs, whatever the cap (/proc/cpuinfo's flags)
    loops = ["avx2"] + (["avx512"] if {"avx512_vnni", "avx512_bf16"} <= cpu_flags() else [])
    with tempfile.TemporaryDirectory() as tmp:
        libs = {name: compile_loops(Path(tmp), name) for name in loops}

        def measure() -> dict[str, float]:
            return {name: max(peak(libs, name, args.threads) for _ in range(args.reps))
                    for name in PEAKS if PEAKS[name][0] in libs}

        # before and after the linears, the better of both: a shared host's cores lose speed
        # for seconds at a time (benchmarks/NOTES.md, "Prompt GEMMs against the measured peak")
        before = measure()
        rows = [row for method in args.methods for row in linears(args, method)]
        if args.attention:
            rows += attention(args)
        peaks = {name: max(rate, before[name]) for name, rate in measure().items()}
    for name, rate in peaks.items():
        print(f"peak {name}: {rate / 1e9:.1f} G ops/s on {args.threads} threads "
              f"(before the linears {before[name] / 1e9:.1f})")
    for row in rows:  # an AVX-512 CPU without VNNI and BF16 has no AVX-512 loop measured
        row["peak"] = row["peak"] if row["peak"] in peaks else None
        row["of_peak"] = row["GFLOPs"] * 1e9 / peaks[row["peak"]] if row["peak"] else None
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps({"peaks": peaks, "threads": args.threads, "isa": isa}) + "\n")
            for row in rows:
                f.write(json.dumps(row) + "\n")
    print(f"\n{'method':<7} {'layer':<13} {'M':>5} {'kernel':<7} {'ms':>8} {'GFLOP/s':>8} "
          f"{'of peak':>8}")
    for r in rows:
        share = f"{r['of_peak']:.0%} {r['peak']}" if r["of_peak"] is not None else "-"
        print(f"{r['method']:<7} {r['layer']:<13} {r['M']:>5} {r['kernel']:<7} {r['ms']:>8.2f} "
              f"{r['GFLOPs']:>8.1f} {share:>8}")
    return {"peaks": peaks, "rows": rows}


if __name__ == "__main__":
    main()
