"""A ``random:`` Llama-family model of cbatch written as a quantized Hugging Face checkpoint,
GPTQ, AWQ or compressed-tensors W8A8, so that vLLM CPU and cbatch load the same files:

    python benchmarks/peers/make_quantized_random.py smollm2-360m gptq OUT_DIR   # cbatch's venv
    python benchmarks/peers/make_quantized_random.py smollm2-360m awq OUT_DIR [--check]
    python benchmarks/peers/make_quantized_random.py smollm2-360m w8a8 OUT_DIR [--check]

The float weights are cbatch's own seeded ones (``load_model("random:NAME")``, seed 0), in
Hugging Face names, with config.json, generation_config.json and the tokenizer as
``make_random_checkpoint.py`` writes them (this script uses its functions).  Every linear
layer of the decoder is quantized by round-to-nearest (no calibration: the weights are random);
the embeddings and the (tied) lm_head stay float32:

- ``gptq``: 4-bit, sym, desc_act false, the classic ``checkpoint_format`` "gptq" (zero
  point 8 stored as 7); ``qweight`` int32 [K / 8, N], ``qzeros`` int32 [G, N / 8],
  ``scales`` fp16 [G, N], ``g_idx`` int32 [K].  Per group the scale is 2 max|w| / 15,
  q = clamp(round(w / scale) + 8, 0, 15).  group_size 128 where every layer's K is a
  multiple of it, as vLLM's GPTQ layers require, else 64, else 32 (``--group-size`` to
  choose): SmolLM2-360M's hidden size, 960, is not a multiple of 128.
- ``awq``: 4-bit with zero points (AutoAWQ's ``version`` "gemm"), the same group size rule;
  per group scale = (max w - min w) / 15 over the group's range widened to hold 0, zero =
  clamp(round(-min / scale), 0, 15), q = clamp(round(w / scale) + zero, 0, 15); ``qweight``
  int32 [K, N / 8] and ``qzeros`` int32 [G, N / 8], word c holding columns 8c + (0, 2, 4, 6,
  1, 3, 5, 7) in nibbles 0..7 (AWQ's order), ``scales`` fp16 [G, N].
- ``w8a8``: compressed-tensors ``int-quantized``, weights int8 [N, K] symmetric per output
  channel (scale max|w| / 127) and ``weight_scale`` [N, 1]; activations dynamic per token,
  symmetric.

Scales are rounded to bfloat16 first (and GPTQ's then stored as fp16, exactly), so an engine
that reads them in bf16, fp16 or fp32 gets the same values.  ``--check`` loads OUT with cbatch
and prints its logits' distance from the float model's and their greedy agreement.
"""
import argparse
import json
import os

import torch
from make_random_checkpoint import hf_config, hf_state_dict, write_tokenizer
from safetensors.torch import save_file

from cbatch import load_model
from cbatch.models.registry import random_llama_configs

def pack_int32(values: torch.Tensor, dim: int) -> torch.Tensor:
    """4-bit unsigned ``values`` packed 8 to an int32 word along ``dim``, lowest bits first."""
    v = values.movedim(dim, -1).long()
    v = v.view(*v.shape[:-1], -1, 8)
    words = sum(v[..., j] << (4 * j) for j in range(8))
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def gptq_layer(w: torch.Tensor, prefix: str, group_size: int) -> dict[str, torch.Tensor]:
    N, K = w.shape
    if K % 8 or N % 8 or K % group_size:
        raise SystemExit(f"{prefix}: GPTQ packs 8 values a word, and vLLM wants K a multiple "
                         f"of the group size ({group_size}); {N} x {K} does not divide")
    G = K // group_size
    groups = torch.arange(K) // group_size
    top = w.abs().view(N, G, group_size).amax(2)
    scales = (2 * top / 15).to(torch.bfloat16).float().clamp(min=2 ** -14)  # [N, G]
    q = (w / scales[:, groups]).round().add(8).clamp(0, 15)  # [N, K]
    return {f"{prefix}.qweight": pack_int32(q.t(), 0),
            f"{prefix}.qzeros": pack_int32(torch.full((G, N), 7), 1),
            f"{prefix}.scales": scales.t().half().contiguous(),
            f"{prefix}.g_idx": groups.int()}


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of a word holds column 8c + AWQ_ORDER[j]


