"""End-to-end throughput on the standard workloads, cbatch beside transformers, one run.

    python benchmarks/bench_throughput.py                       # seed, longtail, uniform
    python benchmarks/bench_throughput.py --workload sharedprefix --scale 0.25
    python benchmarks/bench_throughput.py --workload seed --scale 0.5 --max-len 256
    python benchmarks/bench_throughput.py --quick               # tiny model and workloads
    python benchmarks/bench_throughput.py --workload longtail --engines cbatch-continuous \
        --batch-invariant                                       # the cost of the mode
    python benchmarks/bench_throughput.py --workload seed --engines cbatch-continuous \
        --temperature 0.8 --top-p 0.95 --seed 0                 # sampled

Engines, all on the same weights, greedy by default (--temperature > 0: every request
sampled at that temperature and --top-p, top-k off, request i with its own seed --seed + i,
as benchmarks/peers/ do; transformers' engines sample with the same temperature and top-p
from one torch seed, so only cbatch's rows repeat request by request):
  cbatch-continuous   cbatch.LLM (continuous batching, paged KV cache, prefix caching)
  cbatch-no-prefix-cache  the same with enable_prefix_caching=False
  cbatch-invariant    cbatch.LLM(batch_invariant=True), with --batch-invariant
  cbatch-static       cbatch.LLM(scheduling_policy="static"): fixed batches run to the longest
  hf-generate         transformers generate() on fixed left-padded batches
  hf-continuous       transformers continuous batching (init_continuous_batching), when the
                      installed version has it
Each reports wall time, output tokens/s, TTFT and TPOT p50/p99 (every request arrives at the
start), its wall-time ratio to cbatch-continuous, and the share of requests whose tokens equal
cbatch-continuous's; for cbatch-continuous also the fraction of step time spent in Python
outside the model (scheduling, building the step tensors, bookkeeping) and the share of
prompt tokens found in the prefix cache (the cache is emptied after the warm-up).  On the CPU
cbatch's engines also print the decode step (median at the most common decode batch size)
beside the weight-streaming floor (every weight read once at the highest read bandwidth
measured in this run: at its start and after each timed cbatch run, since a shared host's
bandwidth moves from minute to minute; and, since it also moves within seconds, the median
ratio of a decode step of that size replayed right after reads of the weights' bytes) and the
compute floor (the step's linear-layer FLOPs at the rate its first linear layer reaches on
those rows with the weight in cache: a bf16 step at batch 8 can be bound by either), and the
share of the step spent in the linear layers (GEMMs).  Results in throughput.*
(throughput-batch-invariant.* with --batch-invariant; -sampled added when sampled), written to a
new folder under benchmarks/runs/ or to --out.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (  # noqa: E402
    Unavailable, base_parser, environment, publish, pyplot, read_bandwidth, save_figure)
from cbatch import LLM, workloads  # noqa: E402
from cbatch.quantization import ONLINE as QUANTIZATION_METHODS  # noqa: E402
from cbatch.layers.quantization import QuantizedLinear  # noqa: E402
from cbatch.models.gpt2 import GPT2LMHeadModel  # noqa: E402
from cbatch.models.gpt2 import CONV1D_WEIGHTS  # noqa: E402

COLUMNS = ["workload", "engine", "requests", "output_tokens", "wall_s", "tokens_per_s",
           "ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p99_ms", "wall_vs_continuous",
           "same_tokens_as_continuous", "host_overhead", "prefix_cache_hit_rate",
           "decode_batch", "decode_step_ms", "floor_ms", "step_over_floor", "paired_floor_ms",
           "step_over_paired_floor", "compute_floor_ms", "gemm_share",
           "spec_acceptance_rate", "spec_mean_accepted_length", "spec_draft_s",
           "spec_verify_s", "status"]


def _pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def _summary(per_request: list[dict], wall: float) -> dict:
    """per_request: token_ids, ttft (s), finish (s since start)."""
    tokens = sum(len(r["token_ids"]) for r in per_request)
    ttft = [r["ttft"] for r in per_request]
    tpot = [(r["finish"] - r["ttft"]) / (len(r["token_ids"]) - 1) for r in per_request
            if len(r["token_ids"]) > 1]
    return {"requests": len(per_request), "output_tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "ttft_p50_s": statistics.median(ttft),
            "ttft_p99_s": _pct(ttft, 0.99),
            "tpot_p50_ms": 1e3 * statistics.median(tpot) if tpot else None,
            "tpot_p99_ms": 1e3 * _pct(tpot, 0.99) if tpot else None}


def weight_bytes_of(model) -> int:
    """The bytes a decode step reads once: every parameter, and a quantized layer's packed
    weight, scales and zero points (buffers, not parameters)."""
    quantized = sum(b.numel() * b.element_size() for m in model.modules()
                    if isinstance(m, QuantizedLinear) for b in m.buffers(recurse=False))
    return quantized + sum(p.numel() * p.element_size() for p in model.parameters())


def settle() -> None:
    """Before every timed run, whichever the engine: collect, then freeze what is alive, so
    that full garbage collections do not walk the models (cbatch's Engine does this itself
    at start; here every engine gets it, in any order)."""
    gc.collect()
    gc.freeze()


def run_cbatch(args, wl, policy, prefix_caching=True, batch_invariant=False
               ) -> tuple[dict, list]:
    kw = dict(device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs or
              wl.batch_size, batch_invariant=batch_invariant, quantization=args.quantization)
    if policy != "static":
        kw["enable_prefix_caching"] = prefix_caching
        kw["speculative_config"] = args.speculative_config
    llm = LLM(args.model, scheduling_policy=policy, **kw)
    llm.generate(wl.prompts[:2], wl.params[:2], use_tqdm=False)  # warm-up
    if policy != "static":
        llm.engine.block_manager.reset_prefix_cache()  # the timed run finds nothing cached
        before = llm.engine.stats()
    clock = StepClock(llm.engine.runner) if policy == "fcfs" and on_cpu(args) else None
    settle()
    start = time.perf_counter()
    outs = llm.generate(wl.prompts, wl.params, use_tqdm=not args.no_progress)
    wall = time.perf_counter() - start
    per = [{"token_ids": o.token_ids, "ttft": o.metrics.first_token_time - start,
            "finish": o.metrics.finished_time - start} for o in outs]
    summary = _summary(per, wall)
    if policy != "static":  # before the reruns below, which add to the engine's counters
        stats = llm.engine.stats()
        summary["host_overhead"] = stats.host_overhead
        queried = stats.prefix_cache_queried_tokens - before.prefix_cache_queried_tokens
        hits = stats.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
        summary["prefix_cache_hit_rate"] = hits / queried if queried else 0.0
        if args.speculative_config is not None:  # what speculation did in the timed run
            drafts = stats.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
            accepted = (stats.spec_decode_num_accepted_tokens
                        - before.spec_decode_num_accepted_tokens)
            verifications = stats.spec_decode_num_drafts - before.spec_decode_num_drafts
            summary["spec_acceptance_rate"] = accepted / drafts if drafts else 0.0
            summary["spec_mean_accepted_length"] = (
                1 + accepted / verifications if verifications else 1.0)
            summary["spec_draft_s"] = stats.spec_decode_draft_s - before.spec_decode_draft_s
            summary["spec_verify_s"] = stats.spec_decode_verify_s - before.spec_decode_verify_s
    if clock is not None:
        probe = read_bandwidth(torch.device(args.device), (64 << 20) if args.quick else None)
        args.floor_bytes_per_s = max(args.floor_bytes_per_s, probe)
        summary.update(clock.decode_summary(args.floor_bytes_per_s))
        if "decode_batch" in summary:
            summary["compute_floor_ms"] = 1e3 * compute_floor(llm, summary["decode_batch"])
            try:  # an extra column: its failure must not cost the timed row
                summary.update(paired_floor(llm, wl, summary["decode_batch"],
                                            pairs=5 if args.quick else 30))
            except Exception as e:
                print(f"  paired_floor failed: {type(e).__name__}: {e}", flush=True)
        summary["gemm_share"] = gemm_share(llm, wl)
    return summary, [o.token_ids for o in outs]


def on_cpu(args) -> bool:
    return torch.device(args.device).type == "cpu"


class StepClock:
    """Wall time of every step's model call and sampling (the runner's execute; on the CPU
    it returns when the step is done), and the rows and kind of the step, kept beside the
    engine's own runner."""

    def __init__(self, runner):
        self.steps: list[tuple[bool, int, float]] = []  # (is_decode, rows, seconds)
        self.model = runner.model
        execute = runner.execute

        def timed(batch, scheduled):
            start = time.perf_counter()
            out = execute(batch, scheduled)
            self.steps.append((batch.is_decode, batch.num_seqs - batch.num_padded_seqs,
                               time.perf_counter() - start))
            return out

        runner.execute = timed

    def decode_summary(self, bytes_per_s: float) -> dict:
        """The median decode step at the most common decode batch size, beside the floor:
        every weight read once at the highest read bandwidth measured so far in this run."""
        decode = [(rows, s) for is_decode, rows, s in self.steps if is_decode]
        if not decode:
            return {}
        rows = statistics.mode(r for r, _ in decode)
        step = statistics.median(s for r, s in decode if r == rows)
        weight_bytes = weight_bytes_of(self.model)
        floor = weight_bytes / bytes_per_s
        return {"decode_batch": rows, "decode_step_ms": 1e3 * step, "floor_ms": 1e3 * floor,
                "step_over_floor": step / floor}


