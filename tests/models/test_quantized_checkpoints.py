"""Quantized checkpoints (GPTQ, AWQ, compressed-tensors) as vLLM loads them.

A writer here makes tiny random Llama/Qwen2 checkpoints in each format from float weights,
quantizing and packing them with plain torch code written from each format's description
(not the loader's), and saves beside each the same model with the dequantized weights as a
float checkpoint: the oracle.  The quantized model's logits must equal the oracle's (fp32:
only the order of the sums differs), through cbatch's quantized kernel."""

import json

import pytest
import torch
from safetensors.torch import save_file

from cbatch import LLM, SamplingParams, load_model
from cbatch.core.input_batch import prefill_logits
from cbatch.layers.linear import Linear
from cbatch.layers.quantization import QuantizedLinear
from cbatch.layers.stacked_linear import StackedLinear
from cbatch.ops import cpu
from cbatch.ops import quantized
from tests.helpers import int8_kernel_calls

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# hidden 160 (5 heads of 32 over 1 KV head), intermediate 224: groups of 64 and 128 leave a
# short last group, and every K and N is a multiple of 8 (GPTQ and AWQ pack 8 nibbles a word)
SHAPE = dict(vocab_size=300, hidden_size=160, intermediate_size=224, num_hidden_layers=2,
             num_attention_heads=5, num_key_value_heads=1, head_dim=32,
             max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
             hidden_act="silu", bos_token_id=1, eos_token_id=2)
PROJ = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
        "mlp": ("gate_proj", "up_proj", "down_proj")}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of a word holds column 8c + AWQ_ORDER[j]


