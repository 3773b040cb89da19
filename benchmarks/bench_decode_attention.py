"""Paged decode attention: every available implementation over docs/design.md's kernel shapes.

    python benchmarks/bench_decode_attention.py            # full grid for this device
    python benchmarks/bench_decode_attention.py --quick    # tiny grid, under two minutes on a CPU

For each shape every implementation is first checked against the pure-torch reference, then
timed (warm-up, median, cold cache: see benchmarks/common.py).  Bandwidth counts the bytes
that must move: the real K/V lengths plus Q and O.  Results land in
decode_attention.{json,csv,md,png}, written to a new folder under
benchmarks/runs/ or to --out (see benchmarks/common.py).
"""

from __future__ import annotations

import itertools
import math
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

COLUMNS = ["impl", "heads", "dtype", "mix", "batch", "context", "us", "GB/s", "pct_copy_bw",
           "max_err", "status"]


def seq_lens_for(mix: str, batch: int, context: int, gen: torch.Generator) -> list[int]:
    """"equal": every sequence `context` long; "longtail": lognormal around context/8, one
    sequence at the full context (what a padded implementation pads to)."""
    if mix == "equal":
        return [context] * batch
    lens = torch.distributions.LogNormal(math.log(max(1, context / 8)), 1.0).sample(
        (batch,)).clamp(1, context).long().tolist()
    lens[0] = context
    return lens


def _sdpa_padded(q, kc, vc, bt, sl):
    """What a padded implementation does: dense [S, H, max_len, D] K/V and a length mask.
    Only the attention call is timed; building the dense K/V is not."""
    S, H, D = q.shape
    lens = sl.tolist()
    L = max(lens)
    k = torch.zeros(S, L, H, D, dtype=q.dtype, device=q.device)
    v = torch.zeros_like(k)
    for s, n in enumerate(lens):
        k[s, :n] = reference.gather_kv(kc, bt[s], n)
        v[s, :n] = reference.gather_kv(vc, bt[s], n)
    k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    mask = (torch.arange(L, device=q.device)[None, :] < sl[:, None])[:, None, None, :]
    q4 = q[:, :, None, :]
    return lambda: F.scaled_dot_product_attention(q4, k, v, attn_mask=mask)[:, :, 0]


def _flashinfer(q, kc, vc, bt, sl):
    try:
        import flashinfer
    except ImportError as e:
        raise Unavailable(f"flashinfer not importable ({e})") from e
    if q.device.type != "cuda":
        raise Unavailable("flashinfer needs CUDA")
    S, H, D = q.shape
    block_size = kc.shape[1]
    blocks = (sl + block_size - 1) // block_size
    indptr = torch.zeros(S + 1, dtype=torch.int32, device=q.device)
    indptr[1:] = blocks.cumsum(0)
    mask = torch.arange(bt.shape[1], device=q.device)[None, :] < blocks[:, None]
    indices = bt[mask].int()
    last = (sl - 1) % block_size + 1
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(indptr, indices, last.int(), H, H, D, block_size, q_data_type=q.dtype,
                 kv_data_type=kc.dtype)
    return lambda: wrapper.run(q, (kc, vc))


_compiled_flex = None


def _flex(q, kc, vc, bt, sl):
    """torch FlexAttention over the paged cache: the whole pool is one long key sequence and
    a mask keeps, for query s, the slots of s's blocks below its length.  Building the slot
    maps and the block mask (planning, like FlashInfer's plan) is not timed."""
    global _compiled_flex
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:
        raise Unavailable(f"this torch has no FlexAttention ({e})") from e
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=True)
    N, B, H, D = kc.shape
    S, dev = q.shape[0], q.device
    blocks = (sl + B - 1) // B
    used = torch.arange(bt.shape[1], device=dev)[None, :] < blocks[:, None]
    physical = bt[used].long()
    block_seq = torch.full((N,), -1, dtype=torch.int32, device=dev)
    block_seq[physical] = torch.arange(S, device=dev, dtype=torch.int32)[:, None].expand_as(
        used)[used]
    block_pos = torch.zeros(N, dtype=torch.int32, device=dev)
    block_pos[physical] = torch.arange(bt.shape[1], device=dev, dtype=torch.int32)[
        None, :].expand_as(used)[used]
    slot_seq = block_seq.repeat_interleave(B)
    slot_pos = block_pos.repeat_interleave(B) * B + torch.arange(B, device=dev).repeat(N)

    def mask_mod(b, h, q_idx, kv_idx):
        return (slot_seq[kv_idx] == q_idx) & (slot_pos[kv_idx] < sl[q_idx])

    mask = create_block_mask(mask_mod, 1, None, S, N * B, device=dev)
    k = kc.view(1, N * B, H, D).transpose(1, 2)
    v = vc.view(1, N * B, H, D).transpose(1, 2)
    q4 = q.transpose(0, 1)[None]  # [1, H, S, D]
    return lambda: _compiled_flex(q4, k, v, block_mask=mask)[0].transpose(0, 1)