@torch.inference_mode()
def linear_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's linear layers, dense (:class:`~cbatch.layers.linear.Linear`, the lm_head
    among them) and quantized (:class:`QuantizedLinear`), in module order."""
    from cbatch.layers.linear import Linear

    return [m for m in model.modules() if isinstance(m, (Linear, QuantizedLinear))]


def compute_floor(llm, rows: int, reps: int = 20) -> float:
    """Seconds a decode step of ``rows`` rows needs for its linear layers' multiply-adds
    alone: 2 x rows x (every linear layer's in x out features, quantized ones and the lm_head
    included) FLOP at the rate the model's first linear layer reaches on ``rows`` random rows
    with its weight in cache (a rate the other layers' formats may not share; min of ``reps``
    calls after a warm-up, at torch's thread count; its own call overhead counts, as in a
    step).  Where this exceeds the weight-streaming floor, the step
    is compute-bound."""
    layers = linear_layers(llm.engine.model)
    first = layers[0]
    x = torch.randn(rows, first.in_features).to(llm.engine.model.dtype)
    best = float("inf")
    for i in range(reps + 3):
        start = time.perf_counter()
        first(x)
        if i >= 3:
            best = min(best, time.perf_counter() - start)
    rate = 2 * rows * first.in_features * first.out_features / best
    return sum(2 * rows * m.in_features * m.out_features for m in layers) / rate


@torch.inference_mode()
def paired_floor(llm, wl, rows: int, pairs: int = 30) -> dict:
    """A decode step of ``rows`` rows against a floor read right beside it.  A shared host's
    bandwidth moves within seconds (reads of the same buffer ten seconds apart gave 32 and
    53 GB/s on the 2-core host of benchmarks/NOTES.md), so the highest reading of a run
    (``floor_ms``) can be one the steps never had.  Here a rerun of the first ``rows``
    requests replays its first decode step of ``rows`` rows (its shortest contexts, not the
    timed run's median step) in place ``pairs`` times (the step rewrites the same K/V slots
    with the same values; its tokens are discarded), each replay right after one read of a
    buffer (the model's parameter bytes, at most 1 GiB, the time scaled to all of them; read
    on all of torch's threads); the result is the median over pairs of step time / that
    floor, and the median floor.  Empty if the rerun never decodes ``rows`` rows at once
    (requests with short outputs can finish before the last prompt is prefilled)."""
    runner = llm.engine.runner
    weight_bytes = weight_bytes_of(llm.engine.model)
    buffer = torch.ones(min(weight_bytes, 1 << 30) // 4)
    scale = weight_bytes / (buffer.numel() * 4)
    buffer.sum()  # its pages faulted in before the first pair
    ratios, floors = [], []
    execute = runner.execute

    def replaying(batch, scheduled):
        if not ratios and batch.is_decode and batch.num_seqs - batch.num_padded_seqs == rows:
            execute(batch, scheduled).wait()  # warm
            for _ in range(pairs):
                start = time.perf_counter()
                buffer.sum()
                floor = (time.perf_counter() - start) * scale
                start = time.perf_counter()
                execute(batch, scheduled).wait()
                ratios.append((time.perf_counter() - start) / floor)
                floors.append(floor)
        return execute(batch, scheduled)

    runner.execute = replaying
    llm.engine.block_manager.reset_prefix_cache()
    try:
        llm.generate(wl.prompts[:rows], wl.params[:rows], use_tqdm=False)
    finally:
        runner.execute = execute
    if not ratios:
        return {}
    return {"paired_floor_ms": 1e3 * statistics.median(floors),
            "step_over_paired_floor": statistics.median(ratios)}


def gemm_share(llm, wl, num_requests: int = 8) -> float:
    """The share of the model's step time spent in its linear layers (quantized ones and the
    lm_head included),
    timed by wrapping each layer's forward over a rerun of the first ``num_requests``
    requests (after the timed run, so the wrappers do not slow it).  The rerun runs the layers
    op by op (a Llama-family model's one C++ call a step, :mod:`cbatch.models.cpu_layers`,
    would bypass the wrappers): the same kernels, plus the loop's Python, so the share is a
    little below the one-call step's."""
    spent = [0.0]

    def timed(forward):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
        return run

    model = llm.engine.model
    layers = linear_layers(model)
    for layer in layers:  # an instance attribute, which cbatch's layers call (layers/module.py)
        layer.forward = timed(layer.forward)
    runner = llm.engine.runner
    screened = hasattr(runner, "greedy_tokens")  # a CPU runner: the lm_head of greedy steps
    if screened:
        runner.greedy_tokens = timed(runner.greedy_tokens)
    execute = runner.execute  # the timed run's own clock stays as it was
    clock = StepClock(runner)
    llm.engine.block_manager.reset_prefix_cache()
    bound, model.cpu_layers = getattr(model, "cpu_layers", None), None
    try:
        llm.generate(wl.prompts[:num_requests], wl.params[:num_requests], use_tqdm=False)
    finally:
        model.cpu_layers = bound
        for layer in layers:
            del layer.forward
        if screened:
            del runner.greedy_tokens
        runner.execute = execute
    total = sum(s for _, _, s in clock.steps)
    return spent[0] / total if total else float("nan")


