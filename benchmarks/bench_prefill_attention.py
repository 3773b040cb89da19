"""Paged prefill attention (chunks of new tokens over a cached context), every available
implementation.

    python benchmarks/bench_prefill_attention.py [--quick]

Each sequence has `cached` tokens in the paged cache and a chunk of `chunk` new tokens that
attend causally to the cache and to each other (chunked prefill).  Checked against the
reference, then timed like the decode benchmark; results in
prefill_attention.{json,csv,md,png}, written to a new folder under benchmarks/runs/ or to
--out.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (  # noqa: E402
    Timer, Unavailable, base_parser, cbatch_impl, check_and_time, copy_bandwidth, environment,
    first_shape_ok_rows, paged_inputs, publish, pyplot, save_figure)
from cbatch.ops import reference  # noqa: E402

COLUMNS = ["impl", "heads", "dtype", "batch", "chunk", "cached", "us", "TFLOP/s", "max_err",
           "status"]


def _sdpa_padded(q, kc, vc, bt, cu, sl):
    """Dense [S, H, chunk, D] queries over dense [S, H, len, D] K/V (equal lengths here);
    building the dense tensors is not timed."""
    S = sl.shape[0]
    H, D = q.shape[1:]
    n = q.shape[0] // S
    L = int(sl.max())
    k = torch.stack([reference.gather_kv(kc, bt[s], L) for s in range(S)]).transpose(1, 2)
    v = torch.stack([reference.gather_kv(vc, bt[s], L) for s in range(S)]).transpose(1, 2)
    k, v = k.contiguous(), v.contiguous()
    q4 = q.view(S, n, H, D).transpose(1, 2)
    query_pos = torch.arange(L - n, L, device=q.device)[:, None]
    mask = torch.arange(L, device=q.device)[None, :] <= query_pos  # [n, L], causal over cache

    def attend():
        o = F.scaled_dot_product_attention(q4, k, v, attn_mask=mask)  # [S, H, n, D]
        return o.transpose(1, 2).reshape(-1, H, D)

    return attend


def _flashinfer(q, kc, vc, bt, cu, sl):
    try:
        import flashinfer
    except ImportError as e:
        raise Unavailable(f"flashinfer not importable ({e})") from e
    if q.device.type != "cuda":
        raise Unavailable("flashinfer needs CUDA")
    H, D = q.shape[1:]
    block_size = kc.shape[1]
    blocks = (sl + block_size - 1) // block_size
    kv_indptr = torch.zeros(sl.shape[0] + 1, dtype=torch.int32, device=q.device)
    kv_indptr[1:] = blocks.cumsum(0)
    indices = bt[torch.arange(bt.shape[1], device=q.device)[None, :] < blocks[:, None]].int()
    last = (sl - 1) % block_size + 1
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(cu, kv_indptr, indices, last.int(), H, H, D, block_size, causal=True,
                 q_data_type=q.dtype, kv_data_type=kc.dtype)
    return lambda: wrapper.run(q, (kc, vc))


OP = "paged_prefill_attention"
IMPLS = {
    "cbatch-triton": cbatch_impl(OP, "triton"),
    "cbatch-cpu": cbatch_impl(OP, "cpu"),
    "torch-reference": cbatch_impl(OP, "torch"),
    "sdpa-padded": _sdpa_padded,
    "flashinfer": _flashinfer,
}


def grid(device, quick):
    if quick:
        return list(itertools.product([(12, 64)], [torch.float32], [1, 2], [16, 40], [0, 24]))
    if device.type == "cuda":
        return list(itertools.product([(12, 64), (32, 128)], [torch.float16, torch.bfloat16],
                                      [1, 8, 32], [128, 512], [0, 512, 2048]))
    return list(itertools.product([(12, 64)], [torch.float32], [1, 4, 8], [64, 256], [0, 512]))


def run(args) -> Path:
    device = torch.device(args.device)
    reps = 3 if args.quick else args.reps
    timer = Timer(device, warmup=1 if args.quick else 3, reps=reps)
    rows = []
    for (H, D), dtype, batch, chunk, cached in tqdm(grid(device, args.quick),
                                                    desc="prefill shapes",
                                                    disable=args.no_progress):
        lens = [cached + chunk] * batch
        inputs = paged_inputs(lens, H, D, dtype, device, num_new=[chunk] * batch)
        truth = reference.paged_prefill_attention(*inputs).float()
        # causal work: each new token attends to cached + its own prefix of the chunk
        pairs = batch * (chunk * cached + chunk * (chunk + 1) / 2)
        flops = 4 * pairs * H * D
        base = {"heads": f"{H}x{D}", "dtype": str(dtype).removeprefix("torch."),
                "batch": batch, "chunk": chunk, "cached": cached}
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        for name, build in IMPLS.items():
            rows.append(check_and_time({"impl": name, **base}, build, inputs, truth, tol, timer,
                                       lambda t: {"TFLOP/s": flops / t / 1e12}))
    meta = {**environment(device), "reps": reps, "block_size": 16,
            "copy_bandwidth_GBps": copy_bandwidth(device, (64 << 20) if args.quick else None) / 1e9,
            "timing": "median, cold cache (flush buffer overwritten before every run)"}
    return publish("prefill_attention", device, rows, meta, COLUMNS, args.out, plot)


def plot(rows, path):
    plt = pyplot()
    sel = first_shape_ok_rows(rows)
    if not sel:
        return
    heads, dtype = sel[0]["heads"], sel[0]["dtype"]
    keys = sorted({(r["chunk"], r["cached"]) for r in sel})
    fig, axes = plt.subplots(1, len(keys), figsize=(3.6 * len(keys), 3.2), squeeze=False,
                             sharey=True)
    for ax, (chunk, cached) in zip(axes[0], keys):
        for impl in sorted({r["impl"] for r in sel}):
            pts = sorted((r["batch"], r["us"]) for r in sel if r["impl"] == impl
                         and r["chunk"] == chunk and r["cached"] == cached)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"chunk {chunk}, cached {cached}", fontsize=9)
        ax.set_xlabel("batch")
    axes[0][0].set_ylabel("µs (lower is better)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"paged prefill attention, heads {heads}, {dtype}")
    save_figure(fig, path)


def main(argv=None):
    return run(base_parser(__doc__).parse_args(argv))


if __name__ == "__main__":
    main()
