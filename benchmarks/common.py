"""Shared benchmark plumbing: device naming, timing with a cold cache, copy bandwidth, and
writing JSON + CSV + markdown + PNG to a new run folder, benchmarks/runs/<time>-<device>/
(ignored by git), or where ``--out`` says: ``--out benchmarks/results/<device>/`` replaces
the committed results, which therefore change only on purpose."""

from __future__ import annotations

import argparse
import csv
import json
import platform
import re
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

RUNS = Path(__file__).resolve().parent / "runs"
_RUN_STARTED = time.strftime("%Y%m%d-%H%M%S")  # one folder for everything this process writes


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu} ({torch.get_num_threads()} threads)"


def device_slug(device: torch.device) -> str:
    """Folder name for a device's results: the GPU name, or cpu-<N>core."""
    if device.type == "cuda":
        return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")
    return f"cpu-{torch.get_num_threads()}core"


def environment(device: torch.device) -> dict:
    versions = {"torch": torch.__version__, "python": platform.python_version()}
    for mod in ("triton", "transformers", "flashinfer"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # absent or broken: say so
            versions[mod] = None
    return {"device": device_name(device), "command": " ".join(
        ["python"] + [shlex.quote(a) for a in sys.argv]), "versions": versions,
        "date": time.strftime("%Y-%m-%d %H:%M:%S")}


class Timer:
    """Median wall time of ``fn`` with warm-up and a flushed cache before every run.

    CUDA: CUDA events around each call, the L2 flushed by overwriting a 256 MiB buffer.
    CPU: perf_counter, the last-level cache flushed by overwriting a 64 MiB buffer.
    """

    def __init__(self, device: torch.device, warmup: int = 3, reps: int = 20):
        self.device, self.warmup, self.reps = device, warmup, reps
        flush_bytes = (256 if device.type == "cuda" else 64) << 20
        self._flush = torch.empty(flush_bytes // 4, dtype=torch.int32, device=device)

    def __call__(self, fn: Callable[[], object]) -> float:
        """Seconds (median)."""
        for _ in range(self.warmup):
            fn()
        times = []
        if self.device.type == "cuda":
            for _ in range(self.reps):
                self._flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
        else:
            for _ in range(self.reps):
                self._flush.add_(1)
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Measured device copy bandwidth in bytes/s (bytes read + bytes written per second)."""
    nbytes = nbytes or ((1 << 30) if device.type == "cuda" else (256 << 20))
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = Timer(device, warmup=2, reps=10)(lambda: dst.copy_(src))
    return 2 * nbytes / seconds


def read_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Measured device read bandwidth in bytes/s: a sum over a buffer far larger than the
    last-level cache (what a weight-streaming floor needs; copy bandwidth also pays for the
    writes)."""
    nbytes = nbytes or ((1 << 30) if device.type == "cuda" else (256 << 20))
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    return nbytes / Timer(device, warmup=2, reps=10)(lambda: src.sum())


def run_folder(device: torch.device) -> Path:
    """This process's own results folder, ``benchmarks/runs/<start time>-<device slug>/``: a
    run without ``--out`` never overwrites another run or the committed results."""
    return RUNS / f"{_RUN_STARTED}-{device_slug(device)}"


def write_results(name: str, device: torch.device, rows: list[dict], meta: dict,
                  columns: list[str], out_dir: Path | None = None) -> Path:
    """Write ``<name>.json`` (meta + rows), ``.csv`` and ``.md`` in ``out_dir`` (default
    :func:`run_folder`); returns the folder."""
    out = out_dir or run_folder(device)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    with open(out / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    lines = [f"# {name}", "", f"- device: {meta['device']}", f"- command: `{meta['command']}`",
             f"- versions: {meta['versions']}", f"- date: {meta['date']}"]
    lines += [f"- {k}: {v}" for k, v in meta.items()
              if k not in ("device", "command", "versions", "date")]
    shown = [r for r in rows if not str(r.get("status", "")).startswith("unavailable")]
    lines += ["", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in shown:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |")
    missing = sorted({(r.get("impl"), r["status"]) for r in rows if r not in shown})
    if missing:
        lines += ["", "Not run here:", ""] + [f"- {impl}: {why}" for impl, why in missing]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    return out


class Unavailable(Exception):
    """An implementation that cannot run here, with the reason."""


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def first_shape_ok_rows(rows: list[dict]) -> list[dict]:
    """The rows that ran ("ok") for the first (heads, dtype) measured: what a plot shows."""
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return []
    return [r for r in ok if (r["heads"], r["dtype"]) == (ok[0]["heads"], ok[0]["dtype"])]


def save_figure(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def publish(name: str, device: torch.device, rows: list[dict], meta: dict, columns: list[str],
            out_dir: str | None, plot: Callable[[list[dict], Path], None]) -> Path:
    """Write the tables (see :func:`write_results`) and ``<name>.png``; returns the folder."""
    out = write_results(name, device, rows, meta, columns, Path(out_dir) if out_dir else None)
    plot(rows, out / f"{name}.png")
    print(f"results in {out}")
    return out


def base_parser(doc: str) -> argparse.ArgumentParser:
    """The options every benchmark has: --device, --quick, --reps, --out, --no-progress."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes: checks the harness in seconds, not a measurement")
    parser.add_argument("--reps", type=int, default=20, help="timed runs per point (median)")
    parser.add_argument("--out", help="output folder (default: a new one, benchmarks/runs/"
                        "<time>-<device>/; benchmarks/results/<device>/ replaces the "
                        "committed results)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def check_backend(backend: str, device: torch.device, head_dim: int, *op_names: str) -> None:
    """Raise Unavailable unless cbatch's ``backend`` can be timed running every op named."""
    from cbatch import ops

    status = ops.available_backends()[backend]
    if not status.available:
        raise Unavailable(status.detail)
    if backend == "triton" and device.type != "cuda":
        raise Unavailable("Triton on the CPU runs only in its interpreter (not timed)")
    for op in op_names:
        try:
            ops.resolve_backend(op, device, backend, head_dim)
        except ValueError as e:
            raise Unavailable(str(e)) from e


def cbatch_impl(op: str, backend: str):
    """A builder for an implementation row: cbatch's ``op`` on ``backend``, or Unavailable."""
    from cbatch import ops

    def build(query, *args):
        check_backend(backend, query.device, query.shape[-1], op)
        fn = getattr(ops, op)
        return lambda: fn(query, *args, backend=backend)

    return build


def check_and_time(row: dict, build: Callable, inputs: tuple, truth: torch.Tensor, tol: float,
                   timer: Timer, metrics: Callable[[float], dict]) -> dict:
    """Fill ``row``: build the implementation, compare it with ``truth`` (max abs error), and
    time it only if it is right; ``metrics(seconds)`` adds the derived columns."""
    try:
        fn = build(*inputs)
        err = (fn().float() - truth).abs().max().item()
        row["max_err"] = err
        if not err <= tol:
            row["status"] = f"WRONG: max error {err:.3g} > {tol}"
        else:
            seconds = timer(fn)
            row.update({"us": seconds * 1e6, **metrics(seconds), "status": "ok"})
    except Unavailable as e:
        row["status"] = f"unavailable: {e}"
    except Exception as e:  # record it and go on with the other implementations
        row["status"] = f"error: {type(e).__name__}: {e}"[:200]
    return row


def paged_inputs(lens: list[int], H: int, D: int, dtype: torch.dtype, device: torch.device,
                 num_new: list[int] | None = None, block_size: int = 16, seed: int = 0):
    """Random query ``[sum(num_new), H, D]`` and a shuffled paged cache holding ``lens``
    tokens per sequence; returns query, key_cache, value_cache, block_tables, cu_seqlens_q,
    seq_lens (on ``device``)."""
    num_new = num_new or [1] * len(lens)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    needed = [-(-n // block_size) for n in lens]
    num_blocks = sum(needed) + 8
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), max(needed), dtype=torch.int32)
    offset = 0
    for s, n in enumerate(needed):
        tables[s, :n] = perm[offset:offset + n]
        offset += n
    shape = (num_blocks, block_size, H, D)
    # drawn where they live: gigabytes of cache are quick to draw on a GPU, slow on its host
    device = torch.device(device)
    data_gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size):
        return torch.randn(size, generator=data_gen, device=device, dtype=dtype)

    key_cache, value_cache = randn(*shape), randn(*shape)
    query = randn(sum(num_new), H, D)
    cu = torch.tensor([0] + torch.tensor(num_new).cumsum(0).tolist(), dtype=torch.int32)
    return (query, key_cache, value_cache, tables.to(device), cu.to(device),
            torch.tensor(lens, dtype=torch.int32, device=device))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return "" if v is None else str(v)