def hf_model(args, model_like):
    """transformers' model (GPT-2, Llama, Qwen2, Qwen3) with the same weights as cbatch's."""
    import transformers

    if not args.model.startswith("random:"):
        return transformers.AutoModelForCausalLM.from_pretrained(
            args.model, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    if not isinstance(model_like, GPT2LMHeadModel):
        return _hf_llama_family(args, model_like)
    c = model_like.config
    config = transformers.GPT2Config(
        vocab_size=c.vocab_size, n_positions=c.n_positions, n_embd=c.n_embd, n_layer=c.n_layer,
        n_head=c.n_head, n_inner=c.n_inner, layer_norm_epsilon=c.layer_norm_epsilon,
        activation_function=c.activation_function, bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id)
    hf = transformers.GPT2LMHeadModel(config)
    state = {k: (v.t() if k.endswith(CONV1D_WEIGHTS) else v)
             for k, v in model_like.state_dict().items()}
    hf.load_state_dict(state, strict=False)
    return hf.to(device=args.device, dtype=getattr(torch, args.dtype)).eval()


def _hf_llama_family(args, model_like):
    """A random: Llama-family model as transformers' class of its architecture: the config's
    fields by their Hugging Face names, the fused projections split back into q/k/v and
    gate/up."""
    import transformers

    c = model_like.config
    config_class = getattr(transformers, c.architecture.replace("ForCausalLM", "Config"))
    config = config_class(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps, rope_parameters=dict(c.rope),
        tie_word_embeddings=c.tie_word_embeddings, attention_bias=c.o_bias,
        mlp_bias=c.mlp_bias, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id)
    state = {}
    for name, tensor in model_like.state_dict().items():
        if ".qkv_proj." in name:
            sizes = model_like.model.layers[0].self_attn.sizes
            for part, t in zip(("q_proj", "k_proj", "v_proj"), tensor.split(sizes)):
                state[name.replace("qkv_proj", part)] = t
        elif ".gate_up_proj." in name:
            for part, t in zip(("gate_proj", "up_proj"), tensor.chunk(2)):
                state[name.replace("gate_up_proj", part)] = t
        else:
            state[name] = tensor
    hf = transformers.AutoModelForCausalLM.from_config(config)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"weights do not map: missing {missing}, unexpected {unexpected}")
    return hf.to(device=args.device, dtype=getattr(torch, args.dtype)).eval()


