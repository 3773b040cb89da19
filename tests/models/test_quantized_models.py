"""Online quantization (``quantization="int8" | "int4" | "w8a8" | "w4a8"``): which layers it
replaces, that a quantized model's logits are those of the same model with the dequantized
weights in fp32 (the oracle: F.linear on cbatch.ops.reference.dequantize's weights; W8A8,
W4A8: the same model with every layer on the pure-torch reference, whose integer sums are
exact), that an engine runs the quantized kernel and keeps the lm_head's greedy screen (w4a8:
an int8 lm_head, which a tied embedding reads), and what is refused, by name."""

import json

import pytest
import torch

from cbatch import LLM, SamplingParams, load_model
from cbatch.core.input_batch import prefill_logits
from cbatch.layers.linear import Linear
from cbatch.layers.quantization import QuantizedLinear
from cbatch.ops import compiled, cpu
from cbatch.ops import quantized as quantized_ops
from tests.helpers import int8_kernel_calls, triton_device, triton_skip_reason

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    """A float Hugging Face directory (Qwen2: q/k/v biases, random here; bf16 on disk, as
    real checkpoints ship) that online quantization reads through the real loader."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(vocab_size=300, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("qwen2")
    model.to(torch.bfloat16).save_pretrained(path)
    return str(path)


# Llama, GPT-2 (biases everywhere), and a Hugging Face directory (the fixture's path)
@pytest.mark.parametrize("name", ["random:llama-tiny", "random:tiny", "qwen2_dir"])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_logits_are_the_dequantized_models(name, method, request):
    """Every linear but the lm_head is replaced; the logits equal those of the float model
    whose linear weights are the dequantized ones (fp32, so only summation order differs)."""
    if not name.startswith("random:"):
        name = request.getfixturevalue(name)
    quantized = load_model(name, quantization=method, seed=3)
    dense = load_model(name, seed=3)
    layers = dict(quantized.named_modules())
    replaced = 0
    for path, module in dense.named_modules():
        if not isinstance(module, Linear):
            continue
        if path == "lm_head":
            assert isinstance(layers[path], Linear)
            continue
        q = layers[path]
        assert isinstance(q, QuantizedLinear) and q.bits == (8 if method == "int8" else 4)
        with torch.no_grad():
            module.weight.copy_(q.weight.dequantize())
        replaced += 1
    assert replaced >= 4 * quantized.config.num_layers - (name == "random:tiny")
    assert quantized.num_parameters() == dense.num_parameters()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (1, 9, 33)]
    torch.testing.assert_close(torch.cat(prefill_logits(quantized, prompts)),
                               torch.cat(prefill_logits(dense, prompts)),
                               atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["random:llama-tiny", "random:tiny"])  # Llama; GPT-2 (bias)
def test_w8a8_logits_are_the_references(name, monkeypatch):
    """quantization="w8a8": every linear but the lm_head (kept, as vLLM keeps it) takes int8
    activations; the logits are those of the same layers on the reference (exact integer
    sums; the kernel's fused bias add differs by one rounding), and near the W8A16 model's
    (the cost of int8 x)."""
    model = load_model(name, quantization="w8a8", seed=3)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(m.act_bits == 8 and m.bits == 8 for m in layers)
    assert not isinstance(model.lm_head, QuantizedLinear)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (1, 9, 33)]
    before = int8_kernel_calls("w8a8")
    ours = torch.cat(prefill_logits(model, prompts))
    assert int8_kernel_calls("w8a8") > before or not quantized_ops.available("w8a16")
    monkeypatch.setattr(quantized_ops, "available", lambda kind: False)
    reference = torch.cat(prefill_logits(model, prompts))
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)
    int8 = torch.cat(prefill_logits(load_model(name, quantization="int8", seed=3), prompts))
    assert (ours - int8).abs().max() < 0.05 * int8.abs().max()


@pytest.mark.parametrize("name", ["random:llama-tiny", "random:tiny"])  # Llama; GPT-2 (bias)
def test_w4a8_logits_are_the_references_and_near_int4s(name, monkeypatch):
    """quantization="w4a8": every linear of the layers holds int4 in groups of 128 and takes
    int8 activations per token and group, the lm_head int8 per channel (W8A8); the logits are
    those of the same layers on the pure-torch reference (the W4A8 kernel is the reference's
    bit for bit, the W8A8 one's integer sums too), and within 5% of the largest logit of the
    W4A16 model's on the same weights (what int8 x and the int8 lm_head cost)."""
    model = load_model(name, quantization="w4a8", seed=3)
    head = model.lm_head
    assert isinstance(head, QuantizedLinear) and (head.bits, head.act_bits) == (8, 8)
    assert head.group_size == head.in_features  # one group per output channel
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear) and m is not head]
    assert layers and all(m.act_bits == 8 and m.bits == 4 and m.group_size == 128
                          for m in layers)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (1, 9, 33)]
    before = [int8_kernel_calls("w4a8"), int8_kernel_calls("w8a8")]
    ours = torch.cat(prefill_logits(model, prompts))
    moved = [int8_kernel_calls(op) - b for op, b in zip(("w4a8", "w8a8"), before)]
    assert moved[0] >= len(layers) or not quantized_ops.available("w4a8")
    assert moved[1] >= 1 or not quantized_ops.available("w8a16")  # the lm_head
    monkeypatch.setattr(quantized_ops, "available", lambda kind: False)
    torch.testing.assert_close(ours, torch.cat(prefill_logits(model, prompts)),
                               atol=1e-5, rtol=1e-5)
    int4 = torch.cat(prefill_logits(load_model(name, quantization="int4", seed=3), prompts))
    assert (ours - int4).abs().max() < 0.05 * int4.abs().max()


