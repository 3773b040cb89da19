"""The ``random:`` shapes of models people run on CPUs (SmolLM2-360M, Qwen2.5-0.5B,
Llama-3.2-1B, Llama-3.2-3B, TinyLlama-1.1B): each is the real checkpoint's ``config.json``
read by cbatch's loader, and each architecture (Qwen2's q/k/v bias, Llama 3's rope scaling,
tied embeddings, GQA) matches transformers on the same random checkpoint, saved by
transformers with those configs cut down to two narrow layers and a small vocabulary (heads,
head_dim and rope kept)."""

import dataclasses

import pytest
import torch

from cbatch import KVCache, load_model
from cbatch.core.input_batch import make_step_batch
from cbatch.models.loader import random_model_names
from cbatch.models.registry import model_class, random_llama_configs
from tests.helpers import shuffled_block_tables

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# The checkpoints' config.json, as published (fields cbatch does not read left out), and their
# parameter counts (tied embeddings counted once).
REAL = {
    "smollm2-360m": (361_821_120, {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "silu", "hidden_size": 960,
        "intermediate_size": 2560, "max_position_embeddings": 8192, "num_attention_heads": 15,
        "num_hidden_layers": 32, "num_key_value_heads": 5, "rms_norm_eps": 1e-05,
        "rope_scaling": None, "rope_theta": 100000, "tie_word_embeddings": True,
        "vocab_size": 49152}),
    "qwen2.5-0.5b": (494_032_768, {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "bos_token_id": 151643,
        "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896,
        "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
        "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
        "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936}),
    "llama-3.2-1b": (1_235_814_400, {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2048, "intermediate_size": 8192, "max_position_embeddings": 131072,
        "mlp_bias": False, "num_attention_heads": 32, "num_hidden_layers": 16,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": True, "vocab_size": 128256}),
    "llama-3.2-3b": (3_212_749_824, {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 3072, "intermediate_size": 8192, "max_position_embeddings": 131072,
        "mlp_bias": False, "num_attention_heads": 24, "num_hidden_layers": 28,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": True, "vocab_size": 128256}),
    "tinyllama-1.1b": (1_100_048_384, {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "bos_token_id": 1,
        "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 2048,
        "intermediate_size": 5632, "max_position_embeddings": 2048,
        "num_attention_heads": 32, "num_hidden_layers": 22, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "vocab_size": 32000}),
}
# cut down for the parity test: few layers, a small vocabulary, narrow (hidden_size: 8 per
# head, as transformers wants a multiple of the heads; head_dim stays the real one, 64 where
# the config leaves it to hidden_size / heads)
SMALL = dict(num_hidden_layers=2, intermediate_size=192, vocab_size=512, bos_token_id=1,
             eos_token_id=2)


def _small(name: str) -> dict:
    return {**SMALL, "hidden_size": 8 * REAL[name][1]["num_attention_heads"]}


@pytest.mark.parametrize("name", list(REAL))
def test_named_shape_is_the_real_checkpoint_config(name):
    """``random:<name>``'s config is what cbatch's loader reads from the real config.json,
    and the model built from it has the real checkpoint's parameter count."""
    num_params, raw = REAL[name]
    architecture, named = random_llama_configs()[name]
    assert f"random:{name}" in [f"random:{n}" for n in random_model_names()]
    cls = model_class(architecture)
    assert architecture == raw["architectures"][0]
    assert cls.config_class.from_hf(raw, **cls.config_switches) == named
    with torch.device("meta"):
        model = cls(named)
    assert sum(p.numel() for p in model.parameters()) == num_params
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == \
        raw["tie_word_embeddings"]


@pytest.fixture(scope="module", params=list(REAL))
def small_checkpoint(request, tmp_path_factory):
    """(the name, the transformers model, the directory it was saved to): the named shape's
    real config cut down (SMALL, head_dim kept), random weights, random q/k/v biases for
    Qwen2."""
    real = REAL[request.param][1]
    raw = {**real, **_small(request.param), "head_dim": real.get("head_dim", 64)}
    config = transformers.AutoConfig.for_model(**raw)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):  # zero at init: make them count
                p.normal_(0, 0.1)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, hf.eval(), path


def test_small_checkpoint_logits_match_transformers(small_checkpoint):
    """A packed prefill of ragged prompts, then a decode step: every logit row against
    transformers'.  The loaded config is the named shape's with SMALL's changes alone."""
    name, hf, path = small_checkpoint
    model = load_model(str(path))
    assert model.config == dataclasses.replace(random_llama_configs()[name][1], **_small(name))
    block_size = 16
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (1, 17, 40)]
    final = [len(p) + 1 for p in prompts]
    num_blocks = sum(-(-n // block_size) for n in final) + 2
    cache = KVCache(model.config, num_blocks, block_size)
    tables = shuffled_block_tables(final, block_size, num_blocks, gen).tolist()
    with torch.no_grad():
        batch = make_step_batch(prompts, [0] * len(prompts), tables, block_size)
        logits = model.compute_logits(model(batch, cache))
        for s, prompt in enumerate(prompts):
            ref = hf(torch.tensor([prompt])).logits[0]
            ours = logits[batch.cu_seqlens_q[s]:batch.cu_seqlens_q[s + 1]]
            torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
        new = [[5 + s] for s in range(len(prompts))]
        batch = make_step_batch(new, [len(p) for p in prompts], tables, block_size)
        logits = model.compute_logits(model(batch, cache)[batch.logits_indices])
        for s, prompt in enumerate(prompts):
            ref = hf(torch.tensor([prompt + new[s]])).logits[0, -1]
            torch.testing.assert_close(logits[s], ref, atol=1e-4, rtol=1e-4)