class _StepClock:
    """A generate() streamer that only notes when each step's tokens arrive."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def hf_sampling(args) -> dict:
    """transformers' generate() arguments for --temperature / --top-p: greedy at 0, else
    sampled with top-k off (its default is 50), torch's generator seeded here with --seed."""
    if args.temperature == 0:
        return {"do_sample": False}
    torch.manual_seed(args.seed)
    return {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": 0}


def run_hf_generate(args, wl, hf) -> tuple[dict, list]:
    pad = hf.config.eos_token_id
    ids_all = [p if isinstance(p, list) else None for p in wl.prompts]
    per, tokens = [], []
    sampling = hf_sampling(args)  # seeds torch once for the whole run
    settle()
    start = time.perf_counter()
    size = args.max_num_seqs or wl.batch_size
    batches = range(0, len(ids_all), size)
    for i in tqdm(batches, desc="hf-generate", disable=args.no_progress):
        prompts, params = ids_all[i:i + size], wl.params[i:i + size]
        L = max(map(len, prompts))
        ids = torch.tensor([[pad] * (L - len(p)) + p for p in prompts], device=args.device)
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts],
                            device=args.device)
        clock = _StepClock()
        m = max(p.max_tokens for p in params)
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=m,
                              min_new_tokens=m, pad_token_id=pad, eos_token_id=None,
                              streamer=clock, **sampling)
        times = clock.times  # [prompt, token 1, token 2, ...]
        for row, p in zip(out[:, L:].tolist(), params):
            tokens.append(row[:p.max_tokens])
            per.append({"token_ids": row[:p.max_tokens], "ttft": times[1] - start,
                        "finish": times[p.max_tokens] - start})
    return _summary(per, time.perf_counter() - start), tokens