@pytest.mark.parametrize("name", ["random:tiny", "random:qwen3-tiny"])  # GPT-2, Qwen3: tied
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a8_tied_embedding_reads_the_int8_lm_head(name, dtype):
    """Under w4a8 a tied embedding drops its weight and reads its rows from the int8 lm_head:
    the head's dequantized rows in the model's dtype, bitwise; the matrix is held once, at a
    byte per weight; an untied model keeps its embedding."""
    model = load_model(name, quantization="w4a8", seed=3, dtype=dtype)
    dense = load_model(name, seed=3, dtype=dtype)
    path = "transformer.wte" if name == "random:tiny" else "model.embed_tokens"
    embedding = model.get_submodule(path)
    assert embedding.weight is None and model.dtype == dtype
    assert "weight" not in embedding.state_dict()
    V = model.config.vocab_size
    ids = torch.tensor([0, V - 1, 7, 7, V // 2])
    rows = embedding(ids)
    assert rows.dtype == dtype
    assert torch.equal(rows, model.lm_head.weight.dequantize()[ids].to(dtype))
    # the int8 rows are near the float ones: half a step (a column's largest magnitude /
    # 127) at most, plus the rounding to dtype (half an ulp)
    reference = dense.get_submodule(path).weight[ids].float().detach()
    bound = reference.abs().amax(dim=1, keepdim=True) / 254 * 1.001 \
        + rows.float().abs() * torch.finfo(dtype).eps / 2
    assert ((rows.float() - reference).abs() <= bound).all()
    assert model.lm_head.qweight.numel() < V * embedding.embedding_dim * 1.1  # one int8 copy
    assert model.num_parameters() == dense.num_parameters()
    untied = load_model("random:llama-tiny", quantization="w4a8", seed=3)
    assert untied.model.embed_tokens.weight is not None


def test_w4a8_is_refused_on_cuda():
    with pytest.raises(ValueError, match="quantization='w4a8' runs on the CPU only \\(there is "
                                         "no CUDA kernel for it\\); on CUDA choose int8, int4 "
                                         "or w8a8"):
        load_model("random:llama-tiny", device="cuda", quantization="w4a8")


@pytest.mark.parametrize("method", ["int8", "int4", "w8a8", "w4a8"])
def test_engine_runs_the_quantized_kernel_and_keeps_the_greedy_screen(method):
    if not quantized_ops.available("w8a16"):
        pytest.skip("cbatch's quantized CPU kernel does not run here")
    dtype = torch.bfloat16 if cpu.screen_available(torch.bfloat16) else torch.float32
    llm = LLM("random:llama-tiny", dtype=dtype, quantization=method, max_num_seqs=4)
    path = {"int8": f"quantized_linear.w8.{quantized_ops.isa('w8a16', dtype)}",
            "int4": f"quantized_linear.w4.{quantized_ops.isa('w4a16', dtype)}",
            "w8a8": f"quantized_linear.w8a8.{quantized_ops.isa('w8a8')}",
            "w4a8": f"quantized_linear.w4a8.{quantized_ops.isa('w4a8')}"}[method]
    before = cpu.kernel_paths()
    outs = llm.generate([[5, 6, 7], [9] * 20], SamplingParams(max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    after = cpu.kernel_paths()
    assert [len(o.token_ids) for o in outs] == [6, 6]
    assert after[path] > before[path]
    quantized = [m for m in llm.engine.model.modules() if isinstance(m, QuantizedLinear)]
    assert quantized and all(m.placed for m in quantized)  # on the runner's huge pages
    described = llm.engine.runner.describe()
    assert described["quantized linear"].startswith(
        {"int8": "int8", "int4": "int4 g128", "w8a8": "w8a8", "w4a8": "w4a8 g128"}[method])
    assert f"(cbatch {path.rsplit('.', 1)[1]})" in described["quantized linear"]
    if method == "w4a8":  # the lm_head is W8A8 and the tied embedding reads it: no screen
        assert llm.engine.runner.greedy_screen is None
        assert described["greedy screen"] == "none (the lm_head is quantized)"
        assert described["linear"] == "none (every linear layer is quantized)"
        head = f"quantized_linear.w8a8.{quantized_ops.isa('w8a8')}"
        assert after[head] - before.get(head, 0) >= 6  # one call per step at least
    else:  # the lm_head stays float, screened wherever the screen runs
        assert (llm.engine.runner.greedy_screen is not None) == cpu.screen_available(dtype)
        screened = [k for k in after if k.startswith("greedy_head.") and "rows" not in k]
        assert (sum(after[k] - before[k] for k in screened) > 0) == cpu.screen_available(dtype)


@pytest.mark.skipif(quantized_ops.isa("w8a8") != "avx512vnni", reason="no AVX512-VNNI")
@pytest.mark.parametrize("method", ["w8a8", "w4a8"])
def test_engine_on_amx_tiles_is_the_vnni_engine(method):
    """A W8A8 or W4A8 engine whose prefills run on AMX-INT8 tiles (the CPU's where it has
    them, else amx_tile_ops.h's model of them) gives the VNNI engine's tokens and logprobs to the
    bit, prompt logprobs too: the tiles' integers and epilogue are the VNNI tiles'."""
    prompts = [[5, 6, 7] * 7, [9] * 20, [11, 12]]
    params = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    counter = f"quantized_linear.{method}.amx"
    runs = {}
    try:
        for amx in ("" if "amx-int8" in cpu.cpu_isa() else "model", "off"):
            torch.ops.cbatch.set_cpu_options(*compiled._cpu_options(), amx)
            llm = LLM("random:llama-tiny", quantization=method, max_num_seqs=4)
            before = cpu.kernel_paths()[counter]
            outs = llm.generate(prompts, params, use_tqdm=False)
            tiles = cpu.kernel_paths()[counter] - before
            runs[amx or "model"] = tiles, [(o.token_ids, o.logprobs, o.prompt_logprobs)
                                            for o in outs]
    finally:
        torch.ops.cbatch.set_cpu_options(*compiled._cpu_options())
    assert runs["model"][0] >= 2 * 4  # the prefill's 4 linears of 2 layers, at least
    assert runs["off"][0] == 0
    assert runs["model"][1] == runs["off"][1]


def test_quantization_methods_are_refused_by_name():
    with pytest.raises(ValueError, match="quantization='fp8' is not supported; cbatch runs "
                                         "int8, int4, w8a8, w4a8 \\(online\\) and a "
                                         "checkpoint's own"):
        LLM("random:llama-tiny", quantization="fp8")
    with pytest.raises(ValueError, match="runs on the CPU and on CUDA \\(Triton\\), not on mps"):
        load_model("random:llama-tiny", device="mps", quantization="int8")
    with pytest.raises(ValueError, match="runs activations of float32, bfloat16 on cpu; "
                                         "float32, bfloat16, float16 on cuda: not float16 on "
                                         "cpu"):
        load_model("random:llama-tiny", dtype=torch.float16, quantization="int4")
    with pytest.raises(ValueError, match="quantization comes from the model given"):
        LLM(load_model("random:tiny"), quantization="int8")


def _spy_triton(monkeypatch) -> list[str]:
    """The names of kernels/quant_matmul.py's launchers, as they are called."""
    from cbatch.kernels import quant_matmul

    calls = []
    for name in ("wna16_linear", "w8a8_linear"):
        real = getattr(quant_matmul, name)
        monkeypatch.setattr(quant_matmul, name, lambda *a, real=real, name=name, **k:
                            calls.append(name) or real(*a, **k))
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_model_on_the_cuda_path_is_the_dequantized_model(monkeypatch, method):
    """The path a CUDA model takes, emulated where there is no GPU: its quantized layers'
    dispatch pointed at CPU tensors, which Triton's interpreter runs.  Every quantized layer
    runs the Triton GEMM, and the logits are those of the float model on the dequantized
    weights (the oracle of test_quantized_logits_are_the_dequantized_models)."""
    device = triton_device()
    if device is None:
        pytest.skip(triton_skip_reason())
    calls = _spy_triton(monkeypatch)
    if device == "cpu":
        monkeypatch.setattr(quantized_ops, "on_triton", lambda x: True)
    quantized = load_model("random:llama-tiny", device=device, quantization=method, seed=3)
    dense = load_model("random:llama-tiny", device=device, seed=3)
    layers = dict(quantized.named_modules())
    with torch.no_grad():
        for path, module in dense.named_modules():
            if isinstance(layers.get(path), QuantizedLinear):
                module.weight.copy_(layers[path].weight.dequantize())
    prompts = [[5, 6, 7], list(range(3, 22))]
    ours = torch.cat(prefill_logits(quantized, prompts))
    assert calls.count("wna16_linear") == 4 * quantized.config.num_layers
    torch.testing.assert_close(ours, torch.cat(prefill_logits(dense, prompts)),
                               atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the engine on CUDA")
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_engine_on_cuda_runs_the_triton_gemm(monkeypatch, method):
    """A CUDA engine with quantized weights and float16 activations (its default CUDA graphs
    on) decodes, and its quantized layers run the Triton GEMM (the logits' oracle is the
    test above, which runs on the GPU too)."""
    calls = _spy_triton(monkeypatch)
    llm = LLM("random:llama-tiny", device="cuda", dtype="float16", quantization=method,
              max_num_seqs=4)
    outs = llm.generate([[5, 6, 7], [9] * 20], SamplingParams(max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [6, 6]
    assert calls.count("wna16_linear") > 0


@pytest.mark.slow
def test_quantized_checkpoints_are_refused_by_method(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes' is not supported; cbatch "
                                         "loads gptq, awq, compressed-tensors checkpoints"):
        load_model(str(tmp_path))


def test_quantization_flag():
    from cbatch.entrypoints.cli.engine_args import engine_kwargs
    from cbatch.entrypoints.cli.main import build_parser

    args = build_parser().parse_args(["generate", "--prompt", "x", "--quantization", "int4"])
    assert engine_kwargs(args)["quantization"] == "int4"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--quantization", "fp8"])


@pytest.mark.parametrize("method,hint", [("int4", "w4a8"), ("int8", None), ("w4a8", None)])
def test_online_int4_on_a_cpu_names_the_faster_kernel(caplog, method, hint):
    """``quantization="int4"`` keeps float activations; on a CPU the load says that ``w4a8``
    runs the same int4 weights with int8 activations, faster (as OpenVINO's int4 runs on a
    CPU); the other methods say nothing of the kind."""
    with caplog.at_level("INFO", logger="cbatch"):
        load_model("random:llama-tiny", quantization=method)
    said = [r.getMessage() for r in caplog.records if "would run these weights" in r.message]
    assert said == ([f"quantization={hint!r} would run these weights with int8 activations, "
                     "faster on a CPU (benchmarks/NOTES.md, GPTQ as W4A8)"] if hint else [])