def awq_layer(w: torch.Tensor, prefix: str, group_size: int) -> dict[str, torch.Tensor]:
    N, K = w.shape
    if K % group_size or N % 8:
        raise SystemExit(f"{prefix}: AWQ packs 8 columns a word and wants K a multiple of the "
                         f"group size ({group_size}); {N} x {K} does not divide")
    G = K // group_size
    groups = torch.arange(K) // group_size
    grouped = w.view(N, G, group_size)
    low, high = grouped.amin(2).clamp(max=0), grouped.amax(2).clamp(min=0)  # [N, G]
    scales = ((high - low) / 15).to(torch.bfloat16).float().clamp(min=2 ** -14)
    zeros = (-low / scales).round().clamp(0, 15)  # [N, G]
    q = (w / scales[:, groups]).round().add(zeros[:, groups]).clamp(0, 15)  # [N, K]
    order = torch.tensor([8 * c + o for c in range(N // 8) for o in AWQ_ORDER])
    return {f"{prefix}.qweight": pack_int32(q.t()[:, order], 1),  # [K, N / 8]
            f"{prefix}.qzeros": pack_int32(zeros.t()[:, order], 1),  # [G, N / 8]
            f"{prefix}.scales": scales.t().half().contiguous()}


def w8a8_layer(w: torch.Tensor, prefix: str) -> dict[str, torch.Tensor]:
    scales = (w.abs().amax(1, keepdim=True) / 127).to(torch.bfloat16)  # [N, 1]
    q = (w / scales.float()).round().clamp(-128, 127).to(torch.int8)
    return {f"{prefix}.weight": q, f"{prefix}.weight_scale": scales}


def quantization_config(fmt: str, group_size: int) -> dict:
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "sym": True,
                "desc_act": False, "static_groups": False, "true_sequential": True,
                "damp_percent": 0.01, "lm_head": False, "checkpoint_format": "gptq"}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    args = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None,
            "block_structure": None, "actorder": None, "observer": "minmax",
            "observer_kwargs": {}}
    return {"quant_method": "compressed-tensors", "format": "int-quantized",
            "quantization_status": "compressed", "global_compression_ratio": None,
            "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {},
            "config_groups": {"group_0": {
                "targets": ["Linear"], "output_activations": None,
                "weights": {**args, "strategy": "channel", "dynamic": False},
                "input_activations": {**args, "strategy": "token", "dynamic": True,
                                      "observer": None}}}}


def check(name: str, out: str) -> None:
    from cbatch.core.input_batch import prefill_logits

    prompts = [[0, 5, 17, 200], list(range(2, 40)), [250, 7]]
    with torch.no_grad():
        dense = torch.cat(prefill_logits(load_model(f"random:{name}"), prompts))
        quantized = torch.cat(prefill_logits(load_model(out), prompts))
    agree = (dense.argmax(-1) == quantized.argmax(-1)).float().mean().item()
    print(f"cbatch {out} vs random:{name} (float32): max |logit difference| "
          f"{(dense - quantized).abs().max().item():.3g} of max |logit| "
          f"{dense.abs().max().item():.3g}; greedy agreement {agree:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", choices=sorted(random_llama_configs()),
                    help="a random: Llama-family name, e.g. smollm2-360m")
    ap.add_argument("format", choices=("gptq", "awq", "w8a8"))
    ap.add_argument("out", help="the directory to write")
    ap.add_argument("--group-size", type=int, default=None,
                    help="GPTQ's and AWQ's (default: 128, 64 or 32, the largest that divides "
                         "every K)")
    ap.add_argument("--check", action="store_true",
                    help="then load OUT with cbatch and compare its logits with random:NAME's")
    args = ap.parse_args()
    _, config = random_llama_configs()[args.name]
    state = hf_state_dict(load_model(f"random:{args.name}"), config)  # seed 0, float32
    names = [n for n in state if n.startswith("model.layers.") and n.endswith("_proj.weight")]
    group_size = args.group_size or next(
        (g for g in (128, 64, 32) if all(state[n].shape[1] % g == 0 for n in names)), 32)
    for name in names:
        w, prefix = state.pop(name).float(), name.removesuffix(".weight")
        layer = {"gptq": lambda: gptq_layer(w, prefix, group_size),
                 "awq": lambda: awq_layer(w, prefix, group_size),
                 "w8a8": lambda: w8a8_layer(w, prefix)}[args.format]
        state.update(layer())
    os.makedirs(args.out, exist_ok=True)
    save_file(state, os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    raw = hf_config(config)
    raw["quantization_config"] = quantization_config(args.format, group_size)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    with open(os.path.join(args.out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id},
                  f, indent=2)
    write_tokenizer(args.out, config.vocab_size)
    print(f"saved {args.out}: random:{args.name}, {args.format}"
          + (f", group_size {group_size}" if args.format != "w8a8" else ""))
    if args.check:
        check(args.name, args.out)


if __name__ == "__main__":
    main()