def run_hf_continuous(args, wl, hf) -> tuple[dict, list]:
    import transformers

    if not hasattr(hf, "init_continuous_batching"):
        raise Unavailable(f"transformers {transformers.__version__} has no continuous batching")
    gen_cfg = transformers.GenerationConfig(
        max_new_tokens=max(p.max_tokens for p in wl.params), eos_token_id=None,
        pad_token_id=hf.config.eos_token_id, **hf_sampling(args))
    manager = hf.init_continuous_batching(generation_config=gen_cfg)
    manager.start()
    try:
        settle()
        start = time.perf_counter()
        ids = [manager.add_request(p, request_id=str(i), max_new_tokens=sp.max_tokens,
                                   record_timestamps=True)
               for i, (p, sp) in enumerate(zip(wl.prompts, wl.params))]
        results = {}
        bar = tqdm(total=len(ids), desc="hf-continuous", disable=args.no_progress)
        deadline = time.perf_counter() + args.hf_timeout
        while len(results) < len(ids) and time.perf_counter() < deadline:
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                if r.error:
                    raise RuntimeError(r.error)
                results[r.request_id] = r
                bar.update(1)
        bar.close()
        wall = time.perf_counter() - start
        if len(results) < len(ids):
            raise RuntimeError(f"only {len(results)} of {len(ids)} requests finished")
    finally:
        manager.stop(block=True)
    per, tokens = [], []
    for rid in ids:
        r = results[rid]
        ts = r.timestamps or []
        per.append({"token_ids": r.generated_tokens,
                    "ttft": (ts[0] if ts else r.lifespan[1]) - start,
                    "finish": (ts[-1] if ts else r.lifespan[1]) - start})
        tokens.append(r.generated_tokens)
    return _summary(per, wall), tokens


def make_workload(name, tokenizer, vocab, args):
    if name == "seed":
        wl = workloads.seed(tokenizer, args.scale)
    else:
        fn = {"longtail": workloads.longtail, "uniform": workloads.uniform,
              "sharedprefix": workloads.sharedprefix}[name]
        wl = fn(vocab=vocab, scale=args.scale, max_len=args.max_len)
    return sampled(wl, args.temperature, args.top_p, args.seed)


def sampled(wl, temperature: float, top_p: float, seed: int):
    """``wl`` with every request sampled at ``temperature`` and ``top_p`` (top-k off),
    request i seeded with ``seed + i``; ``wl`` itself (greedy) at temperature 0."""
    if temperature == 0:
        return wl
    wl.params = [dataclasses.replace(p, temperature=temperature, top_p=top_p, seed=seed + i)
                 for i, p in enumerate(wl.params)]
    return wl


