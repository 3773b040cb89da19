"""Which model class serves a checkpoint, and the ``random:`` models of each family.

A checkpoint names its class in ``config.json``'s ``architectures`` (as vLLM reads it); a
config without that field falls back to its ``model_type``.  An architecture cbatch does not
implement is an error that lists the ones it does.
"""

from __future__ import annotations

import importlib
from pathlib import Path

# architecture -> (module, class); GPT2Model is GPT-2 without its head (the head is tied)
ARCHITECTURES = {
    "GPT2LMHeadModel": ("cbatch.models.gpt2", "GPT2LMHeadModel"),
    "GPT2Model": ("cbatch.models.gpt2", "GPT2LMHeadModel"),
    "LlamaForCausalLM": ("cbatch.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("cbatch.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("cbatch.models.qwen3", "Qwen3ForCausalLM"),
}
_MODEL_TYPES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def architecture_of(raw: dict, path: Path | str = "config.json") -> str:
    """The supported architecture a Hugging Face config dict names; ValueError naming
    ``path`` when it names none cbatch runs, or names them in the wrong form."""
    named = raw.get("architectures") or []
    if not isinstance(named, list) or not all(isinstance(a, str) for a in named):
        raise ValueError(f"{path}: architectures must be a list of class names, like "
                         f'["LlamaForCausalLM"]; got {named!r:.80}')
    for arch in named:
        if arch in ARCHITECTURES:
            return arch
    if not named and isinstance(raw.get("model_type"), str) and raw["model_type"] in _MODEL_TYPES:
        return _MODEL_TYPES[raw["model_type"]]
    what = f"architectures {named}" if named else f"model_type {raw.get('model_type')!r}"
    raise ValueError(f"{path}: {what} is not supported; cbatch runs "
                     f"{', '.join(sorted(set(ARCHITECTURES) - {'GPT2Model'}))}")


def model_class(architecture: str) -> type:
    module, name = ARCHITECTURES[architecture]
    return getattr(importlib.import_module(module), name)


def random_llama_configs() -> dict:
    """``random:<name>`` -> (architecture, LlamaConfig): seeded random weights in the shape of
    a family (GPT-2's sizes are :data:`cbatch.models.gpt2.MODEL_CONFIGS`).  Token ids 0-255 are
    the byte tokenizer's, so every vocabulary is at least 256."""
    from cbatch.models.llama import LlamaConfig

    default_rope = {"rope_type": "default", "rope_theta": 10000.0}
    shapes = {
        # tests: GQA 2:1, untied embeddings, a bias-free Llama
        "llama-tiny": ("LlamaForCausalLM", LlamaConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, rope=default_rope, bos_token_id=510,
            eos_token_id=511)),
        # tests: GQA 4:1, per-head q/k norms, head_dim wider than hidden / heads; serves chat
        # with Qwen3's template (RANDOM_CHAT_TEMPLATES), whose tools' system turn needs more
        # than 256 bytes
        "qwen3-tiny": ("Qwen3ForCausalLM", LlamaConfig(
            architecture="Qwen3ForCausalLM", vocab_size=512, hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, head_dim=32, max_position_embeddings=2048,
            rms_norm_eps=1e-6, rope={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=True, qk_norm=True, bos_token_id=None, eos_token_id=511)),
        # HuggingFaceTB/SmolLM2-135M's shape (config.json): 30 layers, 9 heads over 3 KV
        # heads of 64, tied embeddings
        "smollm2-135m": ("LlamaForCausalLM", LlamaConfig(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, head_dim=64,
            max_position_embeddings=8192, rms_norm_eps=1e-5,
            rope={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True,
            bos_token_id=0, eos_token_id=0)),
        # HuggingFaceTB/SmolLM2-360M's shape: 32 layers, 15 heads over 5 KV heads of 64, tied
        "smollm2-360m": ("LlamaForCausalLM", LlamaConfig(
            vocab_size=49152, hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
            num_attention_heads=15, num_key_value_heads=5, head_dim=64,
            max_position_embeddings=8192, rms_norm_eps=1e-5,
            rope={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True,
            bos_token_id=0, eos_token_id=0)),
        # Qwen/Qwen2.5-0.5B's shape: 24 layers, 14 heads over 2 KV heads of 64, q/k/v bias,
        # tied
        "qwen2.5-0.5b": ("Qwen2ForCausalLM", LlamaConfig(
            architecture="Qwen2ForCausalLM", vocab_size=151936, hidden_size=896,
            intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=32768,
            rms_norm_eps=1e-6, rope={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=True, qkv_bias=True, bos_token_id=151643,
            eos_token_id=151643)),
        # meta-llama/Llama-3.2-1B's shape: 16 layers, 32 heads over 8 KV heads of 64, Llama
        # 3.1's rope scaling, tied
        "llama-3.2-1b": ("LlamaForCausalLM", LlamaConfig(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, head_dim=64,
            max_position_embeddings=131072, rms_norm_eps=1e-5,
            rope={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
            tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001)),
        # meta-llama/Llama-3.2-3B's shape: 28 layers, 24 heads over 8 KV heads of 128, tied
        "llama-3.2-3b": ("LlamaForCausalLM", LlamaConfig(
            vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
            num_attention_heads=24, num_key_value_heads=8, head_dim=128,
            max_position_embeddings=131072, rms_norm_eps=1e-5,
            rope={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
            tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001)),
        # TinyLlama/TinyLlama-1.1B-Chat-v1.0's shape: 22 layers, 32 heads over 4 KV heads of
        # 64, an untied lm_head, Llama 2's vocabulary of 32000
        "tinyllama-1.1b": ("LlamaForCausalLM", LlamaConfig(
            vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
            num_attention_heads=32, num_key_value_heads=4, head_dim=64,
            max_position_embeddings=2048, rms_norm_eps=1e-5, rope=default_rope,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)),
    }
    # the same shapes with outlier channels (:data:`OUTLIER_CHANNELS`)
    shapes.update({f"{name}-outliers": shapes[name] for name in OUTLIER_SHAPES})
    return shapes


# Real LLMs carry a few residual channels 20-100x larger than the rest (LLM.int8()'s outlier
# features), which random weights lack and which decide how quantized activations fare:
# ``random:<shape>-outliers`` is ``<shape>`` whose decoder RMSNorm weights are 20-50 (seeded,
# uniform) on OUTLIER_CHANNELS seeded channels and 1 elsewhere, so every linear layer's input
# holds those channels at 20-50x the others.
OUTLIER_SHAPES = ("smollm2-360m", "llama-3.2-1b", "llama-tiny")
OUTLIER_CHANNELS = 8


def outlier_channels(name: str) -> int:
    """How many outlier channels ``random:<name>`` has (0 but for the ``-outliers`` shapes)."""
    return OUTLIER_CHANNELS if name.endswith("-outliers") else 0


# random:<name> -> the name of its chat template in :mod:`cbatch.models.chat_templates`
RANDOM_CHAT_TEMPLATES = {"qwen3-tiny": "QWEN3"}


def random_chat_template(model: str) -> str | None:
    """The chat template of a ``random:`` model that serves chat (its family's), else None."""
    name = RANDOM_CHAT_TEMPLATES.get(model.removeprefix("random:"))
    if name is None or not model.startswith("random:"):
        return None
    from cbatch.models import chat_templates

    return getattr(chat_templates, name)
