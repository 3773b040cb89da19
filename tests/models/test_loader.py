"""Checkpoint loading: real HF files made here, and every way they can be wrong."""

import json
import os
import shutil

import pytest
import torch

from cbatch import LLM, GPT2Config, KVCache, SamplingParams, bytes_per_token, load_model
from cbatch.core.input_batch import make_step_batch
from cbatch.models.gpt2 import GPT2LMHeadModel


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_loads_pytorch_model_bin(tiny_hf_dir, tiny_hf_model, tmp_path):
    path = tmp_path / "bin"
    path.mkdir()
    shutil.copy(tiny_hf_dir / "config.json", path)
    torch.save(tiny_hf_model.state_dict(), path / "pytorch_model.bin")
    ours = load_model(str(path))
    torch.testing.assert_close(ours.transformer.h[1].mlp.c_fc.weight,
                               tiny_hf_model.transformer.h[1].mlp.c_fc.weight.t())


def test_bare_gpt2model_checkpoint_names(tiny_hf_model):
    """Original GPT-2 checkpoints have no `transformer.` prefix and carry mask buffers."""
    raw = {k.removeprefix("transformer."): v for k, v in tiny_hf_model.state_dict().items()}
    raw["h.0.attn.bias"] = torch.ones(1)
    config = GPT2Config.named("tiny")
    converted = GPT2LMHeadModel.convert_hf_state_dict(raw, config)
    assert "transformer.h.0.attn.c_attn.weight" in converted
    assert "transformer.h.0.attn.bias" not in converted
    assert "transformer.h.0.attn.c_attn.bias" in converted


def test_missing_directory():
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_model("./no/such/checkpoint")


def test_unreachable_hub_id():
    with pytest.raises(FileNotFoundError, match="could not load 'nobody/no-such-model-xyz': "
                       "it is not a local directory, and the Hugging Face hub") as info:
        load_model("nobody/no-such-model-xyz")
    assert "\n" not in str(info.value)  # one sentence, not huggingface_hub's paragraphs
    with pytest.raises(FileNotFoundError, match="nor a valid hub id"):
        load_model("a/b/c")


def test_the_resolver_sits_below_models_and_tokenizer():
    """cbatch.hub resolves names for the loader and the tokenizer; the tokenizer imports no
    model code, and the loader's old names still work."""
    import ast
    import subprocess
    import sys
    from pathlib import Path

    import cbatch.hub
    import cbatch.models.loader
    import cbatch.tokenizer

    tree = ast.parse(Path(cbatch.tokenizer.__file__).read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert "cbatch.hub" in imported
    assert not [m for m in imported if m and m.startswith("cbatch.models")], imported
    assert cbatch.models.loader.resolve_checkpoint_dir is cbatch.hub.resolve_checkpoint_dir
    code = "import sys, cbatch.hub, cbatch.tokenizer; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"  # resolving a name or a tokenizer needs no torch


def test_missing_weights(tiny_hf_dir, tmp_path):
    path = _copy(tiny_hf_dir, tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError,
                       match="neither model.safetensors.* nor pytorch_model.bin"):
        load_model(str(path))


def test_missing_config(tiny_hf_dir, tmp_path):
    path = _copy(tiny_hf_dir, tmp_path / "m")
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(path))


def test_unknown_model_type(tiny_hf_dir, tmp_path):
    path = _copy(tiny_hf_dir, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="model_type is 'llama'"):
        load_model(str(path))


def test_wrong_shapes(tiny_hf_dir, tmp_path):
    path = _copy(tiny_hf_dir, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["n_embd"], cfg["n_head"] = 128, 4
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"c_attn.weight has shape \(64, 192\)"):
        load_model(str(path))


def test_wrong_vocab_size(tiny_hf_dir, tmp_path):
    path = _copy(tiny_hf_dir, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["vocab_size"] = 1000
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="wte.weight has shape"):
        load_model(str(path))


def test_missing_tensor(tiny_hf_model, tiny_hf_dir, tmp_path):
    from safetensors.torch import save_file

    path = _copy(tiny_hf_dir, tmp_path / "m")
    state = {k: v.contiguous() for k, v in tiny_hf_model.state_dict().items()
             if "h.1.ln_2" not in k and k != "lm_head.weight"}
    save_file(state, path / "model.safetensors")
    with pytest.raises(ValueError, match="missing.*h.1.ln_2"):
        load_model(str(path))


def test_positions_past_n_positions():
    llm = LLM(load_model("random:tiny"))
    with pytest.raises(ValueError, match=r"maximum length \(256\)"):
        llm.generate([[1] * 250], SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="past the model's n_positions = 256"):
        make_step_batch([[1] * 10], [250], [list(range(17))], 16, max_positions=256)


def test_unknown_named_size():
    with pytest.raises(ValueError, match="unknown model size 'gpt5'"):
        load_model("random:gpt5")


