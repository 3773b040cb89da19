"""One GPT-2 decode step at batch 1…256 beside its memory roofline.

    python benchmarks/bench_decode_step.py [--quick] [--context 512]

Times a full decode step (embedding, all layers with KV write and paged attention, final
norm, lm_head on the sampled rows) and prints the floor beside it: the bytes a decode step
must read — every weight once plus every sequence's KV cache — divided by the device's
measured copy bandwidth.  Results in benchmarks/results/<device>/decode_step.*.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (  # noqa: E402
    Timer, base_parser, copy_bandwidth, environment, publish, pyplot, save_figure)
from cbatch import GPT2LMHeadModel, KVCache, bytes_per_token  # noqa: E402
from cbatch.batch import make_step_batch  # noqa: E402

COLUMNS = ["batch", "context", "step_ms", "floor_ms", "ratio_to_floor", "weight_MB", "kv_MB",
           "tokens_per_s"]


def run(args) -> Path:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    model = GPT2LMHeadModel.from_pretrained(args.model, device=device, dtype=dtype,
                                            attention_backend=args.backend)
    cfg = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = copy_bandwidth(device, (64 << 20) if args.quick else None)
    timer = Timer(device, warmup=2, reps=3 if args.quick else args.reps)
    batches = [1, 4] if args.quick else args.batches
    context = 24 if args.quick else args.context
    rows = []
    for batch in tqdm(batches, desc="decode step", disable=args.no_progress):
        blocks = -(-(context + 1) // 16)
        cache = KVCache(cfg, batch * blocks, 16, dtype, device)
        tables = [list(range(s * blocks, (s + 1) * blocks)) for s in range(batch)]
        step = make_step_batch([[7]] * batch, [context] * batch, tables, 16, device)

        @torch.inference_mode()
        def decode():
            hidden = model(step, cache)
            return model.compute_logits(hidden[step.logits_indices])

        seconds = timer(decode)
        kv_bytes = batch * (context + 1) * bytes_per_token(cfg, dtype)
        floor = (weight_bytes + kv_bytes) / bw
        rows.append({"batch": batch, "context": context, "step_ms": seconds * 1e3,
                     "floor_ms": floor * 1e3, "ratio_to_floor": seconds / floor,
                     "weight_MB": weight_bytes / 1e6, "kv_MB": kv_bytes / 1e6,
                     "tokens_per_s": batch / seconds})
        print(f"batch {batch:4d}: {seconds * 1e3:8.2f} ms/step, floor {floor * 1e3:7.2f} ms "
              f"({seconds / floor:.1f}x)", flush=True)
    meta = {**environment(device), "model": args.model, "dtype": args.dtype,
            "copy_bandwidth_GBps": bw / 1e9,
            "attention_backend": args.backend or "auto",
            "floor": "(weight bytes + KV bytes read) / measured copy bandwidth"}
    return publish("decode_step", device, rows, meta, COLUMNS, args.out,
                   lambda rows, path: plot(rows, path, meta))


def plot(rows, path, meta):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    b = [r["batch"] for r in rows]
    ax.plot(b, [r["step_ms"] for r in rows], marker="o", label="cbatch decode step")
    ax.plot(b, [r["floor_ms"] for r in rows], ls="--", label="roofline floor")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch")
    ax.set_ylabel("ms per step")
    ax.set_title(f"{meta['model']} decode step, context {rows[0]['context']}, {meta['dtype']}")
    ax.legend()
    save_figure(fig, path)


def main(argv=None):
    parser = base_parser(__doc__)
    cuda = torch.cuda.is_available()
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--dtype", default="float16" if cuda else "float32")
    parser.add_argument("--backend", default=None, help="attention backend (default: auto)")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--batches", type=int, nargs="+",
                        default=[1, 2, 4, 8, 16, 32, 64, 128, 256] if cuda else [1, 4, 16, 64])
    args = parser.parse_args(argv)
    if args.quick and args.model == "random:gpt2":
        args.model = "random:tiny"
    return run(args)


if __name__ == "__main__":
    main()
