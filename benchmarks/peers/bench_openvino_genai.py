"""OpenVINO GenAI's ContinuousBatchingPipeline on cbatch's workloads (CPU, 2 threads).

Runs in OpenVINO GenAI's own virtualenv, not cbatch's (see benchmarks/peers/README.md):

    python bench_openvino_genai.py --model gpt2-random-ov --workloads workloads.json \
        --workload seed|longtail --precision fp32|bf16 [--reps 2] [--prefix-caching] \
        [--temperature 0.8 --top-p 0.95 --seed 0]

Model: an IR of a random-weight checkpoint (make_gpt2_random.py or make_random_checkpoint.py,
then optimum-cli; --weight-format fp32, int8 or int4: the IR's weights, --precision the
activations' and the KV cache's).
Every request: exactly max_tokens new tokens (ignore_eos, min_new_tokens = max_new_tokens),
the token-id prompts of workloads.json (workloads.py), all submitted at the start, then
step() until done; greedy, or with --temperature > 0 sampled (do_sample) at that temperature
and --top-p (top-k off), request i with its own rng_seed --seed + i (as bench_throughput.py
and bench_vllm_cpu.py do).  Load, compile and a 2-request warm-up are not timed.
"""
import argparse
import json
import math
import time

import numpy as np
import openvino as ov
import openvino_genai as ov_genai

KV_BLOCK = 32  # CPU paged-attention block size (used only to size the cache with slack)

PRECISIONS = {
    # f32 compute, f32 KV cache (KV_CACHE_PRECISION sets both key and value on CPU; the
    # separate key/value properties are set too so nothing falls back to the u8 default).
    "fp32": ({"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32",
              "KEY_CACHE_PRECISION": "f32", "VALUE_CACHE_PRECISION": "f32"}, 4),
    # bf16 compute, the plugin's default KV cache precision (it reports u8; the cache use
    # measured in 2026.4.1 was that of bf16, half of f32's).
    "bf16": ({"INFERENCE_PRECISION_HINT": "bf16"}, 4),  # size cache as if f32: safe upper bound
}


def kv_floats_per_token(model_dir: str) -> int:
    """K and V numbers per token over all layers, from the IR's config.json (optimum-cli
    copies the checkpoint's): GPT-2's n_layer x n_embd, or Llama's layers x KV heads x
    head_dim."""
    with open(f"{model_dir}/config.json") as f:
        c = json.load(f)
    if "n_layer" in c:
        return 2 * c["n_layer"] * c["n_embd"]
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * kv_heads * head_dim


def make_config(max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                seed: int = 0) -> ov_genai.GenerationConfig:
    """Exactly max_new_tokens tokens, no penalties; greedy at temperature 0, else sampled
    with top_p and top-k off, from the request's own random stream (rng_seed)."""
    g = ov_genai.GenerationConfig()
    g.do_sample = temperature > 0
    if g.do_sample:
        g.temperature = temperature
        g.top_p = top_p
        # top_k stays at its default, off (as vLLM's and cbatch's default)
        g.rng_seed = seed
    g.num_beams = 1
    g.num_return_sequences = 1
    g.max_new_tokens = max_new_tokens
    g.min_new_tokens = max_new_tokens
    g.ignore_eos = True
    g.repetition_penalty = 1.0
    g.presence_penalty = 0.0
    g.frequency_penalty = 0.0
    return g


def to_tensor(ids):
    return ov.Tensor(np.asarray([ids], dtype=np.int64))


