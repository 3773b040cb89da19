"""A CPU engine runs a Llama-family model's decoder layers in one C++ call a step
(``cbatch::decoder_layers``, :mod:`cbatch.models.cpu_layers`): the same kernels in the same
order as the Python loop, so the same tokens and the same log-probabilities to the last bit,
for every weight format, with and without biases and q/k norms, prefill, mixed and decode
steps; where it cannot bind, it says why and the loop runs."""

import pytest
import torch

from cbatch import Engine, SamplingParams, load_model
from cbatch.entrypoints.llm import generate
from cbatch.layers.quantization import QuantizedLinear, quantize, quantize_model
from cbatch.layers.stacked_linear import StackedLinear
from cbatch.quantization import METHODS
from cbatch.models import cpu_layers
from cbatch.models.llama import LlamaConfig, LlamaForCausalLM
from cbatch.ops import cpu, layer_ops
from cbatch.ops import quantized
from tests.quant_utils import quantize_with_mins

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.skipif(not layer_ops.kernels_available(),
                       reason="the C++ CPU kernels are not compiled in"),
]

PATH = "decoder_layers.cpu"
ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def tiny_llama(quantization: str | None, dtype: torch.dtype, extras: bool) -> LlamaForCausalLM:
    """3 layers, GQA 4:2, head_dim 32 (the AVX2 and AVX-512 attention steps), tied embeddings;
    ``extras``: every linear with a bias and per-head q/k norms (Qwen2's and Qwen3's switches),
    made non-trivial so that a dropped one shows."""
    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        rms_norm_eps=1e-5, rope=ROPE, tie_word_embeddings=True, bos_token_id=0,
        eos_token_id=511, qkv_bias=extras, o_bias=extras, mlp_bias=extras, qk_norm=extras)
    model = LlamaForCausalLM(config)
    model.init_random(7)
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)  # not 0 and 1
    model = model.to(dtype).eval()
    if quantization:
        quantize_model(model, METHODS[quantization])
    return model


def run(monkeypatch, flag: str, make, **engine_args) -> tuple[list, int, str]:
    """(each request's tokens and log-probabilities, decoder_layers calls, the runner's
    phrase) of one engine with $CBATCH_CPU_LAYERS = flag over three prompts of different
    lengths: prefill chunks beside decode tokens, greedy, sampled and with logprobs."""
    monkeypatch.setenv("CBATCH_CPU_LAYERS", flag)
    engine = Engine(make(), max_num_seqs=4, max_num_batched_tokens=48, num_blocks=64,
                    block_size=16, enable_prefix_caching=False, **engine_args)
    before = cpu.kernel_paths().get(PATH, 0)
    prompts = [list(range(1, 40)), [5, 6, 7], list(range(7, 90))]
    params = [SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=2),
              SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, top_p=0.9,
                             seed=3),
              SamplingParams(max_tokens=10, ignore_eos=True)]
    outs = generate(engine, prompts, params)
    calls = cpu.kernel_paths().get(PATH, 0) - before
    phrase = engine.runner.describe()["decoder layers"]
    return ([(o.token_ids, o.logprobs, o.prompt_logprobs) for o in outs], calls, phrase)


