"""cbatch's Llama, Qwen2 and Qwen3 against transformers' models on the same random weights.

Tiny checkpoints of each architecture are made here with transformers and saved with
save_pretrained (nothing is downloaded): Llama with GQA 4:1, untied embeddings and llama3
rope scaling; Qwen2 with GQA 2:1, QKV bias and tied embeddings; Qwen3 with GQA 4:1, per-head
q/k norms and a head_dim wider than hidden / heads.
"""

import copy
import json
import shutil

import pytest
import torch

from cbatch import LLM, Engine, KVCache, SamplingParams, bytes_per_token, load_model
from cbatch.core.cpu.packing import pack_linears
from cbatch.core.input_batch import make_step_batch
from cbatch.ops import cpu, layer_ops
from cbatch.ops.cpu import kernel_paths
from tests.helpers import STRESS_CONFIGS, shuffled_block_tables

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

VOCAB = 1000
COMMON = dict(vocab_size=VOCAB, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)
ARCHS = {
    "llama": ("LlamaConfig", dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 128})),
    "qwen2": ("Qwen2Config", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)),
}


def _hf_model(arch: str, **overrides):
    config_cls, kwargs = ARCHS[arch]
    config = getattr(transformers, config_cls)(**{**COMMON, **kwargs, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # biases are zero at init: make Qwen2's QKV bias count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model.eval()


@pytest.fixture(scope="module", params=list(ARCHS))
def checkpoint(request, tmp_path_factory):
    """(architecture, directory saved by save_pretrained, the transformers model)."""
    model = _hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, path, model


def _prompts(n: int = 24, seed: int = 0) -> list[list[int]]:
    """Mixed lengths 1..60; every third prompt shares a 20-token prefix with the one before
    (prefix caching hits)."""
    gen = torch.Generator().manual_seed(seed)
    lens = [1, 2, 3, 5, 8, 15, 16, 17, 31, 33, 40, 60]
    prompts = []
    for i in range(n):
        prompt = torch.randint(3, VOCAB, (lens[i % len(lens)],), generator=gen).tolist()
        if i % 3 == 2:
            prompt = prompts[-1][:20] + prompt
        prompts.append(prompt[:60])
    return prompts


def _hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
    return out[0, len(prompt):].tolist()


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def test_loaded_model_is_the_right_class_and_shares_no_kv_heads(checkpoint):
    arch, path, hf = checkpoint
    model = load_model(str(path))
    assert type(model).__name__ == type(hf).__name__
    cfg = model.config
    assert cfg.num_kv_heads == hf.config.num_key_value_heads < hf.config.num_attention_heads
    assert cfg.head_dim == _head_dim(hf.config)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == hf.config.tie_word_embeddings


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_layer_kernels_run_and_match_transformers(checkpoint, dtype, monkeypatch):
    """On the CPU a forward runs the fused C++ ops (their counters move: every norm, SwiGLU
    and rotary call) and its logits are transformers' (fp32) or the torch formulas' to within
    bf16's rounding (the sums of squares and e^-x differ in their last fp32 bits)."""
    if not layer_ops.kernels_available():
        pytest.skip("the extension lacks the layer ops")
    arch, path, hf = checkpoint
    model = load_model(str(path), dtype=dtype)
    prompts = [[5, 9, 200, 7, 11], [3], [17] * 12]
    tables = [[i] for i in range(len(prompts))]

    def logits():
        cache = KVCache(model.config, len(prompts), 16, dtype=dtype)
        with torch.no_grad():
            return model.compute_logits(model(make_step_batch(prompts, [0] * 3, tables, 16),
                                              cache)).float()

    before = kernel_paths()
    fused = logits()
    moved = {k.split(".")[0]: v - before[k] for k, v in kernel_paths().items() if v != before[k]}
    layers = model.config.num_hidden_layers
    # the first layer's input norm alone (no residual yet), then every norm adds the residual
    # (the final one too); Qwen3's q and k norms are plain
    norms = 1 + (2 * layers if arch == "qwen3" else 0)
    assert moved["fused_add_rms_norm"] == 2 * layers and moved["rms_norm"] == norms
    assert moved["silu_and_mul"] == layers and moved["rotary_embedding"] == layers
    monkeypatch.setattr(layer_ops, "_HAS_KERNELS", [False])
    formulas = logits()
    if dtype == torch.float32:
        ref = hf(torch.tensor([prompts[0]])).logits[0]
        torch.testing.assert_close(fused[:5], ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(fused, formulas, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(fused, formulas, atol=0.05, rtol=0.05)


@pytest.mark.slow
def test_packed_prefill_then_decode_logits_match_transformers(checkpoint):
    """One packed prefill of ragged prompts over shuffled blocks of a NaN-filled cache, then
    decode steps: every logit row against transformers' forward of the whole sequence."""
    arch, path, hf = checkpoint
    model = load_model(str(path))
    block_size = 8
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (1, 7, 8, 9, 29)]
    final = [len(p) + 3 for p in prompts]
    num_blocks = sum(-(-n // block_size) for n in final) + 5
    cache = KVCache(model.config, num_blocks, block_size)
    cache.data.fill_(float("nan"))
    tables = shuffled_block_tables(final, block_size, num_blocks, gen).tolist()
    batch = make_step_batch(prompts, [0] * len(prompts), tables, block_size)
    with torch.no_grad():
        logits = model.compute_logits(model(batch, cache))
        for s, prompt in enumerate(prompts):
            ref = hf(torch.tensor([prompt])).logits[0]
            ours = logits[batch.cu_seqlens_q[s]:batch.cu_seqlens_q[s + 1]]
            torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
        seqs = [list(p) for p in prompts]
        for _ in range(3):
            new = [[int(torch.randint(3, VOCAB, (1,), generator=gen))] for _ in seqs]
            batch = make_step_batch(new, [len(s) for s in seqs], tables, block_size)
            logits = model.compute_logits(model(batch, cache)[batch.logits_indices])
            for s, tok in enumerate(new):
                seqs[s] += tok
                ref = hf(torch.tensor([seqs[s]])).logits[0, -1]
                torch.testing.assert_close(logits[s], ref, atol=1e-4, rtol=1e-4)


def test_bf16_packed_logits_match_transformers(checkpoint):
    """The model in bf16 with its linears packed for this CPU's route (cbatch's kernel with
    AVX2 or AVX-512: its bf16 tiles run, the lm_head too): prefill and decode logits against
    transformers in fp32, with an error at most twice that of transformers' own model run in
    bf16 (plus 1e-2), as the GPT-2 bf16 parity test (tests/ops/test_cpu_linear.py) allows."""
    arch, path, hf = checkpoint
    model = load_model(str(path), dtype=torch.bfloat16)
    route = cpu.cpu_linear_route(torch.bfloat16)
    assert pack_linears(model) == (route != "torch")
    block_size = 8
    prompts = [[(5 * i + 3 * j) % VOCAB + 3 for j in range(n)] for i, n in enumerate((1, 9, 17))]
    cache = KVCache(model.config, 9, block_size, dtype=torch.bfloat16)
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    before = kernel_paths()
    with torch.no_grad():
        batch = make_step_batch(prompts, [0] * len(prompts), tables, block_size)
        prefill = model.compute_logits(model(batch, cache)).float()
        batch = make_step_batch([[7]] * len(prompts), [len(p) for p in prompts], tables,
                                block_size)
        decode = model.compute_logits(model(batch, cache)[batch.logits_indices]).float()
        ran = {k: n - before[k] for k, n in kernel_paths().items() if n > before[k]}
        if route == "cbatch":  # qkv, o, gate_up and down per layer, and the lm_head, per step
            bf16_path = "linear.avx512" if "avx512bf16" in cpu.cpu_isa() else "linear.bf16.avx2"
            assert ran.get(bf16_path, 0) == 2 * (4 * hf.config.num_hidden_layers + 1), ran
        hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
        offset = 0
        for s, p in enumerate(prompts):
            ids = torch.tensor([p + [7]])
            truth = hf(ids).logits[0]
            ours = torch.cat([prefill[offset:offset + len(p)], decode[s:s + 1]])
            offset += len(p)
            hf_err = (hf_bf16(ids).logits[0].float() - truth).abs().max().item()
            assert (ours - truth).abs().max().item() <= 2 * hf_err + 1e-2, arch


@pytest.mark.slow
@pytest.mark.parametrize("config", ["chunked-prefill", "preempting"])
def test_greedy_generate_matches_transformers(checkpoint, config):
    """24 prompts of mixed lengths, some sharing prefixes, under chunked prefill (7 tokens a
    step) or a pool so small that requests are preempted: the tokens of transformers'
    generate, prompt by prompt."""
    arch, path, hf = checkpoint
    prompts = _prompts()
    max_tokens = [4 + i % 9 for i in range(len(prompts))]
    kwargs = dict(STRESS_CONFIGS[config])
    if config == "preempting":  # room for the longest request (72 tokens), not for two
        kwargs["num_blocks"] = 20
    llm = LLM(str(path), **kwargs)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=True)
                                  for m in max_tokens], use_tqdm=False)
    for prompt, m, out in zip(prompts, max_tokens, outs):
        assert out.token_ids == _hf_greedy(hf, prompt, m), (len(prompt), m)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hit_tokens > 0
    if config == "preempting":
        assert stats.num_preemptions > 0
    llm.engine.block_manager.check_whole()


def test_logprobs_match_transformers(checkpoint):
    arch, path, hf = checkpoint
    prompt = _prompts()[10]
    out = LLM(str(path)).generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True,
                                                          logprobs=4), use_tqdm=False)[0]
    with torch.no_grad():
        ids = torch.tensor([prompt + out.token_ids[:-1]])
        ref = hf(ids).logits[0, len(prompt) - 1:].log_softmax(-1)
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        want = ref[step].topk(4)
        assert next(iter(entry)) == token and list(entry) == want.indices.tolist()
        torch.testing.assert_close(torch.tensor(list(entry.values())), want.values,
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("model,quantization", [("random:llama-tiny", None),
                                                ("random:qwen3-tiny", None),
                                                ("random:llama-tiny", "int4")])
def test_batch_invariant_mode_is_bitwise(model, quantization):
    """A probe's logits (all-vocabulary logprobs) alone and among batch-mates, chunked by a
    small token budget and preempted by a small pool: bitwise the same (int4 weights too: the
    quantized kernel sums each row alike whatever the others)."""
    probe = [(7 * i + 3) % 500 for i in range(37)]
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=512)
    alone = Engine(model, batch_invariant=True, block_size=4, max_logprobs=512,
                   quantization=quantization)
    crowded = Engine(model, batch_invariant=True, block_size=4, num_blocks=14,
                     max_num_batched_tokens=11, max_num_seqs=4, max_logprobs=512,
                     quantization=quantization)
    crowded.occupancy_trace = []
    results = []
    for engine, mates in ((alone, 0), (crowded, 5)):
        rid = engine.add_request(probe, params)
        for i in range(mates):
            engine.add_request([(11 * i + j) % 500 for j in range(10 + 9 * i)],
                               SamplingParams(max_tokens=8, ignore_eos=True))
        final = None
        for _ in range(500):
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    final = out
            if not engine.has_unfinished_requests():
                break
        results.append(final)
    assert crowded.stats().num_preemptions > 0 and max(crowded.occupancy_trace) > 1
    assert results[0].token_ids == results[1].token_ids
    assert results[0].logprobs == results[1].logprobs