def run_batch(pipe, prompts, max_tokens, first_id, args):
    """Submit all requests, step until done; return (seconds, per-request generated ids).
    Request i samples (if args.temperature > 0) with seed args.seed + i."""
    configs = [make_config(m, args.temperature, args.top_p, args.seed + i)
               for i, m in enumerate(max_tokens)]
    tensors = [to_tensor(p) for p in prompts]
    t0 = time.perf_counter()
    handles = [pipe.add_request(first_id + i, t, c)
               for i, (t, c) in enumerate(zip(tensors, configs))]
    while pipe.has_non_finished_requests():
        pipe.step()
    dt = time.perf_counter() - t0
    outs = []
    for h in handles:
        res = h.read_all()
        assert len(res) == 1, len(res)
        outs.append(list(res[0].generated_ids))
    return dt, outs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the OpenVINO IR directory")
    ap.add_argument("--workloads", required=True, help="workloads.json from workloads.py")
    ap.add_argument("--workload", choices=["seed", "longtail"], required=True)
    ap.add_argument("--precision", choices=sorted(PRECISIONS), required=True)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--scale-down", type=int, default=0, help="keep only the first N requests")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--max-num-batched-tokens", type=int, default=256,
                    help="scheduler token budget per step (GenAI default 256)")
    ap.add_argument("--kv-precision", default=None,
                    help="KV cache precision (u8, bf16, f32; default: per --precision)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1 = off)")
    ap.add_argument("--seed", type=int, default=0,
                    help="request i samples with rng_seed SEED + i (when --temperature > 0)")
    args = ap.parse_args()

    with open(args.workloads) as f:
        wl = json.load(f)[args.workload]
    prompts, max_tokens, batch_size = wl["prompts"], wl["max_tokens"], wl["batch_size"]
    if args.scale_down:
        prompts, max_tokens = prompts[:args.scale_down], max_tokens[:args.scale_down]
    n_out = sum(max_tokens)

    props, kv_bytes = PRECISIONS[args.precision]
    props = dict(props, INFERENCE_NUM_THREADS=args.threads, NUM_STREAMS=1)
    if args.kv_precision:
        props.update(KV_CACHE_PRECISION=args.kv_precision, KEY_CACHE_PRECISION=args.kv_precision,
                     VALUE_CACHE_PRECISION=args.kv_precision)

    # KV cache big enough for every request at once (blocks rounded up, 1.5x slack).
    tokens = sum(math.ceil((len(p) + m) / KV_BLOCK) * KV_BLOCK for p, m in zip(prompts, max_tokens))
    need = tokens * kv_floats_per_token(args.model) * kv_bytes * 1.5
    cache_gb = max(1, math.ceil(need / 2**30))

    sc = ov_genai.SchedulerConfig()
    sc.max_num_seqs = batch_size
    sc.max_num_batched_tokens = args.max_num_batched_tokens
    sc.cache_size = cache_gb
    sc.dynamic_split_fuse = True
    sc.enable_prefix_caching = args.prefix_caching

    print(f"openvino {ov.__version__}  openvino-genai {ov_genai.__version__}")
    print(f"workload={args.workload} requests={len(prompts)} output_tokens={n_out} "
          f"prompt_tokens={sum(map(len, prompts))} precision={args.precision} "
          f"temperature={args.temperature} top_p={args.top_p} seed={args.seed} props={props}")
    print(sc.to_string().replace("\n", " "))

    t = time.perf_counter()
    pipe = ov_genai.ContinuousBatchingPipeline(args.model, sc, "CPU", props)
    print(f"load+compile {time.perf_counter() - t:.1f}s")

    # Warm-up: 2 short requests (untimed).
    wdt, wout = run_batch(pipe, [prompts[0], prompts[-1]], [8, 8], first_id=10_000_000,
                           args=args)
    assert all(len(o) == 8 for o in wout), [len(o) for o in wout]
    print(f"warm-up {wdt:.2f}s")

    rates = []
    first_outs = None
    for rep in range(args.reps):
        dt, outs = run_batch(pipe, prompts, max_tokens, first_id=rep * 100_000, args=args)
        bad = [(i, len(o), m) for i, (o, m) in enumerate(zip(outs, max_tokens)) if len(o) != m]
        if bad:
            raise SystemExit(f"token count mismatch (request, got, want): {bad[:10]}")
        got = sum(len(o) for o in outs)
        if first_outs is None:
            first_outs = outs
        same = outs == first_outs
        m = pipe.get_metrics()
        rates.append(got / dt)
        print(f"rep {rep}: wall {dt:.3f}s  output_tokens {got}  tok/s {got / dt:.1f}  "
              f"all_exact=True  same_as_rep0={same}  "
              f"kv_cache_bytes={m.kv_cache_size_in_bytes} max_cache_usage={m.max_cache_usage:.1f}%")
    print(f"first request's first 8 ids: {first_outs[0][:8]}")
    print(f"RESULT workload={args.workload} precision={args.precision} "
          f"temperature={args.temperature} top_p={args.top_p} reps={args.reps} "
          f"best_tok_s={max(rates):.1f} mean_tok_s={sum(rates) / len(rates):.1f}")


if __name__ == "__main__":
    main()