def run(args) -> Path:
    device = torch.device(args.device)
    args.floor_bytes_per_s = read_bandwidth(device, (64 << 20) if args.quick else None)
    probe = LLM(args.model, device=args.device, dtype=args.dtype, num_blocks=1)
    hf = None
    rows = []
    for name in args.workload:
        wl = make_workload(name, probe.tokenizer, probe.engine.model.config.vocab_size, args)
        wl.prompts = [probe.tokenizer.encode(p) if isinstance(p, str) else p for p in wl.prompts]
        print(f"\n== {name}: {len(wl.prompts)} requests, {wl.num_output_tokens} output tokens, "
              f"batch {args.max_num_seqs or wl.batch_size}"
              + (f", temperature {args.temperature} top_p {args.top_p} seed {args.seed}"
                 if args.temperature else ", greedy"), flush=True)
        results, reference_tokens = {}, None
        for engine in args.engines:
            row = {"workload": name, "engine": engine}
            try:
                if engine == "cbatch-continuous":
                    summary, tokens = run_cbatch(args, wl, "fcfs")
                    reference_tokens = tokens
                elif engine == "cbatch-no-prefix-cache":
                    summary, tokens = run_cbatch(args, wl, "fcfs", prefix_caching=False)
                elif engine == "cbatch-invariant":
                    summary, tokens = run_cbatch(args, wl, "fcfs", batch_invariant=True)
                elif engine == "cbatch-static":
                    summary, tokens = run_cbatch(args, wl, "static")
                else:
                    hf = hf or hf_model(args, probe.engine.model)
                    runner = run_hf_generate if engine == "hf-generate" else run_hf_continuous
                    summary, tokens = runner(args, wl, hf)
                row.update(summary, status="ok")
                if reference_tokens is not None:
                    same = sum(a == b for a, b in zip(tokens, reference_tokens))
                    row["same_tokens_as_continuous"] = f"{same}/{len(tokens)}"
                results[engine] = row
            except Unavailable as e:
                row["status"] = f"unavailable: {e}"
            except Exception as e:
                row["status"] = f"error: {type(e).__name__}: {e}"[:300]
            rows.append(row)
            print(f"  {engine:18s} {row.get('wall_s', float('nan')):8.2f} s  "
                  f"{row.get('tokens_per_s', float('nan')):8.1f} tok/s  {row['status']}",
                  flush=True)
            if "decode_step_ms" in row:
                print(f"  {'':18s} decode step at batch {row['decode_batch']}: "
                      f"{row['decode_step_ms']:.1f} ms, weight-streaming floor "
                      f"{row['floor_ms']:.1f} ms ({row['step_over_floor']:.2f}x; read "
                      f"beside the step {row.get('paired_floor_ms', float('nan')):.1f} ms, "
                      f"{row.get('step_over_paired_floor', float('nan')):.2f}x), compute "
                      f"floor {row.get('compute_floor_ms', float('nan')):.1f} ms; "
                      f"GEMM share of the step {100 * row['gemm_share']:.0f}%", flush=True)
        base = results.get("cbatch-continuous")
        for row in rows:
            if row["workload"] == name and base and row.get("wall_s"):
                row["wall_vs_continuous"] = row["wall_s"] / base["wall_s"]
    meta = {**environment(device), "model": args.model, "dtype": args.dtype,
            "quantization": args.quantization,
            "scale": args.scale, "max_len": args.max_len,
            "sampling": (f"temperature {args.temperature}, top_p {args.top_p}, top-k off, "
                         f"request i seeded {args.seed} + i" if args.temperature else "greedy"),
            "max_num_seqs": args.max_num_seqs or "the workload's batch size",
            "note": "wall_vs_continuous > 1 means slower than cbatch continuous batching",
            "timing": "one run per engine after a warm-up; gc.collect() + gc.freeze() before "
                      "each timed run, whichever the engine",
            "read_bandwidth_GBps": args.floor_bytes_per_s / 1e9,
            "load_average_at_end": Path("/proc/loadavg").read_text().split()[0]
            if Path("/proc/loadavg").exists() else None,
            "decode_step_ms": "CPU: median model call, lm_head and sampling (the runner's "
                              "execute) of the decode steps at the most common decode batch "
                              "size, in the timed run",
            "floor_ms": "every weight read once (parameter bytes) / the highest read bandwidth "
                        "measured so far in the run (at its start and after each timed cbatch "
                        "run; read_bandwidth_GBps is the highest of all); an lm_head with "
                        "a greedy screen (fp32: a bf16 copy; bf16 below 16 rows: an int8 "
                        "one) reads half its bytes, so greedy steps can beat it",
            "paired_floor_ms": "CPU: the median time of one read of the parameter bytes (at "
                               "most 1 GiB read, scaled), each read right before a replay of "
                               "a decode step at decode_batch (paired_floor); empty when the "
                               "rerun never decodes that many rows at once",
            "step_over_paired_floor": "CPU: the median over those pairs of replayed step time "
                                      "/ the read's time",
            "compute_floor_ms": "CPU: the decode step's linear-layer FLOPs (2 x rows x in x "
                                "out features, quantized layers and lm_head included) at "
                                "the rate the model's "
                                "first linear layer reaches on that many rows with its weight "
                                "in cache; the step cannot beat the larger of the two floors "
                                "(greedy steps excepted, whose fp32 lm_head a screen computes "
                                "in bf16)",
            "gemm_share": "CPU: time inside the linear layers (each dense and quantized "
                          "linear layer's forward and the "
                          "screened lm_head wrapped with a timer) / step time, over a rerun "
                          "of the first 8 requests after the timed run"}
    name = ("throughput" + ("-batch-invariant" if args.batch_invariant else "")
            + ("-sampled" if args.temperature else "")
            + (f"-{args.quantization}" if args.quantization else ""))
    return publish(name, device, rows, meta, COLUMNS, args.out,
                   lambda rows, path: plot(rows, path, meta))