@pytest.mark.parametrize("extras", [False, True], ids=["llama", "biases-qk-norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("quantization", [None, "int8", "int4", "w8a8", "w4a8"])
def test_one_call_gives_the_loops_tokens_and_logprobs(monkeypatch, quantization, dtype, extras):
    if quantization and not quantized.available("w8a16"):
        pytest.skip("cbatch's quantized CPU kernels do not run here")
    if quantization == "w4a8" and not quantized.available("w4a8"):
        pytest.skip("the W4A8 kernel needs AVX2")
    if quantization is None and cpu.cpu_linear_route(dtype) != "cbatch":
        pytest.skip(f"cbatch's packed linear does not run {dtype} here")
    make = lambda: tiny_llama(quantization, dtype, extras)  # noqa: E731
    ours, calls, phrase = run(monkeypatch, "1", make)
    loop, loop_calls, loop_phrase = run(monkeypatch, "0", make)
    assert phrase == "one C++ call" and calls >= 12  # every step (prefill, mixed, decode)
    assert loop_phrase == "op by op: off (CBATCH_CPU_LAYERS=0)" and loop_calls == 0
    assert ours == loop  # tokens, and every log-probability to the last bit


def with_mins(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """``model`` with each quantized linear but W8A8's (a w4a8 model's lm_head) requantized
    with float mins, min-max per group (llama.cpp's Q4_1 rule)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantizedLinear) and child.kind != "w8a8":
                weight = quantize_with_mins(child.weight.dequantize(), child.bits,
                                            child.group_size)
                setattr(parent, name, QuantizedLinear(weight, child.bias, child.act_bits))
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("quantization", ["int8", "int4", "w4a8"])
def test_one_call_runs_mins_as_the_loop(monkeypatch, quantization, dtype):
    """Linear layers with float mins (W = s q - m, GGUF's Q4_K and Q4_1) bind their mins
    (one more tensor slot a linear) and give the loop's tokens and log-probabilities."""
    if not quantized.available("w8a16"):
        pytest.skip("cbatch's quantized CPU kernels do not run here")
    if quantization == "w4a8" and not quantized.available("w4a8"):
        pytest.skip("the W4A8 kernel needs AVX2")
    make = lambda: with_mins(tiny_llama(quantization, dtype, True))  # noqa: E731
    model = make()
    layer = model.model.layers[0].mlp.down_proj
    assert layer.mins is not None and layer.zeros is None
    bound = cpu_layers.bind(model)
    assert any(t is layer.mins for t in bound.tensors)
    ours, calls, phrase = run(monkeypatch, "1", make)
    loop, loop_calls, _ = run(monkeypatch, "0", make)
    assert phrase == "one C++ call" and calls >= 12 and loop_calls == 0
    assert ours == loop


def stacked(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """``model`` (int4) with each layer's qkv_proj a StackedLinear: q and k int4 with float
    mins, v int8 per group of 16 (llama.cpp's Q4_K_M keeps attn_v at 6 bits)."""
    rows = model.config.num_attention_heads * model.config.head_dim
    rows += model.config.num_key_value_heads * model.config.head_dim
    for layer in model.model.layers:
        old = layer.self_attn.qkv_proj
        w = old.weight.dequantize()
        bias = old.bias
        qk = QuantizedLinear(quantize_with_mins(w[:rows], 4, 32),
                             None if bias is None else bias[:rows])
        v = QuantizedLinear(quantize(w[rows:], 8, 16), None if bias is None else bias[rows:])
        layer.self_attn.qkv_proj = StackedLinear([qk, v])
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_call_runs_a_stacked_projection_as_the_loop(monkeypatch, dtype):
    """A projection of parts in different forms binds each part (a linear's number of parts,
    then theirs) and gives the loop's tokens and log-probabilities."""
    if not quantized.available("w8a16"):
        pytest.skip("cbatch's quantized CPU kernels do not run here")
    make = lambda: stacked(tiny_llama("int4", dtype, True))  # noqa: E731
    bound = cpu_layers.bind(make())
    assert isinstance(bound, cpu_layers.BoundLayers) and bound.ints[0] == 2
    ours, calls, phrase = run(monkeypatch, "1", make)
    loop, loop_calls, _ = run(monkeypatch, "0", make)
    assert phrase == "one C++ call" and calls >= 12 and loop_calls == 0
    assert ours == loop


def test_batch_invariant_engines_bind_too(monkeypatch):
    """Batch-invariant mode (every step on the prefill kernel, no AMX) binds the same way, and
    its tokens are the loop's."""
    if cpu.cpu_linear_route(torch.float32) != "cbatch":
        pytest.skip("cbatch's packed linear does not run fp32 here")
    make = lambda: tiny_llama(None, torch.float32, True)  # noqa: E731
    ours, calls, phrase = run(monkeypatch, "1", make, batch_invariant=True)
    loop, _, _ = run(monkeypatch, "0", make, batch_invariant=True)
    assert phrase == "one C++ call" and calls > 0
    assert ours == loop


def test_what_cannot_bind_says_why(monkeypatch):
    """A GPTQ desc_act permutation (an index_select the C++ call does not make), and GPT-2
    (no one-call path) keep the loop, and say so; rebinding after set_batch_invariant."""
    if not quantized.available("w8a16"):
        pytest.skip("cbatch's quantized CPU kernels do not run here")
    model = tiny_llama("int4", torch.float32, False)
    assert isinstance(cpu_layers.bind(model), cpu_layers.BoundLayers)
    layer = model.model.layers[1].mlp.down_proj
    layer._buffers["perm"] = torch.arange(layer.in_features)
    assert cpu_layers.bind(model) == "a GPTQ desc_act permutation"
    assert load_model("random:tiny").bind_cpu_layers() == \
        "op by op (no one-call path for this architecture)"
    layer._buffers["perm"] = None
    assert model.bind_cpu_layers() == "one C++ call"
    model.set_batch_invariant(False)
    assert model.cpu_layers is None  # bound for one mode, dropped when it changes


def test_the_op_checks_its_lists():
    """Lists of the wrong length are a ValueError that says what was expected."""
    hidden = torch.zeros(2, 8)
    caches = [torch.zeros(4, 16, 1, 8)] * 2
    args = (torch.ones(8), 2, 1, 8, 1e-5, 0.35, torch.zeros(2, dtype=torch.int64),
            torch.zeros(16, 8), torch.zeros(2, dtype=torch.int64),
            torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
            torch.tensor([0, 2], dtype=torch.int32), False)
    with pytest.raises(ValueError, match="the layers need more than the 3 tensors given"):
        torch.ops.cbatch.decoder_layers(hidden, [None] * 3, [0] * 20, caches, *args)
    with pytest.raises(ValueError, match="a key and a value cache per layer"):
        torch.ops.cbatch.decoder_layers(hidden, [None] * 24, [0] * 20, caches[:1], *args)
