"""A GGUF file's model config: its metadata (llama.cpp's key names) as the config dict a Hugging
Face checkpoint would carry, read by the same ``from_hf`` as ``config.json`` is
(:class:`cbatch.models.llama.LlamaConfig` with its Qwen2/Qwen3 switches), or as a
:class:`cbatch.models.gpt2.GPT2Config`.

What the metadata leaves out comes from the tensors, as llama.cpp decides it: the vocabulary is
the embedding's rows, the embeddings are tied when there is no ``output.weight``, the
projections have biases when the file holds them, and a ``rope_freqs`` tensor (llama.cpp's
Llama 3.1 rope scaling, one divisor per rotated pair) becomes the rope's ``freq_factors``.
End of sequence is any of the file's EOS, EOT and EOM ids (llama.cpp stops at each).
"""

from __future__ import annotations

from cbatch.models.gpt2 import GPT2Config
from cbatch.models.gguf.blocks import dequantize_tensor
from cbatch.models.gguf.reader import ARCHITECTURES, GGUFFile
from cbatch.models.registry import model_class

# the metadata keys read, besides general.architecture ({arch}. keys under the architecture)
ARCH_KEYS = ("block_count", "context_length", "embedding_length", "feed_forward_length",
             "attention.head_count", "attention.head_count_kv", "attention.key_length",
             "attention.value_length", "attention.layer_norm_rms_epsilon",
             "attention.layer_norm_epsilon", "rope.dimension_count", "rope.freq_base",
             "rope.scaling.type", "rope.scaling.factor")
TOKEN_ID_KEYS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                 "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def model_config(f: GGUFFile):
    """The config of the model in ``f``: a LlamaConfig (llama, qwen2, qwen3) or a GPT2Config;
    ValueError naming the file and the key or tensor that is missing or wrong."""
    cls = model_class(ARCHITECTURES[f.architecture])
    if f.architecture == "gpt2":
        return _gpt2_config(f)
    raw = hf_config(f)
    try:
        return cls.config_class.from_hf(raw, **cls.config_switches)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{f.path}: {e}") from None


def hf_config(f: GGUFFile) -> dict:
    """The ``config.json`` dict of a llama, qwen2 or qwen3 file (Hugging Face's names)."""
    heads = f.arch_key("attention.head_count")
    kv_heads = _uniform(f, "attention.head_count_kv", f.arch_key("attention.head_count_kv",
                                                                  heads))
    hidden = f.arch_key("embedding_length")
    head_dim = f.arch_key("attention.key_length", None) or hidden // heads
    value_dim = f.arch_key("attention.value_length", head_dim)
    rotary = f.arch_key("rope.dimension_count", head_dim)
    if value_dim != head_dim or rotary != head_dim:
        raise ValueError(f"{f.path}: heads of key length {head_dim}, value length {value_dim} "
                         f"and {rotary} rotated dimensions; cbatch runs heads whose three are "
                         "equal")
    names = set(f.tensor_names)
    return {
        "architectures": [ARCHITECTURES[f.architecture]],
        "vocab_size": f.shape("token_embd.weight")[0],
        "hidden_size": hidden,
        "intermediate_size": f.arch_key("feed_forward_length"),
        "num_hidden_layers": f.arch_key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": f.arch_key("context_length"),
        "rms_norm_eps": f.arch_key("attention.layer_norm_rms_epsilon"),
        "rope_parameters": _rope(f, head_dim),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
        "bos_token_id": f.get("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": eos_token_ids(f),
    }


def eos_token_ids(f: GGUFFile) -> int | list[int] | None:
    """The file's end-of-sequence id, with its end-of-turn and end-of-message ids."""
    ids: list[int] = []
    for key in TOKEN_ID_KEYS[1:]:
        value = f.get(key, None)
        if value is not None and value not in ids:
            ids.append(value)
    return ids[0] if len(ids) == 1 else ids or None


def _rope(f: GGUFFile, head_dim: int) -> dict:
    """``rope_parameters``: the base, linear scaling, and the divisors of ``rope_freqs``."""
    rope = {"rope_type": "default", "rope_theta": float(f.arch_key("rope.freq_base", 10000.0))}
    scaling = f.arch_key("rope.scaling.type", "none")
    if scaling != "none":
        rope.update(rope_type=scaling, factor=float(f.arch_key("rope.scaling.factor")))
    if "rope_freqs.weight" in f.tensor_names:
        if scaling != "none":
            raise ValueError(f"{f.path}: rope scaling {scaling!r} together with a rope_freqs "
                             "tensor is not supported")
        name = "rope_freqs.weight"
        factors = dequantize_tensor(f.raw(name), f.qtype(name), f.shape(name)).reshape(-1)
        if len(factors) != head_dim // 2:
            raise ValueError(f"{f.path}: rope_freqs has {len(factors)} factors; heads of "
                             f"{head_dim} rotate {head_dim // 2} pairs")
        rope["freq_factors"] = factors.tolist()
    return rope


def _uniform(f: GGUFFile, key: str, value):
    """A per-layer list whose entries are all equal as the one value (else ValueError)."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"{f.path}: {f.architecture}.{key} differs between layers "
                             f"({value[:8]}...); cbatch runs the same shape in every layer")
        return value[0]
    return value


def _gpt2_config(f: GGUFFile) -> GPT2Config:
    hidden = f.arch_key("embedding_length")
    inner = f.arch_key("feed_forward_length", 4 * hidden)
    eos = eos_token_ids(f)
    eos = eos[0] if isinstance(eos, list) else eos
    if eos is None:
        raise ValueError(f"{f.path} names no tokenizer.ggml.eos_token_id (a GPT-2 file "
                         "needs one)")
    try:
        return GPT2Config(
            vocab_size=f.shape("token_embd.weight")[0],
            n_positions=f.arch_key("context_length"), n_embd=hidden,
            n_layer=f.arch_key("block_count"), n_head=f.arch_key("attention.head_count"),
            n_inner=None if inner == 4 * hidden else inner,
            layer_norm_epsilon=f.arch_key("attention.layer_norm_epsilon"),
            bos_token_id=f.get("tokenizer.ggml.bos_token_id", eos), eos_token_id=eos)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{f.path}: {e}") from None
