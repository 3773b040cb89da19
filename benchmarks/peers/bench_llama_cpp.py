"""llama.cpp's llama-server on cbatch's workloads (CPU, 2 threads, continuous batching).

Runs with any Python 3 (standard library only; see benchmarks/peers/README.md for the build):

    python bench_llama_cpp.py --server llama.cpp/build/bin/llama-server --model m-f16.gguf \
        --workloads workloads.json --workload seed|longtail [--reps 2] [--no-prefix-caching] \
        [--temperature 0.8 --top-p 0.95 --seed 0]

Model: a GGUF of a random-weight checkpoint (make_random_checkpoint.py, then llama.cpp's
convert_hf_to_gguf.py --outtype f16, then llama-quantize to Q8_0 or Q4_0).  The server starts
with --parallel = the workload's batch size (as max_num_seqs elsewhere), continuous batching,
a KV cache of each slot's own big enough for its longest request (llama-server's default for a
given --parallel; ``--kv-unified`` shares one cache, as the runs before 2026-12-07 did: every
slot's decode then attends over all of it, masked, which cost llama-server 2.4x at 64 slots in
benchmarks/NOTES.md, "Serving long prompts beside llama-server"), 2 threads.  Every request
goes to /completion at once, each on its own connection (the server queues those beyond its
slots): the token-id prompt (no BOS added to an id array), n_predict = max_tokens exactly
(ignore_eos; the response's token ids are counted), greedy (temperature 0), or with
--temperature > 0 sampled at that temperature then top-p (samplers ["temperature", "top_p"]:
vLLM's and cbatch's order; top-k and min-p off, no penalties), request i seeded --seed + i.
Timed from the first request sent to the last response read.  Load and a 2-request warm-up
are not timed; every slot's cached prompt is erased before each timed run (llama.cpp's
prefix reuse, cache_prompt, stays on unless --no-prefix-caching; its RAM prompt cache is off,
--cache-ram 0, so nothing survives an erase).
"""
import argparse
import json
import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor


def post(url: str, body: dict | None = None, timeout: float = 3600) -> dict:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(url: str, proc: subprocess.Popen, limit_s: float = 600) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited with {proc.returncode} while loading")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"llama-server not ready after {limit_s:.0f}s")


def request_body(prompt, max_tokens: int, i: int, args) -> dict:
    body = {"prompt": prompt, "n_predict": max_tokens, "ignore_eos": True,
            "return_tokens": True, "cache_prompt": not args.no_prefix_caching,
            "stream": False, "repeat_penalty": 1.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "dry_multiplier": 0.0, "xtc_probability": 0.0,
            "typical_p": 1.0, "top_k": 0, "min_p": 0.0}
    if args.temperature > 0:
        body.update(temperature=args.temperature, top_p=args.top_p, seed=args.seed + i,
                    samplers=["temperature", "top_p"])
    else:
        body.update(temperature=0.0, top_p=1.0, seed=0)
    return body


def run_batch(url: str, prompts, max_tokens, args) -> tuple[float, list[list[int]]]:
    bodies = [request_body(p, m, i, args) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        t0 = time.perf_counter()
        outs = list(pool.map(lambda b: post(f"{url}/completion", b), bodies))
        dt = time.perf_counter() - t0
    return dt, [list(o["tokens"]) for o in outs]


def erase_slots(url: str, parallel: int) -> None:
    for slot in range(parallel):
        post(f"{url}/slots/{slot}?action=erase")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", required=True, help="the llama-server binary")
    ap.add_argument("--model", required=True, help="the GGUF file")
    ap.add_argument("--workloads", required=True, help="workloads.json from workloads.py")
    ap.add_argument("--workload", choices=["seed", "longtail"], required=True)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--scale-down", type=int, default=0, help="keep only the first N requests")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-unified", action="store_true",
                    help="one KV cache shared by every slot (the runs before 2026-12-07)")
    ap.add_argument("--port", type=int, default=8097)
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="cache_prompt false: no slot reuses a previous prompt's KV")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1 = off)")
    ap.add_argument("--seed", type=int, default=0,
                    help="request i samples with seed SEED + i (when --temperature > 0)")
    args = ap.parse_args()

    with open(args.workloads) as f:
        wl = json.load(f)[args.workload]
    prompts, max_tokens, parallel = wl["prompts"], wl["max_tokens"], wl["batch_size"]
    if args.scale_down:
        prompts, max_tokens = prompts[:args.scale_down], max_tokens[:args.scale_down]
    longest = max(len(p) + m for p, m in zip(prompts, max_tokens))
    per_slot = -(-(longest + 16) // 256) * 256  # room for each slot's longest request
    cmd = [args.server, "-m", args.model, "--host", "127.0.0.1", "--port", str(args.port),
           "--threads", str(args.threads), "--threads-batch", str(args.threads),
           "--parallel", str(parallel), "--cont-batching",
           *(["--kv-unified"] if args.kv_unified else []),
           "--ctx-size", str(per_slot * parallel), "--cache-ram", "0", "--no-webui",
           "--slot-save-path", tempfile.mkdtemp(prefix="llama-slots-")]  # enables erase
    url = f"http://127.0.0.1:{args.port}"
    print(f"llama-server: {' '.join(cmd)}")
    print(f"workload={args.workload} requests={len(prompts)} output_tokens={sum(max_tokens)} "
          f"parallel={parallel} temperature={args.temperature} top_p={args.top_p} "
          f"seed={args.seed}")
    log = open(os.devnull if not os.environ.get("LLAMA_LOG") else os.environ["LLAMA_LOG"], "w")
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, proc)
        with urllib.request.urlopen(f"{url}/props", timeout=10) as r:
            props = json.loads(r.read())
        print(f"load {time.perf_counter() - t:.1f}s  build {props.get('build_info', '?')}  "
              f"slots {props.get('total_slots', '?')}")
        wdt, wout = run_batch(url, [prompts[0], prompts[-1]], [8, 8], args)
        assert all(len(o) == 8 for o in wout), [len(o) for o in wout]
        print(f"warm-up {wdt:.2f}s")
        rates, first = [], None
        for rep in range(args.reps):
            erase_slots(url, parallel)  # each rep starts cold, as cbatch's runs do
            dt, outs = run_batch(url, prompts, max_tokens, args)
            bad = [(i, len(o), m) for i, (o, m) in enumerate(zip(outs, max_tokens))
                   if len(o) != m]
            if bad:
                raise SystemExit(f"token count mismatch (request, got, want): {bad[:10]}")
            first = first or outs
            got = sum(len(o) for o in outs)
            rates.append(got / dt)
            print(f"rep {rep}: wall {dt:.3f}s  output_tokens {got}  tok/s {got / dt:.1f}  "
                  f"same_as_rep0={outs == first}")
        print(f"first request's first 8 ids: {first[0][:8]}")
        print(f"RESULT workload={args.workload} model={os.path.basename(args.model)} "
              f"temperature={args.temperature} top_p={args.top_p} reps={args.reps} "
              f"best_tok_s={max(rates):.1f}")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