def test_kv_cache_holds_kv_heads_only(checkpoint):
    arch, path, hf = checkpoint
    model = load_model(str(path))
    c = hf.config
    assert bytes_per_token(model.config, torch.float16) == (
        2 * c.num_hidden_layers * c.num_key_value_heads * _head_dim(c) * 2)
    cache = KVCache(model.config, 3, 16)
    assert cache.data.shape == (c.num_hidden_layers, 2, 3, 16, c.num_key_value_heads,
                                _head_dim(c))
    report = cache.memory_report()
    assert report.startswith("KV cache: 48 tokens (3 blocks of 16;")
    assert f"x {c.num_key_value_heads} KV heads x head_dim {_head_dim(c)} x 4 bytes" in report


# ----------------------------------------------------------------------------- loading


@pytest.mark.slow
def test_sharded_half_precision_checkpoint(tmp_path):
    """bf16 and fp16 weights in several shards with an index, loaded into fp32 and bf16."""
    prompt = _prompts()[9]
    for dtype in (torch.bfloat16, torch.float16):
        hf = _hf_model("llama")
        path = tmp_path / str(dtype)
        hf.to(dtype).save_pretrained(path, max_shard_size="100KB")
        assert len(list(path.glob("*.safetensors"))) > 2
        assert (path / "model.safetensors.index.json").is_file()
        model = load_model(str(path))
        assert model.dtype == torch.float32
        attn = hf.model.layers[1].self_attn
        want = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).float()
        assert torch.equal(model.model.layers[1].self_attn.qkv_proj.weight, want)
        assert torch.equal(model.lm_head.weight, hf.lm_head.weight.float())
        half = load_model(str(path), dtype=torch.bfloat16)
        assert half.dtype == torch.bfloat16
        out = LLM(half).generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True),
                                 use_tqdm=False)[0]
        assert len(out.token_ids) == 3
    missing = tmp_path / "missing"
    shutil.copytree(tmp_path / str(torch.float16), missing)
    next(missing.glob("model-00001*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="lists shards"):
        load_model(str(missing))


def test_unknown_architecture_lists_the_supported_ones(checkpoint, tmp_path):
    arch, path, hf = checkpoint
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["MistralForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="MistralForCausalLM.*not supported.*GPT2LMHeadModel, "
                                         "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        load_model(str(bad))


def test_unsupported_rope_type_is_refused(tmp_path):
    hf = _hf_model("llama", rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                             "factor": 2.0,
                                             "original_max_position_embeddings": 128})
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        load_model(str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0},
                                  {"rope_type": "default"}])
