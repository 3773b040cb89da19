"""A ``random:`` Llama-family model of cbatch written as a Hugging Face checkpoint, for the peers:

    python benchmarks/peers/make_random_checkpoint.py smollm2-360m OUT_DIR   # cbatch's venv

The weights are cbatch's own seeded ones (``load_model("random:NAME")``, seed 0, float32),
unfused back into Hugging Face names (q/k/v, gate/up; a tied lm_head left out), so every peer
runs the model cbatch runs and ``cbatch`` loading OUT_DIR gives ``random:NAME``'s logits
(``--check`` compares them on a few prompts).  config.json is the named shape's (as the real
checkpoint's config.json says it, see tests/models/test_named_shapes.py).

The tokenizer (no hub access; cbatch's random models use a byte tokenizer) is a Llama-style
byte-fallback BPE with the model's vocabulary size, which every peer loads offline:
transformers / vLLM (tokenizer.json), OpenVINO's tokenizer conversion, and llama.cpp's
convert_hf_to_gguf.py (as an SPM "llama" vocabulary; a GPT-2-style BPE would need a
pre-tokenizer llama.cpp knows by hash).  Ids: 0 ``<|endoftext|>`` (bos and eos, as SmolLM2),
1 ``<unk>``, 2..257 the bytes ``<0x00>``..``<0xFF>``, 258 ``▁``, then placeholders
``<tokN>`` (no merges: text encodes to byte tokens).  The benchmarks feed token ids, so the
tokenizer only has to load.
"""
import argparse
import json
import os

import torch
from safetensors.torch import save_file

from cbatch import load_model
from cbatch.models.llama import FUSED
from cbatch.models.registry import random_llama_configs

MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3"}


def hf_config(config) -> dict:
    """cbatch's LlamaConfig as the Hugging Face config.json its loader reads back."""
    rope = dict(config.rope)
    raw = {"architectures": [config.architecture],
           "model_type": MODEL_TYPES[config.architecture],
           "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
           "intermediate_size": config.intermediate_size,
           "num_hidden_layers": config.num_hidden_layers,
           "num_attention_heads": config.num_attention_heads,
           "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
           "max_position_embeddings": config.max_position_embeddings,
           "rms_norm_eps": config.rms_norm_eps, "hidden_act": "silu",
           "rope_theta": rope.pop("rope_theta"),
           "rope_scaling": None if rope.get("rope_type") == "default" else rope,
           "tie_word_embeddings": config.tie_word_embeddings,
           "attention_bias": config.qkv_bias, "mlp_bias": config.mlp_bias,
           "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
           "torch_dtype": "float32", "use_cache": True}
    if config.architecture == "Qwen2ForCausalLM":
        raw.update(use_sliding_window=False, sliding_window=None,
                   max_window_layers=config.num_hidden_layers)
        del raw["attention_bias"], raw["mlp_bias"]  # Qwen2 fixes them
    return raw


def hf_state_dict(model, config) -> dict[str, torch.Tensor]:
    """cbatch's parameters under Hugging Face names: the fused qkv_proj and gate_up_proj
    split back into their shards (the inverse of ``convert_hf_state_dict``)."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    sizes = {"qkv_proj": [q, kv, kv], "gate_up_proj": [config.intermediate_size] * 2}
    out = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        parts = name.split(".")
        stacked = next((p for p in parts if p in FUSED), None)
        if stacked is None:
            out[name] = tensor.contiguous()
            continue
        for index, shard in enumerate(torch.split(tensor, sizes[stacked])):
            part = FUSED[stacked][index]
            out[".".join(part if p == stacked else p for p in parts)] = shard.contiguous()
    return out


def write_tokenizer(out: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<unk>": 1}
    vocab.update({f"<0x{b:02X}>": 2 + b for b in range(256)})
    vocab["\u2581"] = 258
    vocab.update({f"<tok{i}>": i for i in range(259, vocab_size)})
    assert len(vocab) == vocab_size
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                           normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>", unk_token="<unk>",
                                   pad_token="<|endoftext|>", model_max_length=8192)
    fast.save_pretrained(out)


def check(name: str, out: str) -> None:
    """cbatch on OUT gives random:NAME's logits (float32, a prefill of a few prompts)."""
    from cbatch.core.input_batch import prefill_logits

    prompts = [[0, 5, 17, 300], list(range(2, 40)), [49000, 7]]
    with torch.no_grad():
        a = prefill_logits(load_model(f"random:{name}"), prompts)
        b = prefill_logits(load_model(out), prompts)
    worst = max((x - y).abs().max().item() for x, y in zip(a, b))
    print(f"cbatch random:{name} vs {out}: max |logit difference| {worst:.3g}")
    if worst != 0:
        raise SystemExit("the written checkpoint does not give random:NAME's logits")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", choices=sorted(random_llama_configs()),
                    help="a random: Llama-family name, e.g. smollm2-360m")
    ap.add_argument("out", help="the directory to write")
    ap.add_argument("--check", action="store_true",
                    help="then load OUT with cbatch and compare logits with random:NAME")
    args = ap.parse_args()
    _, config = random_llama_configs()[args.name]
    model = load_model(f"random:{args.name}")  # seed 0, float32, as LLM() builds it
    os.makedirs(args.out, exist_ok=True)
    state = hf_state_dict(model, config)
    save_file(state, os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(hf_config(config), f, indent=2)
    with open(os.path.join(args.out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id},
                  f, indent=2)
    write_tokenizer(args.out, config.vocab_size)
    print(f"saved {args.out}: random:{args.name}, {sum(t.numel() for t in state.values())} "
          f"parameters, vocabulary {config.vocab_size}")
    if args.check:
        check(args.name, args.out)


if __name__ == "__main__":
    main()
