"""One decode step (GPT-2 by default, any model with ``--model``, its weights quantized with
``--quantization``) at batch 1…256 beside its memory roofline.

    python benchmarks/bench_decode_step.py [--quick] [--context 512] [--model random:smollm2-360m
        --dtype bfloat16 --quantization int4 --modes eager]

Times the engine's whole decode step, ``Engine.step()`` with every running request
decoding (schedule, step buffers, embedding, all layers with KV write and paged attention,
final norm, lm_head, greedy sampling, tokens on the host; requests not streamed, as in
``LLM.generate``), as wall time over ``--reps`` consecutive steps, in three modes:

- ``eager``: the model run op by op, one step at a time;
- ``graphs``: decode steps padded to a batch-size bucket and replayed from a CUDA graph (on
  the CPU the padded batch runs eagerly, which shows the padding's cost);
- ``async``: graphs, and step n+1 scheduled and launched before step n's tokens are read.

Beside each: ``host_ms``, the step's time outside the model and the wait for the device
(``Engine.stats().phase_s``), and the floor: the bytes a decode step must read (every weight
once plus every sequence's KV cache) divided by the device's measured copy bandwidth; and the
time of reading the weights alone at the measured read bandwidth (``weight_read_ms``, issue 50's
yardstick for quantized weights: packed integers, scales and zero points counted).  The read
bandwidth is sampled before each of 5 runs of a batch size's steps and each run is compared
with the sample just before it (``ratio_to_weight_read``: the median of those): a 2-core
cloud machine's read bandwidth drifts by half from minute to minute.  ``--amx off`` keeps the
CPU kernels off AMX tiles (W8A8 takes AMX-INT8 from 8 rows where the CPU has it), to compare.
Results in decode_step.*, written to a new folder under benchmarks/runs/ or to --out.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (  # noqa: E402
    base_parser, copy_bandwidth, environment, publish, pyplot, read_bandwidth, save_figure)
from cbatch import Engine, SamplingParams, bytes_per_token, load_model  # noqa: E402
from cbatch.quantization import ONLINE as QUANTIZATION_METHODS  # noqa: E402
from cbatch.ops import compiled, cpu  # noqa: E402

COLUMNS = ["mode", "batch", "context", "step_ms", "host_ms", "floor_ms", "ratio_to_floor",
           "read_GBps", "weight_read_ms", "ratio_to_weight_read",
           "weight_MB", "kv_MB", "tokens_per_s"]
ROUNDS = 5  # runs of steps a batch size's reps are cut into, a read-bandwidth sample before each
MODES = {"eager": dict(cuda_graphs=False, async_scheduling=False),
         "graphs": dict(cuda_graphs=True, async_scheduling=False),
         "async": dict(cuda_graphs=True, async_scheduling=True)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_decode_steps(engine: Engine, batch: int, context: int, reps: int,
                      gen: torch.Generator, rounds: int = 1,
                      between: Callable[[], object] | None = None
                      ) -> tuple[float, float, list[float]]:
    """Seconds per step and host seconds per step of ``reps`` consecutive decode steps of
    ``batch`` requests with ``context``-token random prompts (prefilled first, untimed), and
    the seconds per step of each of ``rounds`` runs of about ``reps / rounds`` of them;
    ``between()``, untimed, before each run (a read-bandwidth sample beside the steps)."""
    vocab = engine.model.config.vocab_size
    prefill_steps = -(-batch * context // engine.config.max_num_batched_tokens)
    params = SamplingParams(max_tokens=prefill_steps + reps + 8, ignore_eos=True)
    ids = [engine.add_request(torch.randint(0, vocab, (context,), generator=gen).tolist(),
                              params, stream=False) for _ in range(batch)]  # as generate()
    running = engine.scheduler.running
    for _ in range(prefill_steps + 4):  # prefill, then two steps with every request decoding
        engine.step()
    if len(running) != batch or not all(seq.is_decoding for seq in running):
        raise RuntimeError(f"{batch} requests are not all decoding after the prefill steps")
    seconds, host, per_round = 0.0, 0.0, []
    for r in range(rounds):
        steps = reps * (r + 1) // rounds - reps * r // rounds
        if between is not None:
            between()
        sync(engine.model.device)
        before, start = engine.stats(), time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(engine.model.device)
        elapsed, after = time.perf_counter() - start, engine.stats()
        seconds += elapsed
        per_round.append(elapsed / steps)
        host += (after.elapsed - after.phase_s["execute"]) - (
            before.elapsed - before.phase_s["execute"])
    for rid in ids:
        engine.abort(rid, report=False)
    while engine.has_unfinished_requests():  # bounded: nothing is left to schedule
        engine.step()
    return seconds / reps, host / reps, per_round


def model_weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of every weight a decode step reads once: the parameters, and a quantized
    layer's packed integers, scales and zero points (buffers of
    :class:`cbatch.layers.quantization.QuantizedLinear`)."""
    from cbatch.layers.quantization import QuantizedLinear

    packed = sum(b.numel() * b.element_size() for m in model.modules()
                 if isinstance(m, QuantizedLinear) for b in m.buffers(recurse=False))
    return packed + sum(p.numel() * p.element_size() for p in model.parameters())