def plot(rows, path, meta):
    plt = pyplot()
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return
    names = list(dict.fromkeys(r["workload"] for r in ok))
    engines = list(dict.fromkeys(r["engine"] for r in ok))
    fig, ax = plt.subplots(figsize=(2.2 + 2.2 * len(names), 3.6))
    width = 0.8 / len(engines)
    for j, engine in enumerate(engines):
        vals = [next((r["tokens_per_s"] for r in ok if r["workload"] == n
                      and r["engine"] == engine), 0) for n in names]
        ax.bar([i + j * width for i in range(len(names))], vals, width, label=engine)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{meta['model']} {meta['dtype']} on {meta['device']}", fontsize=9)
    ax.legend(fontsize=7)
    save_figure(fig, path)


ENGINES = ["cbatch-continuous", "cbatch-no-prefix-cache", "cbatch-static", "hf-generate",
           "hf-continuous"]


def main(argv=None):
    parser = base_parser(__doc__)
    cuda = torch.cuda.is_available()
    parser.add_argument("--model", default="random:gpt2")
    parser.add_argument("--dtype", default="float16" if cuda else "float32")
    parser.add_argument("--workload", nargs="+", default=["seed", "longtail", "uniform"],
                        choices=["seed", "longtail", "uniform", "sharedprefix"])
    parser.add_argument("--engines", nargs="+", default=list(ENGINES),
                        choices=ENGINES + ["cbatch-invariant"])
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the requests")
    parser.add_argument("--max-len", type=int, default=512,
                        help="cap on prompt and output lengths of longtail/uniform/"
                             "sharedprefix")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--hf-timeout", type=float, default=3600)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample every request at this temperature (0 = greedy)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="with --temperature: nucleus sampling (1 = off)")
    parser.add_argument("--seed", type=int, default=0,
                        help="with --temperature: request i is seeded with SEED + i")
    parser.add_argument("--speculative-config", default=None,
                        help="JSON, as `cbatch serve --speculative-config`: the cbatch "
                             "engines (not static) speculate, and the rows report "
                             "spec_acceptance_rate, spec_mean_accepted_length, spec_draft_s "
                             "and spec_verify_s")
    parser.add_argument("--quantization", choices=QUANTIZATION_METHODS, default=None,
                        help="the cbatch engines quantize the model's linear weights at "
                             "load (CPU; cbatch serve --quantization), or on a quantized "
                             "checkpoint run its weights with int8 activations (w4a8, w8a8); "
                             "hf-* run it unquantized")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="also run cbatch-invariant (batch_invariant=True) after "
                             "cbatch-continuous")
    args = parser.parse_args(argv)
    if args.batch_invariant and "cbatch-invariant" not in args.engines:
        at = args.engines.index("cbatch-continuous") + 1 if (
            "cbatch-continuous" in args.engines) else 0
        args.engines.insert(at, "cbatch-invariant")
    if args.quick:
        args.model = "random:tiny" if args.model == "random:gpt2" else args.model
        args.scale, args.max_len = min(args.scale, 0.05), min(args.max_len, 48)
        args.hf_timeout = min(args.hf_timeout, 60)
    return run(args)


if __name__ == "__main__":
    main()