def float_weights(arch: str, tied: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    H, F, V = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
    D, kv = SHAPE["head_dim"], SHAPE["num_key_value_heads"]
    out_in = {"q_proj": (H, H), "k_proj": (kv * D, H), "v_proj": (kv * D, H),
              "o_proj": (H, H), "gate_proj": (F, H), "up_proj": (F, H), "down_proj": (H, F)}

    def randn(*shape, std=0.05):
        return torch.randn(*shape, generator=gen) * std

    w = {"model.embed_tokens.weight": randn(V, H, std=0.5), "model.norm.weight": 1 + randn(H)}
    if not tied:
        w["lm_head.weight"] = randn(V, H, std=0.2)
    for i in range(SHAPE["num_hidden_layers"]):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = 1 + randn(H)
        w[f"{p}.post_attention_layernorm.weight"] = 1 + randn(H)
        for block, projs in PROJ.items():
            for proj in projs:
                w[f"{p}.{block}.{proj}.weight"] = randn(*out_in[proj])
                if arch == "Qwen2ForCausalLM" and proj in ("q_proj", "k_proj", "v_proj"):
                    w[f"{p}.{block}.{proj}.bias"] = randn(out_in[proj][0], std=0.5)
    return w


def quantize(w: torch.Tensor, bits: int, group: torch.Tensor, sym: bool, zero_min: int = 0):
    """Round-to-nearest per group (``group[k]``: k's group): unsigned q [N, K] in
    [0, 2^bits), scales [G, N] (fp16-rounded) and zero points [G, N]; the dequantized weight."""
    maxq, G = 2 ** bits - 1, int(group.max()) + 1
    N = w.shape[0]
    scales, zeros = torch.empty(G, N), torch.empty(G, N)
    for g in range(G):
        cols = w[:, group == g]
        lo, hi = cols.min(1).values.clamp(max=0), cols.max(1).values.clamp(min=0)
        if sym:
            hi = torch.maximum(-lo, hi)
            lo = -hi
        s = ((hi - lo) / maxq).half().float()
        scales[g] = s
        zeros[g] = torch.full_like(s, (maxq + 1) // 2) if sym else \
            (-lo / s).round().clamp(zero_min, maxq)
    q = (w / scales[group].t()).round() + zeros[group].t()
    q = q.clamp(0, maxq)
    deq = scales[group].t() * (q - zeros[group].t())
    return q.long(), scales, zeros.long(), deq


def pack_words(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned ``values`` packed 32 / bits to an int32 word along ``dim``, lowest bits first
    (zero padding at the end)."""
    p = 32 // bits
    v = values.movedim(dim, -1).long()
    v = torch.nn.functional.pad(v, (0, -v.shape[-1] % p))
    v = v.view(*v.shape[:-1], -1, p)
    words = sum(v[..., j] << (bits * j) for j in range(p))
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def write(path, config: dict, tensors: dict) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return str(path)


def make_checkpoint(tmp_path, fmt: str, arch="LlamaForCausalLM", tied=False, bits=4, gs=128,
                    sym=True, desc_act=False, checkpoint_format="gptq", seed=0):
    """(quantized checkpoint, float checkpoint of the dequantized weights)."""
    config = dict(SHAPE, architectures=[arch], tie_word_embeddings=tied,
                  model_type="qwen2" if arch == "Qwen2ForCausalLM" else "llama")
    dense = float_weights(arch, tied, seed)
    quantized = {k: v for k, v in dense.items()}
    gen = torch.Generator().manual_seed(seed + 1)
    orders: dict = {}
    for name in [n for n in dense if n.endswith("_proj.weight")]:
        w = dense[name]
        prefix = name.removesuffix(".weight")
        N, K = w.shape
        size = K if gs == -1 else gs
        if desc_act:  # one order per input: q/k/v share one, gate/up another
            key = (prefix.rsplit(".", 1)[0], K, "o_proj" in name or "down_proj" in name)
            if key not in orders:
                perm = torch.randperm(K, generator=gen)
                orders[key] = torch.empty(K, dtype=torch.long)
                orders[key][perm] = torch.arange(K) // size
            group = orders[key]
        else:
            group = torch.arange(K) // size
        del quantized[name]
        if fmt == "gptq":
            v1 = int(checkpoint_format == "gptq")  # the classic format: zero minus one
            q, s, z, deq = quantize(w, bits, group, sym, zero_min=v1)
            stored_z = z - v1
            quantized[f"{prefix}.qweight"] = pack_words(q.t(), bits, 0)  # [K / p, N]
            quantized[f"{prefix}.qzeros"] = pack_words(stored_z, bits, 1)  # [G, N / p]
            quantized[f"{prefix}.scales"] = s.half()
            quantized[f"{prefix}.g_idx"] = group.int()
        elif fmt == "awq":
            q, s, z, deq = quantize(w, 4, group, sym=False)
            order = torch.tensor([8 * c + o for c in range(N // 8) for o in AWQ_ORDER])
            quantized[f"{prefix}.qweight"] = pack_words(q.t()[:, order], 4, 1)  # [K, N / 8]
            quantized[f"{prefix}.qzeros"] = pack_words(z[:, order], 4, 1)
            quantized[f"{prefix}.scales"] = s.half()
        elif fmt == "w8a8":  # compressed-tensors int8: q [N, K], one scale per channel
            s = (w.abs().amax(1, keepdim=True) / 127).to(torch.bfloat16)
            q = (w / s.float()).round().clamp(-128, 127).to(torch.int8)
            quantized[f"{prefix}.weight"] = q
            quantized[f"{prefix}.weight_scale"] = s
            deq = s.float() * q.float()
        else:  # compressed-tensors pack-quantized, symmetric: signed q stored plus 2^(b-1)
            q, s, z, deq = quantize(w, bits, group, sym=True)
            quantized[f"{prefix}.weight_packed"] = pack_words(q, bits, 1)  # [N, ceil(K / p)]
            quantized[f"{prefix}.weight_scale"] = s.t().to(torch.bfloat16)
            quantized[f"{prefix}.weight_shape"] = torch.tensor([N, K])
            deq = s.t().to(torch.bfloat16).float()[:, group] * (q - z[group].t())
        dense[name] = deq
    if fmt == "gptq":
        qc = {"quant_method": "gptq", "bits": bits, "group_size": gs, "sym": sym,
              "desc_act": desc_act, "checkpoint_format": checkpoint_format}
    elif fmt == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": gs, "zero_point": True,
              "version": "gemm", "modules_to_not_convert": None}
    else:
        weights = {"num_bits": bits, "type": "int", "symmetric": True, "dynamic": False,
                   "strategy": "group" if gs != -1 else "channel",
                   "group_size": gs if gs != -1 else None, "actorder": None}
        acts = None
        if fmt == "w8a8":
            weights.update(num_bits=8, strategy="channel", group_size=None)
            acts = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True,
                    "strategy": "token"}
        qc = {"quant_method": "compressed-tensors",
              "format": "int-quantized" if fmt == "w8a8" else "pack-quantized",
              "quantization_status": "compressed", "ignore": ["lm_head"],
              "kv_cache_scheme": None, "sparsity_config": {},
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                            "input_activations": acts,
                                            "output_activations": None}}}
    return (write(tmp_path / fmt, dict(config, quantization_config=qc), quantized),
            write(tmp_path / "dense", config, dense))


PROMPTS = [[5, 17, 200, 3], [9] * 19, list(range(40, 73))]


def check_against_oracle(quantized_dir, dense_dir, bits):
    model, oracle = load_model(quantized_dir), load_model(dense_dir)
    replaced = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(replaced) == 4 * SHAPE["num_hidden_layers"]
    assert all(m.bits == bits for m in replaced)
    assert isinstance(model.lm_head, Linear)
    path = f"quantized_linear.w{bits}.{quantized.isa('w8a16')}"
    before = cpu.kernel_paths().get(path, 0)
    got = torch.cat(prefill_logits(model, PROMPTS))
    if quantized.available("w8a16"):
        assert cpu.kernel_paths()[path] > before
    torch.testing.assert_close(got, torch.cat(prefill_logits(oracle, PROMPTS)),
                               atol=1e-4, rtol=1e-4)
    return model


# (bits, group_size, sym, desc_act): each bit width and group size symmetric and not, with
# desc_act and without; each bit width every (sym, desc_act) pair twice
GPTQ_CASES = [(4, 32, True, False), (4, 32, False, True), (4, 64, True, True),
              (4, 64, False, False), (4, 128, True, False), (4, 128, False, True),
              (4, -1, True, True), (4, -1, False, False),
              (8, 32, True, True), (8, 32, False, False), (8, 64, True, False),
              (8, 64, False, True), (8, 128, True, True), (8, 128, False, False),
              (8, -1, True, False), (8, -1, False, True)]


@pytest.mark.parametrize("bits,gs,sym,desc_act", GPTQ_CASES)
def test_gptq(tmp_path, bits, gs, sym, desc_act):
    q, dense = make_checkpoint(tmp_path, "gptq", bits=bits, gs=gs, sym=sym, desc_act=desc_act)
    model = check_against_oracle(q, dense, bits)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert (qkv.perm is not None) == (desc_act and gs != -1)
    assert (qkv.zeros is None) == sym


def test_gptq_v2_format_stores_zero_points_as_they_are(tmp_path):
    q, dense = make_checkpoint(tmp_path, "gptq", bits=4, gs=32, sym=False,
                               checkpoint_format="gptq_v2")
    check_against_oracle(q, dense, 4)


@pytest.mark.parametrize("arch,tied,gs", [("Qwen2ForCausalLM", True, 32),
                                          ("LlamaForCausalLM", True, 32),
                                          ("Qwen2ForCausalLM", False, 32),
                                          ("LlamaForCausalLM", False, 128)])  # AutoAWQ's own
def test_awq_gemm(tmp_path, arch, tied, gs):
    q, dense = make_checkpoint(tmp_path, "awq", arch=arch, tied=tied, gs=gs)
    model = check_against_oracle(q, dense, 4)
    assert (model.model.layers[1].self_attn.qkv_proj.bias is not None) == \
        (arch == "Qwen2ForCausalLM")


@pytest.mark.parametrize("bits,gs", [(4, 32), (4, 128), (8, -1), (4, -1)])
def test_compressed_tensors_pack_quantized(tmp_path, bits, gs):
    q, dense = make_checkpoint(tmp_path, "ct", bits=bits, gs=gs, arch="Qwen2ForCausalLM")
    check_against_oracle(q, dense, bits)


def test_gptq_qwen2_with_bias_tied_head_against_transformers(tmp_path):
    """The oracle itself against transformers: the dequantized checkpoint's logits there."""
    transformers = pytest.importorskip("transformers")
    q, dense = make_checkpoint(tmp_path, "gptq", arch="Qwen2ForCausalLM", tied=True, gs=64,
                               sym=False, desc_act=True)
    model = load_model(q)
    hf = transformers.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPTS[2]])).logits[0]
    torch.testing.assert_close(prefill_logits(model, [PROMPTS[2]])[0], expected,
                               atol=1e-4, rtol=1e-4)