def run(args) -> Path:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.amx == "off" and device.type == "cpu":  # the kernels' AMX paths (W8A8's tiles)
        torch.ops.cbatch.set_cpu_options(*compiled._cpu_options(), "off")
    model = load_model(args.model, device=device, dtype=dtype, attention_backend=args.backend,
                       quantization=args.quantization)
    cfg = model.config
    weight_bytes = model_weight_bytes(model)
    bw = copy_bandwidth(device, (64 << 20) if args.quick else None)
    read_bytes = (64 << 20) if args.quick else None
    reps = 3 if args.quick else args.reps
    rounds = min(reps, ROUNDS)
    batches = [1, 4] if args.quick else args.batches
    context = 24 if args.quick else args.context
    budget = 8192
    longest = context + -(-max(batches) * context // budget) + reps + 8  # see time_decode_steps
    blocks = max(batches) * -(-longest // 16)
    rows = []
    for mode, switches in ((m, MODES[m]) for m in args.modes):
        engine = Engine(model, max_num_seqs=max(batches), max_num_batched_tokens=budget,
                        num_blocks=blocks, block_size=16, enable_prefix_caching=False,
                        **switches)
        gen = torch.Generator().manual_seed(0)
        for batch in tqdm(batches, desc=f"decode step ({mode})", disable=args.no_progress):
            reads = []  # the read bandwidth sampled before each run of steps
            seconds, host, per_round = time_decode_steps(
                engine, batch, context, reps, gen, rounds,
                lambda: reads.append(read_bandwidth(device, read_bytes)))
            read_bw = statistics.median(reads)
            ratio = statistics.median(s * r / weight_bytes for s, r in zip(per_round, reads))
            kv_bytes = batch * (context + 1) * bytes_per_token(cfg, dtype)
            floor = (weight_bytes + kv_bytes) / bw
            rows.append({"mode": mode, "batch": batch, "context": context,
                         "step_ms": seconds * 1e3, "host_ms": host * 1e3,
                         "floor_ms": floor * 1e3, "ratio_to_floor": seconds / floor,
                         "read_GBps": read_bw / 1e9,
                         "weight_read_ms": weight_bytes / read_bw * 1e3,
                         "ratio_to_weight_read": ratio,
                         "weight_MB": weight_bytes / 1e6, "kv_MB": kv_bytes / 1e6,
                         "tokens_per_s": batch / seconds})
            print(f"{mode:6s} batch {batch:4d}: {seconds * 1e3:8.2f} ms/step "
                  f"(host {host * 1e3:6.2f} ms), floor {floor * 1e3:7.2f} ms "
                  f"({seconds / floor:.1f}x; {ratio:.2f}x the weights' read at "
                  f"{read_bw / 1e9:.1f} GB/s)", flush=True)
        stats = engine.stats()
        print(f"{mode}: graph capture {stats.graph_capture_s:.2f} s, "
              f"{stats.graph_memory_bytes / 1e6:.1f} MB", flush=True)
        engine = None  # its cache and graph pool go before the next mode builds its own
    meta = {**environment(device), "model": args.model, "dtype": args.dtype,
            "quantization": args.quantization, "amx": args.amx or "where the CPU has it",
            "cpu_isa": cpu.cpu_isa() if device.type == "cpu" else None,
            "copy_bandwidth_GBps": bw / 1e9,
            "attention_backend": args.backend or "auto", "reps": reps,
            "step": "Engine.step() with every request decoding, wall time over reps "
                    "consecutive steps",
            "host_ms": "Engine.stats(): elapsed - phase_s['execute'] per step",
            "floor": "(weight bytes + KV bytes read) / measured copy bandwidth",
            "weight_read": f"weight bytes / the read bandwidth (a sum over 256 MiB) sampled "
                           f"before each of {rounds} runs of the steps (their median); "
                           f"ratio_to_weight_read: the median of each run's step time over "
                           f"the read just before it, as the machine's bandwidth drifts"}
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
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                        help="which step modes to time (default: all three)")
    parser.add_argument("--quantization", choices=QUANTIZATION_METHODS, default=None,
                        help="online weight quantization of the decoder layers (CPU)")
    parser.add_argument("--amx", choices=["", "off"], default="",
                        help="off: the CPU kernels take no AMX tiles (to compare W8A8's tiles "
                             "with its VNNI path on an AMX CPU)")
    parser.add_argument("--context", type=int, default=512 if cuda else 128)
    parser.add_argument("--batches", type=int, nargs="+",
                        default=[1, 2, 4, 8, 16, 32, 64, 128, 256] if cuda else [1, 4, 16, 64])
    args = parser.parse_args(argv)
    if args.quick and args.model == "random:gpt2":
        args.model = "random:tiny"
    return run(args)


if __name__ == "__main__":
    main()