def test_linear_and_default_rope_match_transformers(rope, tmp_path):
    hf = _hf_model("llama", rope_parameters={"rope_theta": 500000.0, **rope})
    hf.save_pretrained(tmp_path)
    prompt = _prompts()[11]
    out = LLM(str(tmp_path)).generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True),
                                      use_tqdm=False)[0]
    assert out.token_ids == _hf_greedy(hf, prompt, 8)


def test_dynamic_rope_is_fixed_at_the_longest_context():
    """vLLM's dynamic NTK scaling: the base of the longest context the model serves
    (max_position_embeddings * factor) for every position; transformers computes the same
    frequencies when a batch reaches that length."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from cbatch.layers.rotary_embedding import inverse_frequencies, rope_parameters

    config = transformers.LlamaConfig(hidden_size=128, num_attention_heads=4,
                                      max_position_embeddings=256,
                                      rope_parameters={"rope_type": "dynamic", "factor": 4.0,
                                                       "rope_theta": 10000.0})
    ours = inverse_frequencies(32, rope_parameters(config.to_dict()), 256)
    theirs, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=1024)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    from cbatch.models.llama import LlamaConfig

    assert LlamaConfig.from_hf({**config.to_dict(), "intermediate_size": 64}
                               ).max_model_len == 1024


@pytest.mark.slow
def test_random_models():
    for name, arch, layers, kv_heads in (("llama-tiny", "LlamaForCausalLM", 2, 2),
                                         ("qwen3-tiny", "Qwen3ForCausalLM", 2, 1),
                                         ("smollm2-135m", "LlamaForCausalLM", 30, 3)):
        a = load_model(f"random:{name}", seed=1)
        assert type(a).__name__ == arch
        assert (a.config.num_layers, a.config.num_kv_heads) == (layers, kv_heads)
        if name == "llama-tiny":
            b, c = load_model("random:llama-tiny", seed=1), load_model("random:llama-tiny", seed=2)
            w = [m.model.layers[0].self_attn.qkv_proj.weight for m in (a, b, c)]
            assert torch.equal(w[0], w[1]) and not torch.equal(w[0], w[2])
    params = sum(p.numel() for p in load_model("random:smollm2-135m").parameters())
    assert 134e6 < params < 136e6  # SmolLM2-135M (embeddings tied)
    with pytest.raises(ValueError, match="unknown model size 'llama-huge'.*smollm2-135m"):
        load_model("random:llama-huge")
