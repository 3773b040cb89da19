"""Attention of a mixed step (decode tokens and prefill chunks in one batch): one prefill
kernel over every token ("unified", what GPT-2 does now) against the decode kernel over the
decode tokens plus the prefill kernel over the chunks ("split").

    python benchmarks/bench_mixed_step.py [--quick]

The batch is laid out as the scheduler builds it: `decodes` sequences of `context` tokens
with one new token each, then `prefills` sequences with a chunk of `chunk` new tokens and
nothing cached.  Both strategies fill one [T, H, D] output (split writes its two halves into
it).  `auto` is the backend GPT-2 picks on the device (on CUDA: the CUDA decode kernel and
the Triton prefill kernel).  Each row is checked against the reference, then timed like the
other kernel benchmarks; `speedup` is unified time / split time for the same backend.
Results in mixed_step.{json,csv,md,png}, written to a new folder under benchmarks/runs/ or
to --out.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (  # noqa: E402
    Timer, base_parser, check_and_time, check_backend, environment, first_shape_ok_rows,
    paged_inputs, publish, pyplot, save_figure)
from cbatch import ops  # noqa: E402
from cbatch.ops import reference  # noqa: E402

COLUMNS = ["impl", "heads", "dtype", "decodes", "context", "prefills", "chunk", "us",
           "speedup", "max_err", "status"]


def _backend_arg(backend: str, device: torch.device, head_dim: int) -> str | None:
    """The backend argument for the ops (None = auto), or Unavailable."""
    if backend == "auto":
        return None
    check_backend(backend, device, head_dim, "paged_decode_attention",
                  "paged_prefill_attention")
    return backend


def unified(backend: str, num_decodes: int, max_query_len: int):
    def build(q, kc, vc, bt, cu, sl):
        b = _backend_arg(backend, q.device, q.shape[-1])
        return lambda: ops.paged_prefill_attention(q, kc, vc, bt, cu, sl, backend=b,
                                                   max_query_len=max_query_len)
    return build


def split(backend: str, num_decodes: int, max_query_len: int):
    def build(q, kc, vc, bt, cu, sl):
        b = _backend_arg(backend, q.device, q.shape[-1])
        nd = num_decodes
        # what a step batch would carry precomputed: the prefill half's own offsets
        q_dec, q_pre, cu_pre = q[:nd], q[nd:], (cu[nd:] - nd).contiguous()
        bt_dec, bt_pre = bt[:nd].contiguous(), bt[nd:].contiguous()
        sl_dec, sl_pre = sl[:nd].contiguous(), sl[nd:].contiguous()
        out = torch.empty_like(q)

        def fn():
            out[:nd] = ops.paged_decode_attention(q_dec, kc, vc, bt_dec, sl_dec, backend=b)
            out[nd:] = ops.paged_prefill_attention(q_pre, kc, vc, bt_pre, cu_pre, sl_pre,
                                                   backend=b, max_query_len=max_query_len)
            return out
        return fn
    return build


def backends_for(device: torch.device) -> list[str]:
    return ["auto", "triton", "torch"] if device.type == "cuda" else ["cpu", "torch"]


def grid(device, quick):
    if quick:
        return list(itertools.product([(12, 64)], [torch.float32], [2], [20], [1], [17]))
    if device.type == "cuda":
        return list(itertools.product([(12, 64)], [torch.float16], [8, 64, 256], [128, 1024],
                                      [1], [128, 512, 2048]))
    return list(itertools.product([(12, 64)], [torch.float32], [8, 32], [256, 1024], [1],
                                  [64, 256]))


def run(args) -> Path:
    device = torch.device(args.device)
    reps = 3 if args.quick else args.reps
    timer = Timer(device, warmup=1 if args.quick else 3, reps=reps)
    backends = backends_for(device)
    rows = []
    for (H, D), dtype, decodes, context, prefills, chunk in tqdm(
            grid(device, args.quick), desc="mixed steps", disable=args.no_progress):
        lens = [context] * decodes + [chunk] * prefills
        num_new = [1] * decodes + [chunk] * prefills
        inputs = paged_inputs(lens, H, D, dtype, device, num_new=num_new)
        truth = reference.paged_prefill_attention(*inputs).float()
        base = {"heads": f"{H}x{D}", "dtype": str(dtype).removeprefix("torch."),
                "decodes": decodes, "context": context, "prefills": prefills, "chunk": chunk}
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        for backend in backends:
            timed = {}
            for strategy, make in (("unified", unified), ("split", split)):
                row = check_and_time({"impl": f"{backend}-{strategy}", **base},
                                     make(backend, decodes, chunk), inputs, truth, tol, timer,
                                     lambda t: {})
                timed[strategy] = row
                rows.append(row)
            if all(r.get("status") == "ok" for r in timed.values()):
                timed["split"]["speedup"] = timed["unified"]["us"] / timed["split"]["us"]
    meta = {**environment(device), "reps": reps, "block_size": 16,
            "timing": "median, cold cache (flush buffer overwritten before every run)"}
    return publish("mixed_step", device, rows, meta, COLUMNS, args.out, plot)


def plot(rows, path):
    """Split time / unified time per shape and backend (below 1: splitting is faster)."""
    plt = pyplot()
    sel = [r for r in first_shape_ok_rows(rows) if r.get("speedup")]
    if not sel:
        return
    fig, ax = plt.subplots(figsize=(7, 3.4))
    labels = sorted({(r["decodes"], r["context"], r["chunk"]) for r in sel})
    backends = sorted({r["impl"].rsplit("-", 1)[0] for r in sel})
    width = 0.8 / len(backends)
    for i, backend in enumerate(backends):
        ys = [next((1 / r["speedup"] for r in sel if r["impl"] == f"{backend}-split"
                    and (r["decodes"], r["context"], r["chunk"]) == key), float("nan"))
              for key in labels]
        ax.bar([x + i * width for x in range(len(labels))], ys, width, label=backend)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))])
    ax.set_xticklabels([f"{d}x{c}\n+{k}" for d, c, k in labels], fontsize=7)
    ax.set_xlabel("decodes x context + chunk")
    ax.set_ylabel("split / unified time")
    ax.legend(fontsize=7)
    ax.set_title(f"mixed-step attention, {sel[0]['heads']}, {sel[0]['dtype']}")
    save_figure(fig, path)


def main(argv=None):
    return run(base_parser(__doc__).parse_args(argv))


if __name__ == "__main__":
    main()
