"""One GPT-2 decode step at batch 1…256 beside its memory roofline.

    python benchmarks/bench_decode_step.py [--quick] [--context 512]

Times the model runner's decode step (step buffers filled, embedding, all layers with KV
write and paged attention, final norm, lm_head, greedy sampling, tokens back on the host),
eager and with CUDA graphs, and prints the floor beside it: the bytes a decode step
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
from cbatch import Engine, GPT2LMHeadModel, SamplingParams, bytes_per_token  # noqa: E402
from cbatch.core.scheduler import ScheduledSequence  # noqa: E402
from cbatch.core.sequence import Sequence  # noqa: E402

COLUMNS = ["mode", "batch", "context", "step_ms", "floor_ms", "ratio_to_floor", "weight_MB",
           "kv_MB", "tokens_per_s"]


def decode_items(engine: Engine, batch: int, context: int) -> list[ScheduledSequence]:
    """``batch`` running sequences of ``context`` cached tokens, each with one token to
    decode, their blocks taken from the engine's pool."""
    items = []
    for s in range(batch):
        seq = Sequence(str(s), [7] * (context + 1), SamplingParams(), s)
        engine.block_manager.grow(seq.block_table, seq.num_tokens)
        seq.num_computed_tokens = context
        items.append(ScheduledSequence(seq, 1))
    return items


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
    blocks = -(-(context + 1) // 16)
    # eager: the step batch in persistent buffers, the model run op by op; graphs: decode
    # steps padded to a bucket and replayed from a CUDA graph (on the CPU: the padded
    # batch run eagerly, which shows the padding's cost)
    modes = {"eager": False, "graphs": True}
    rows = []
    for mode, graphs in modes.items():
        engine = Engine(model, cuda_graphs=graphs, max_num_seqs=max(batches),
                        num_blocks=max(batches) * blocks, block_size=16)
        for batch in tqdm(batches, desc=f"decode step ({mode})", disable=args.no_progress):
            items = decode_items(engine, batch, context)

            def decode():  # what the engine's step does between scheduling and bookkeeping
                return engine.runner.execute(engine.runner.prepare(items), items)

            seconds = timer(decode)
            for item in items:
                engine.block_manager.free(item.seq.block_table)
            kv_bytes = batch * (context + 1) * bytes_per_token(cfg, dtype)
            floor = (weight_bytes + kv_bytes) / bw
            rows.append({"mode": mode, "batch": batch, "context": context,
                         "step_ms": seconds * 1e3, "floor_ms": floor * 1e3,
                         "ratio_to_floor": seconds / floor, "weight_MB": weight_bytes / 1e6,
                         "kv_MB": kv_bytes / 1e6, "tokens_per_s": batch / seconds})
            print(f"{mode:6s} batch {batch:4d}: {seconds * 1e3:8.2f} ms/step, floor "
                  f"{floor * 1e3:7.2f} ms ({seconds / floor:.1f}x)", flush=True)
        stats = engine.stats()
        print(f"{mode}: graph capture {stats.graph_capture_s:.2f} s, "
              f"{stats.graph_memory_bytes / 1e6:.1f} MB", flush=True)
        engine = None  # its cache and graph pool go before the next mode builds its own
    meta = {**environment(device), "model": args.model, "dtype": args.dtype,
            "copy_bandwidth_GBps": bw / 1e9,
            "attention_backend": args.backend or "auto",
            "step": "prepare (step buffers) + forward + greedy sampling + tokens to the host",
            "floor": "(weight bytes + KV bytes read) / measured copy bandwidth"}
    return publish("decode_step", device, rows, meta, COLUMNS, args.out,
                   lambda rows, path: plot(rows, path, meta))


def plot(rows, path, meta):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        ax.plot([r["batch"] for r in mine], [r["step_ms"] for r in mine], marker="o",
                label=f"cbatch decode step ({mode})")
    floor = [r for r in rows if r["mode"] == rows[0]["mode"]]
    ax.plot([r["batch"] for r in floor], [r["floor_ms"] for r in floor], ls="--",
            label="roofline floor")
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
