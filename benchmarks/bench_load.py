"""Load time and resident memory: a cold process to its first token, cbatch beside llama-server.

Each row is a process of its own.  cbatch's: ``import cbatch``, ``cbatch.LLM(model, ...)``
(quantized at load where a method is named), one greedy request of 4 prompt tokens and 1
output token; timed from the moment the parent starts the process (``cold_s``: the
interpreter, imports, load and first token) with the load (``load_s``) and the first token
(``first_token_s``) apart.  Resident memory after the first token, from /proc: ``rss`` (VmRSS),
split into ``anon`` (RssAnon: the process's own memory, what a second process would add) and
``file`` (RssFile: pages of mapped files, e.g. a checkpoint still mapped), and the peak
(``peak``, VmHWM: what loading and quantizing cost on the way).  ``weights`` is the bytes of
the model's weights (parameters and a quantized layer's packed integers, scales, zeros and
mins).

A GGUF file's packed model and tokenizer are cached after a first start
(:mod:`cbatch.file_cache`), so each rep runs cbatch as ``--cache`` says: ``off``
(``CBATCH_FILE_CACHE=0``: made from the file), ``write`` (an empty cache: made, then written)
and ``read`` (read back from what ``write`` left), each in a cache folder of the run's own.

``--llama-server PATH`` adds llama.cpp's row on the same ``.gguf`` (``--model`` must be one):
the server started with 2 threads, one slot and the same context (``--kv-tokens``), timed from
its start to its /health and then to its first token (/completion of the same 4 ids, 1
token); its memory from /proc/<pid>/status.  Both hold a KV cache of ``--kv-tokens`` tokens.

    python benchmarks/bench_load.py --model random:smollm2-360m --dtype bfloat16 \\
        --methods none int8 int4 w4a8
    python benchmarks/bench_load.py --model smollm2-360m-Q4_K_M.gguf --methods none w4a8 \\
        --llama-server llama.cpp/build/bin/llama-server --reps 2 --out load.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

PROMPT = [1, 2, 3, 4]
FIELDS = {"rss": "VmRSS", "anon": "RssAnon", "file": "RssFile", "peak": "VmHWM"}


def memory(pid: int | str = "self") -> dict[str, int]:
    """The process's resident memory in bytes (Linux /proc/<pid>/status)."""
    status = dict(line.split(":", 1) for line in
                  Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {key: int(status[field].split()[0]) * 1024 for key, field in FIELDS.items()}


def child(args, method: str, started: float) -> dict:
    """This process: cbatch's row (``started``: the parent's clock when it started us)."""
    t0 = time.time()
    import torch

    import cbatch
    from cbatch import file_cache
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.bench_decode_step import model_weight_bytes

    t1 = time.time()
    cached = len(list(file_cache.root().glob("model/*/*")))  # entries there before the load
    block_size = 16
    llm = cbatch.LLM(args.model, dtype=getattr(torch, args.dtype), threads=args.threads,
                     num_blocks=args.kv_tokens // block_size, block_size=block_size,
                     quantization=None if method == "none" else method)
    t2 = time.time()
    out = llm.generate([PROMPT], cbatch.SamplingParams(max_tokens=1, ignore_eos=True))
    t3 = time.time()
    assert len(out[0].token_ids) == 1
    return {"engine": "cbatch", "method": method, "dtype": args.dtype,
            "cold_s": t3 - started, "start_s": t0 - started, "import_s": t1 - t0,
            "load_s": t2 - t1, "first_token_s": t3 - t2,
            "weights": model_weight_bytes(llm.engine.model), "entries_before": cached,
            **memory()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_server(args) -> dict:
    """llama-server's row on ``args.model`` (a .gguf): start, /health, one token."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    started = time.time()
    proc = subprocess.Popen([args.llama_server, "-m", args.model, "--host", "127.0.0.1",
                             "--port", str(port), "-t", str(args.threads), "-c",
                             str(args.kv_tokens), "--parallel", "1", "--no-warmup"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = started + 600
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"llama-server exited with {proc.returncode} while loading")
            if time.time() > deadline:
                raise SystemExit("llama-server not healthy after 600 s")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.05)
        healthy = time.time()
        body = json.dumps({"prompt": PROMPT, "n_predict": 1, "ignore_eos": True,
                           "temperature": 0.0}).encode()
        request = urllib.request.Request(f"{url}/completion", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as r:
            reply = json.loads(r.read())
        done = time.time()
        assert reply.get("tokens_predicted", 1) == 1, reply
        return {"engine": "llama-server", "method": "file", "dtype": "-",
                "cold_s": done - started, "load_s": healthy - started,
                "first_token_s": done - healthy, "weights": None, **memory(proc.pid)}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def run(args) -> list[dict]:
    rows = []
    root = Path(tempfile.mkdtemp(prefix="bench-load-cache-"))
    try:
        for rep in range(args.reps):
            for method in args.methods:
                for cache in args.cache:
                    if cache == "write":
                        shutil.rmtree(root / "model", ignore_errors=True)
                        shutil.rmtree(root / "tokenizer", ignore_errors=True)
                    env = dict(os.environ)  # the child's cache: this run's folder
                    env.update(CBATCH_CACHE_ROOT=str(root),
                               CBATCH_FILE_CACHE="0" if cache == "off" else "1")
                    started = time.time()
                    out = subprocess.run(
                        [sys.executable, __file__, "--model", args.model, "--dtype",
                         args.dtype, "--kv-tokens", str(args.kv_tokens), "--threads",
                         str(args.threads), "--child", method, str(started)],
                        check=True, capture_output=True, text=True, env=env).stdout
                    rows.append({"rep": rep, "cache": cache,
                                 **json.loads(out.strip().splitlines()[-1])})
            if args.llama_server:
                rows.append({"rep": rep, "cache": "-", **llama_server(args)})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def report(rows: list[dict], model: str) -> None:
    """The best (least cold time) of each row's reps; MB."""
    best: dict[tuple, dict] = {}
    for r in rows:
        key = (r["engine"], r["method"], r.get("cache", "-"))
        if key not in best or r["cold_s"] < best[key]["cold_s"]:
            best[key] = r
    reps = 1 + max(r["rep"] for r in rows)
    print(f"{model}: cold process to first token (best of {reps}); memory after it, MB")
    print(f"{'engine':13s} {'method':7s} {'cache':5s} {'cold s':>7s} {'load s':>7s} "
          f"{'1st tok':>7s} {'weights':>8s} {'RSS':>7s} {'anon':>7s} {'file':>7s} {'peak':>7s}")
    for r in best.values():
        weights = "-" if r["weights"] is None else f"{r['weights'] / 1e6:.0f}"
        print(f"{r['engine']:13s} {r['method']:7s} {r.get('cache', '-'):5s} "
              f"{r['cold_s']:7.2f} {r['load_s']:7.2f} "
              f"{r['first_token_s']:7.2f} {weights:>8s} {r['rss'] / 1e6:7.0f} "
              f"{r['anon'] / 1e6:7.0f} {r['file'] / 1e6:7.0f} {r['peak'] / 1e6:7.0f}")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:smollm2-360m",
                        help="random:<shape>, a checkpoint directory or a .gguf file")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--methods", nargs="+", default=["none"],
                        help="none (the model as it is) or a quantization method each")
    parser.add_argument("--kv-tokens", type=int, default=1024,
                        help="the KV cache's tokens, the same for every engine")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", nargs="+", choices=["off", "write", "read"],
                        help="cbatch's file cache in each rep's runs, in this order (read "
                             "needs a write before it; default: off write read for a .gguf, "
                             "else off)")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--llama-server", help="llama-server's binary: a row on the same .gguf")
    parser.add_argument("--out", help="append the rows as JSON lines")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # method, parent's clock
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args, args.child[0], float(args.child[1]))))
        return []
    if args.llama_server and not args.model.endswith(".gguf"):
        parser.error("--llama-server needs --model to be a .gguf file")
    args.cache = args.cache or (["off", "write", "read"] if args.model.endswith(".gguf")
                                else ["off"])
    if "read" in args.cache and "write" not in args.cache[:args.cache.index("read")]:
        parser.error("--cache read needs a write before it")
    rows = run(args)
    report(rows, args.model)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps({"model": args.model, **r}) + "\n" for r in rows)
    return rows


if __name__ == "__main__":
    main()