def test_engine_generates_from_a_gptq_checkpoint(tmp_path):
    q, dense = make_checkpoint(tmp_path, "gptq", gs=32, desc_act=True)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ours = LLM(q, max_num_seqs=4, quantization="gptq")  # the checkpoint's own method: allowed
    outs = ours.generate(PROMPTS[:2], greedy, use_tqdm=False)
    want = LLM(dense, max_num_seqs=4).generate(PROMPTS[:2], greedy, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert ours.engine.runner.describe()["quantized linear"].startswith("int4 g32, 8 layers")


def _edit(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_quant_method_is_read_case_blind_as_vllm_reads_it(tmp_path):
    q, dense = make_checkpoint(tmp_path, "gptq", gs=32)
    _edit(tmp_path / "gptq", quant_method="GPTQ")
    check_against_oracle(q, dense, 4)


@pytest.mark.parametrize("fmt,changes,message", [
    ("gptq", {"bits": 3}, "GPTQ bits=3"),
    ("gptq", {"checkpoint_format": "marlin"}, "GPTQ checkpoint_format 'marlin'"),
    ("gptq", {"lm_head": True}, "GPTQ-quantized lm_head"),
    ("gptq", {"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    ("awq", {"version": "gemv"}, "AWQ version 'gemv'"),
    ("awq", {"zero_point": False}, "AWQ without zero points"),
    ("ct", {"format": "marlin-24"}, "compressed-tensors W4A16 in format 'marlin-24'"),
    ("ct", {"kv_cache_scheme": {"num_bits": 8}}, "compressed-tensors' quantized KV cache"),
])
def test_unsupported_options_are_refused_by_name(tmp_path, fmt, changes, message):
    q, _ = make_checkpoint(tmp_path, fmt, gs=32)
    _edit(tmp_path / fmt, **changes)
    with pytest.raises(ValueError, match=message) as info:
        load_model(q)
    assert str(tmp_path / fmt / "config.json") in str(info.value)


@pytest.mark.parametrize("tied", [True, False])
def test_compressed_tensors_w8a8(tmp_path, tied):
    """W8A8: each layer's output is the test's own per-token int8 quantization of x times the
    checkpoint's int8 weights (exact integer sums, then both scales); the model's logits stay
    near those of the dequantized float model (x's rounding is the only difference) and its
    greedy tokens are the same."""
    q, dense = make_checkpoint(tmp_path, "w8a8", arch="Qwen2ForCausalLM", tied=tied)
    model, oracle = load_model(q), load_model(dense)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 * SHAPE["num_hidden_layers"]
    assert all(m.act_bits == 8 for m in layers)
    from safetensors.torch import load_file

    saved = load_file(f"{q}/model.safetensors")
    w = saved["model.layers.1.mlp.down_proj.weight"].double()  # int8 [N, K]
    s = saved["model.layers.1.mlp.down_proj.weight_scale"].double()  # [N, 1]
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(4))
    x[2] = 0  # a row of zeros: scale 0
    top = x.abs().amax(1, keepdim=True).double()
    xq = torch.where(top > 0, (x.double() * 127 / top).round(), 0)
    expected = (xq @ w.t()) * (top / 127) * s.t()
    path = f"quantized_linear.w8a8.{quantized.isa('w8a8')}"
    before = cpu.kernel_paths().get(path, 0)
    with torch.no_grad():
        got = model.model.layers[1].mlp.down_proj(x)
    if quantized.available("w8a16"):  # cbatch's W8A8 kernel ran, not the reference
        assert cpu.kernel_paths()[path] == before + 1
    torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=1e-5)
    got, want = (torch.cat(prefill_logits(m, PROMPTS)) for m in (model, oracle))
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("change,message", [
    ({"dynamic": False}, "W8A8 with static or asymmetric activation scales"),
    ({"strategy": "tensor"}, "W8A8 with static"),
    ({"num_bits": 4}, "W8A4 in format 'int-quantized'"),
])
def test_compressed_tensors_w8a8_options_refused_by_name(tmp_path, change, message):
    q, _ = make_checkpoint(tmp_path, "w8a8")
    config = json.loads((tmp_path / "w8a8" / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"].update(
        change)
    (tmp_path / "w8a8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_model(q)


def test_explicit_quantization_must_match_the_checkpoint(tmp_path):
    q, dense = make_checkpoint(tmp_path, "gptq", gs=32)
    with pytest.raises(ValueError, match="quantized by gptq .* quantization='int8' contradicts"):
        load_model(q, quantization="int8")
    with pytest.raises(ValueError, match="quantization='awq' contradicts"):
        load_model(q, quantization="awq")
    with pytest.raises(ValueError, match="has no quantization_config: it is no gptq checkpoint"):
        load_model(dense, quantization="gptq")
    with pytest.raises(ValueError, match="loads a gptq checkpoint, not random:llama-tiny"):
        load_model("random:llama-tiny", quantization="gptq")
    with pytest.raises(ValueError, match="runs activations of float32, bfloat16 on cpu; "
                                         "float32, bfloat16, float16 on cuda: not float16 on "
                                         "cpu"):
        load_model(q, dtype=torch.float16)


# (format, group_size, sym, desc_act, tied): int4 checkpoints run as W4A8
W4A8_CASES = [("gptq", 32, True, False, True), ("gptq", 64, True, True, False),
              ("gptq", 128, False, False, False), ("gptq", -1, False, True, True),
              ("ct", 32, True, False, False), ("awq", 32, False, False, True),
              ("awq", 128, False, False, False)]


def own_w4a8(x: torch.Tensor, w: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """The test's own W4A8 of one layer: per row of x and group of k (``group[k]``) in fp32,
    ``q = round(x * (127 / max |x|))``, then each group's exact sum of q times the
    dequantized weight ``w`` ``[N, K]``, scaled by ``max |x| / 127``; float64 ``[M, N]``."""
    y = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)
    for g in group.unique():
        cols = group == g
        top = x[:, cols].abs().amax(1, keepdim=True)
        q = torch.where(top > 0, (x[:, cols] * (127 / top)).round(), 0)
        y += (q.double() @ w[:, cols].double().t()) * (top.double() / 127)
    return y


@pytest.mark.parametrize("fmt,gs,sym,desc_act,tied", W4A8_CASES)
def test_an_int4_checkpoint_runs_w4a8(tmp_path, fmt, gs, sym, desc_act, tied, monkeypatch):
    """quantization="w4a8" on an int4 checkpoint: its own weights and zero points, unchanged,
    run cbatch's W4A8 kernel (x int8 per token and group, the groups the checkpoint's, desc_act
    orders too), and the lm_head becomes int8 as online w4a8 makes it.  One layer equals the
    test's own W4A8 (:func:`own_w4a8`) on the dequantized weights; the model's logits are
    those of the same layers on the pure-torch reference, and within 3% of the largest logit
    of the dequantized float model (what int8 x and the int8 lm_head cost)."""
    q, dense = make_checkpoint(tmp_path, fmt, bits=4, gs=gs, sym=sym, desc_act=desc_act,
                               tied=tied)
    model, oracle = load_model(q, quantization="w4a8"), load_model(dense)
    head = model.lm_head
    assert isinstance(head, QuantizedLinear) and (head.bits, head.act_bits) == (8, 8)
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear) and m is not head]
    assert len(layers) == 4 * SHAPE["num_hidden_layers"]
    assert all((m.bits, m.act_bits, m.group_size) == (4, 8, 224 if gs == -1 else gs)
               for m in layers if m.in_features == 224)
    assert all((m.zeros is None) == (sym and fmt != "awq") for m in layers)
    from safetensors.torch import load_file

    name = "model.layers.1.mlp.down_proj"
    w = load_file(f"{dense}/model.safetensors")[f"{name}.weight"]  # [160, 224]
    group = load_file(f"{q}/model.safetensors")[f"{name}.g_idx"].long() if fmt == "gptq" \
        else torch.arange(224) // gs
    x = torch.randn(5, 224, generator=torch.Generator().manual_seed(4))
    x[2] = 0  # a row of zeros: scale 0
    before = [int8_kernel_calls("w4a8"), int8_kernel_calls("w8a8")]
    with torch.no_grad():
        got = model.get_submodule(name)(x)
    torch.testing.assert_close(got.double(), own_w4a8(x, w, group), atol=1e-5, rtol=1e-5)
    ours = torch.cat(prefill_logits(model, PROMPTS))
    moved = [int8_kernel_calls(op) - b for op, b in zip(("w4a8", "w8a8"), before)]
    assert moved[0] >= 1 + len(layers) or not quantized.available("w4a8")
    assert moved[1] >= 1 or not quantized.available("w8a16")  # the lm_head
    monkeypatch.setattr(quantized, "available", lambda kind: False)
    torch.testing.assert_close(ours, torch.cat(prefill_logits(model, PROMPTS)),
                               atol=1e-5, rtol=1e-5)
    want = torch.cat(prefill_logits(oracle, PROMPTS))
    assert (ours - want).abs().max() < 0.03 * want.abs().max()


def test_an_int8_per_channel_checkpoint_runs_w8a8(tmp_path):
    """quantization="w8a8" on GPTQ's symmetric 8-bit weights with one group per channel:
    W8A8 on its own weights; the lm_head stays float (as under online w8a8)."""
    q, dense = make_checkpoint(tmp_path, "gptq", bits=8, gs=-1, desc_act=True)
    model = load_model(q, quantization="w8a8")
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 * SHAPE["num_hidden_layers"]
    assert all((m.bits, m.act_bits) == (8, 8) for m in layers)
    assert isinstance(model.lm_head, Linear)
    before = int8_kernel_calls("w8a8")
    got = torch.cat(prefill_logits(model, PROMPTS))
    assert int8_kernel_calls("w8a8") > before or not quantized.available("w8a16")
    want = torch.cat(prefill_logits(load_model(dense), PROMPTS))
    assert (got - want).abs().max() < 0.02 * want.abs().max()


@pytest.mark.parametrize("fmt,bits,gs,kernel,has", [
    ("gptq", 4, 32, "w8a8", "4-bit weights in groups of 32 k of (160|224) \\("),
    ("gptq", 8, 64, "w8a8", "8-bit weights in groups of 64 k of (160|224) \\("),
    ("gptq", 8, -1, "w4a8", "8-bit weights in groups of (160 k of 160|224 k of 224) \\("),
    ("awq", 4, 32, "w8a8", "4-bit weights in groups of 32 k of (160|224) with zero points"),
])
def test_weights_an_int8_activation_kernel_does_not_take_are_refused(tmp_path, fmt, bits, gs,
                                                                      kernel, has):
    q, _ = make_checkpoint(tmp_path, fmt, bits=bits, gs=gs)
    takes = "int4 in groups" if kernel == "w4a8" else "symmetric int8 with one"
    with pytest.raises(ValueError, match=f"quantization='{kernel}' runs {takes}.*; "
                                         f"model\\.layers\\.[01]\\.[a-z_.]+ holds {has}"):
        load_model(q, quantization=kernel)
    asymmetric, _ = make_checkpoint(tmp_path / "asym", "gptq", bits=8, gs=-1, sym=False)
    with pytest.raises(ValueError, match="with zero points \\(leave quantization unset"):
        load_model(asymmetric, quantization="w8a8")


@pytest.mark.parametrize("fmt,bits,gs,sym,hint", [
    ("gptq", 4, 64, True, "w4a8"), ("ct", 8, -1, True, "w8a8"), ("awq", 4, 64, False, "w4a8"),
    ("gptq", 8, 32, True, None), ("gptq", 8, -1, False, None), ("w8a8", 8, -1, True, None)])
def test_a_checkpoint_that_a_faster_kernel_runs_says_so_at_load(tmp_path, caplog, fmt, bits,
                                                                   gs, sym, hint):
    q, _ = make_checkpoint(tmp_path, fmt, bits=bits, gs=gs, sym=sym)
    with caplog.at_level("INFO", logger="cbatch"):
        load_model(q)
    said = [r.getMessage() for r in caplog.records if "would run these weights" in r.message]
    assert said == ([f"quantization={hint!r} would run these weights with int8 activations, "
                     "faster on a CPU (benchmarks/NOTES.md, GPTQ as W4A8)"] if hint else [])


@pytest.mark.parametrize("fmt", ["gptq", "awq"])  # symmetric; zero points
def test_engine_runs_an_int4_checkpoint_as_w4a8_in_one_layers_call(tmp_path, monkeypatch, fmt):
    """An engine on a GPTQ or AWQ checkpoint under quantization="w4a8" says so, binds its
    layers for the one C++ call (csrc/cpu/decoder_layers.cpp, zero points and all), and gives
    the Python loop's tokens and log-probabilities to the last bit."""
    if not quantized.available("w4a8") or not hasattr(torch.ops.cbatch,
                                                                "decoder_layers"):
        pytest.skip("the W4A8 kernel or the one-call layers do not run here")
    from tests.models.test_cpu_layers import run

    q, _ = make_checkpoint(tmp_path, fmt, gs=32, tied=True)
    make = lambda: load_model(q, quantization="w4a8")  # noqa: E731
    assert (make().model.layers[0].mlp.down_proj.zeros is None) == (fmt == "gptq")
    ours, calls, phrase = run(monkeypatch, "1", make)
    loop, _, _ = run(monkeypatch, "0", make)
    assert phrase == "one C++ call" and calls >= 12
    assert ours == loop
    llm = LLM(q, max_num_seqs=2, quantization="w4a8")
    assert llm.engine.runner.describe()["quantized linear"].startswith(
        "w4a8 g32, w8a8, 9 layers" if fmt == "gptq" else "w4a8 g32 zp, w8a8, 9 layers")


def _rewrite(path, name, fn):
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    tensors[name] = fn(tensors[name])
    save_file(tensors, str(path / "model.safetensors"))


def test_desc_act_orders_that_cbatch_cannot_run_are_refused(tmp_path):
    """Shards of one projection in different orders of k run side by side (StackedLinear,
    each its own permutation); groups that are not all group_size long are refused."""
    q, _ = make_checkpoint(tmp_path, "gptq", gs=32, desc_act=True)
    path = tmp_path / "gptq"
    x = torch.randn(3, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(5))
    before = load_model(q).model.layers[0].self_attn.qkv_proj
    _rewrite(path, "model.layers.0.self_attn.k_proj.g_idx", lambda g: g.flip(0))
    stacked = load_model(q).model.layers[0].self_attn.qkv_proj
    assert isinstance(stacked, StackedLinear) and len(stacked.parts) == 3
    q_rows = SHAPE["hidden_size"]
    with torch.no_grad():  # q and v as before: the same weights, each its own order of k
        torch.testing.assert_close(stacked(x)[:, :q_rows], before(x)[:, :q_rows])
    _rewrite(path, "model.layers.0.self_attn.k_proj.g_idx", lambda g: g.flip(0))
    ragged = lambda g: torch.where(g == 0, 1, g)  # noqa: E731  group 1 twice as long, 0 empty
    _rewrite(path, "model.layers.0.mlp.down_proj.g_idx", ragged)
    with pytest.raises(ValueError, match="ragged desc_act groups"):
        load_model(q)


def test_a_quantized_layer_whose_bias_the_config_does_not_match_is_refused(tmp_path):
    q, _ = make_checkpoint(tmp_path, "awq", arch="Qwen2ForCausalLM", gs=32)
    path = tmp_path / "awq"
    config = json.loads((path / "config.json").read_text())
    config["architectures"], config["model_type"] = ["LlamaForCausalLM"], "llama"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="model.layers.0.self_attn.qkv_proj's bias is "
                                         "unexpected"):
        load_model(q)


def test_a_quantized_checkpoint_on_gpt2_is_refused(tmp_path):
    config = {"architectures": ["GPT2LMHeadModel"], "vocab_size": 300, "n_embd": 32,
              "n_layer": 1, "n_head": 2, "n_positions": 64,
              "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32}}
    path = write(tmp_path / "g", config, {"wte.weight": torch.zeros(300, 32)})
    with pytest.raises(ValueError, match="quantized GPT2LMHeadModel checkpoint is not "
                                         "supported"):
        load_model(path)


def test_quantized_linear_gathers_x_into_its_perm():
    from cbatch.layers.quantization import quantize

    gen = torch.Generator().manual_seed(7)
    weight = quantize(torch.randn(24, 40, generator=gen), 4, 8)
    perm = torch.randperm(40, generator=gen)
    x = torch.randn(3, 40, generator=gen)
    with torch.no_grad():
        got = QuantizedLinear(weight, None, perm=perm)(x)
    torch.testing.assert_close(got, x[:, perm] @ weight.dequantize().t(), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="perm must be int64 \\[40\\], got torch.int32"):
        QuantizedLinear(weight, perm=perm.int())