@pytest.mark.parametrize("name,layers,heads,dim", [
    ("gpt2", 12, 12, 768), ("gpt2-medium", 24, 16, 1024), ("gpt2-large", 36, 20, 1280),
    ("gpt2-xl", 48, 25, 1600), ("distilgpt2", 6, 12, 768)])
def test_named_configs(name, layers, heads, dim):
    c = GPT2Config.named(name)
    assert (c.n_layer, c.n_head, c.n_embd, c.head_dim) == (layers, heads, dim, 64)


def test_memory_per_token_and_cache_layout():
    gpt2 = GPT2Config.named("gpt2")
    assert bytes_per_token(gpt2, torch.float16) == 36 * 1024
    cache = KVCache(GPT2Config.named("tiny"), 64, block_size=16)
    assert cache.data.shape == (2, 2, 64, 16, 4, 16)
    k, v = cache.layer(1)
    assert k.is_contiguous() and v.is_contiguous() and k.shape == (64, 16, 4, 16)


def test_kv_cache_sized_from_memory():
    from cbatch.config import EngineConfig
    from cbatch.layers.kv_cache import num_kv_blocks

    tiny = GPT2Config.named("tiny")
    per_block = bytes_per_token(tiny, torch.float32) * 16
    assert num_kv_blocks(EngineConfig(kv_cache_memory=10 * per_block + 1), tiny) == 10
    with pytest.raises(ValueError, match="holds no block"):
        num_kv_blocks(EngineConfig(kv_cache_memory=per_block - 1), tiny)


def test_config_validation():
    with pytest.raises(ValueError, match="divisible"):
        GPT2Config(n_embd=100, n_head=12)
    with pytest.raises(ValueError, match="n_layer must be >= 1"):
        GPT2Config(n_layer=0)


@pytest.mark.parametrize("text, match", [
    ("{not json", r"config.json is not valid JSON: Expecting property name .* line 1, column 2"),
    ("[1, 2]", r"config.json holds an array, not the JSON object"),
    ('"gpt2"', r"config.json holds a string, not the JSON object"),
    ('{"architectures": "LlamaForCausalLM"}',
     r"config.json: architectures must be a list of class names, like \[\"LlamaForCausalLM\"\]; "
     r"got 'LlamaForCausalLM'"),
    ('{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}',
     r"config.json: field 'num_attention_heads' is missing \(a LlamaForCausalLM config needs it\)"),
    ('{"model_type": ["gpt2"]}', r"config.json: model_type \['gpt2'\] is not supported"),
])
def test_a_bad_config_json_is_named_and_said_once(tiny_hf_dir, tmp_path, text, match):
    """Every message names the file and says what is wrong with it, never an AttributeError
    or "X is not supported; cbatch runs ... X" (issue 41.14)."""
    path = _copy(tiny_hf_dir, tmp_path / "m")
    (path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=match) as exc:
        load_model(str(path))
    assert str(path / "config.json") in str(exc.value)


def test_outlier_shapes_put_a_few_channels_at_20_to_50x():
    """random:<shape>-outliers is <shape> with the same weights but its decoder norms, which are
    20-50 on the same 8 channels in every layer and 1 elsewhere."""
    from cbatch.models.registry import OUTLIER_CHANNELS

    base, outliers = load_model("random:llama-tiny"), load_model("random:llama-tiny-outliers")
    assert base.config == outliers.config
    norms = [n for layer in outliers.model.layers
             for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    channels = set((norms[0].weight > 1).nonzero().flatten().tolist())
    assert len(channels) == OUTLIER_CHANNELS
    for norm in norms:
        w = norm.weight.detach()
        assert set((w > 1).nonzero().flatten().tolist()) == channels
        big = w[sorted(channels)]
        assert bool((big >= 20).all() and (big <= 50).all())
        assert bool((w[[c for c in range(len(w)) if c not in channels]] == 1).all())
    for (name, p), q in zip(base.named_parameters(), outliers.parameters()):
        if "layernorm" not in name:
            assert torch.equal(p, q), name


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux's /proc")
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_the_loaded_model_keeps_no_view_of_its_safetensors_file(tmp_path, quantization):
    """safetensors maps the file, and one tensor left viewing it keeps every page of it in
    the process: once loaded (and quantized), the file is no longer mapped at all, and the
    weights it left as they were (the tied embedding) are still there, still tied."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    weights = str(tmp_path / "model.safetensors")
    model = load_model(str(tmp_path), quantization=quantization)
    with open("/proc/self/maps") as maps:
        assert weights not in maps.read()
    params = dict(model.named_parameters())
    assert params["model.embed_tokens.weight"].abs().sum() > 0
    assert (params["lm_head.weight"] is params["model.embed_tokens.weight"]) == \
        config.tie_word_embeddings