OP = "paged_decode_attention"
IMPLS = {
    "cbatch-cuda": cbatch_impl(OP, "cuda"),
    "cbatch-triton": cbatch_impl(OP, "triton"),
    "cbatch-cpu": cbatch_impl(OP, "cpu"),
    "torch-reference": cbatch_impl(OP, "torch"),
    "sdpa-padded": _sdpa_padded,
    "flex-paged": _flex,
    "flashinfer": _flashinfer,
}


def grid(device: torch.device, quick: bool):
    """(heads (H, D), dtype, mix, batch, context) tuples."""
    mixes = ["equal", "longtail"]
    if quick:
        return list(itertools.product([(12, 64)], [torch.float32], mixes, [1, 4], [64, 160]))
    if device.type == "cuda":
        dtypes = [torch.float16, torch.bfloat16]
        batches = [1, 8, 32, 64, 128, 256]
        g = list(itertools.product([(12, 64)], dtypes, mixes, batches, [128, 512, 1024]))
        g += [shape for shape in itertools.product([(32, 128)], dtypes, mixes, batches,
                                                   [1024, 4096, 8192])
              if shape[3] * shape[4] <= 1 << 19]  # <= 8.6 GB of fp16 K/V per shape
        return g
    g = list(itertools.product([(12, 64)], [torch.float32, torch.float16], mixes, [1, 8, 32],
                               [128, 512, 1024]))
    g += list(itertools.product([(32, 128)], [torch.float32], mixes, [1, 8], [1024, 4096]))
    return g


def run(args) -> Path:
    device = torch.device(args.device)
    reps = 3 if args.quick else args.reps
    timer = Timer(device, warmup=1 if args.quick else 3, reps=reps)
    bw = copy_bandwidth(device, (64 << 20) if args.quick else None)
    rows = []
    impls = [n for n in IMPLS if not args.impl or n in args.impl]
    shapes = grid(device, args.quick)
    gen = torch.Generator().manual_seed(0)
    for (H, D), dtype, mix, batch, context in tqdm(shapes, desc="decode shapes",
                                                   disable=args.no_progress):
        lens = seq_lens_for(mix, batch, context, gen)
        q, kc, vc, bt, _, sl = paged_inputs(lens, H, D, dtype, device)
        inputs = (q, kc, vc, bt, sl)
        truth = reference.paged_decode_attention(q, kc, vc, bt, sl).float()
        elem = q.element_size()
        moved = sum(lens) * H * D * 2 * elem + 2 * q.numel() * elem
        base = {"heads": f"{H}x{D}", "dtype": str(dtype).removeprefix("torch."), "mix": mix,
                "batch": batch, "context": context}
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        for name in impls:
            row = {"impl": name, **base}
            if name == "torch-reference" and batch * context > 64 * 1024 and not args.quick:
                row["status"] = "skipped: too slow (Python loop over sequences)"
                rows.append(row)
                continue
            rows.append(check_and_time(row, IMPLS[name], inputs, truth, tol, timer, lambda t: {
                "GB/s": moved / t / 1e9, "pct_copy_bw": 100 * moved / t / bw}))
        del inputs, q, kc, vc, truth
    meta = {**environment(device), "copy_bandwidth_GBps": bw / 1e9, "reps": reps,
            "timing": "median, cold cache (flush buffer overwritten before every run)",
            "block_size": 16}
    return publish("decode_attention", device, rows, meta, COLUMNS, args.out,
                   lambda rows, path: plot(rows, bw, path))


def plot(rows: list[dict], bw: float, path: Path) -> None:
    plt = pyplot()
    sel = first_shape_ok_rows(rows)
    if not sel:
        return
    heads, dtype = sel[0]["heads"], sel[0]["dtype"]
    contexts = sorted({r["context"] for r in sel})
    mixes = sorted({r["mix"] for r in sel})
    fig, axes = plt.subplots(len(mixes), len(contexts), figsize=(4 * len(contexts),
                                                                 3.2 * len(mixes)),
                             squeeze=False, sharey=True)
    for i, mix in enumerate(mixes):
        for j, ctx in enumerate(contexts):
            ax = axes[i][j]
            for impl in sorted({r["impl"] for r in sel}):
                pts = sorted((r["batch"], r["GB/s"]) for r in sel
                             if r["impl"] == impl and r["mix"] == mix and r["context"] == ctx)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=impl)
            ax.axhline(bw / 1e9, color="gray", ls="--", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{mix}, context {ctx}", fontsize=9)
            ax.set_xlabel("batch")
            if j == 0:
                ax.set_ylabel("GB/s (dashed: copy bandwidth)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"paged decode attention, heads {heads}, {dtype}")
    save_figure(fig, path)


def main(argv=None):
    parser = base_parser(__doc__)
    parser.add_argument("--impl", action="append", help="only these implementations")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
