"""GGUF tensor names as Hugging Face's, and the tensors as Hugging Face stores them.

llama.cpp's converter (``convert_hf_to_gguf.py``) renames every tensor (``blk.3.attn_q.weight``
for ``model.layers.3.self_attn.q_proj.weight``) and changes two kinds:

- **llama**'s ``attn_q`` and ``attn_k`` rows (weights and biases) are permuted within each head,
  from Hugging Face's rotate-half layout (the head's first half, then its second) to llama.cpp's
  interleaved pairs: the converter's ``permute`` reshapes the rows to ``[heads, 2, D / 2]`` and
  swaps the last two axes.  :func:`unpermute` undoes it (as transformers' GGUF loader does).
  qwen2 and qwen3 files are written with the rotate-half rows as they are.
- **gpt2**'s Conv1D weights ``[in, out]`` are stored transposed, as ``[out, in]``;
  :func:`to_hf` transposes them back, and the checkpoint loader transposes them again into
  ``nn.Linear`` (one path for every GPT-2 checkpoint).
"""

from __future__ import annotations

import torch

# per-layer part: GGUF -> Hugging Face, for llama, qwen2 and qwen3
_LLAMA_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj"}
_LLAMA_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}
_GPT2_LAYER = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
               "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
_GPT2_TOP = {"token_embd": "transformer.wte", "position_embd": "transformer.wpe",
             "output_norm": "transformer.ln_f", "output": "lm_head"}
NAMES = {arch: (_GPT2_TOP, _GPT2_LAYER, "transformer.h") if arch == "gpt2" else
         (_LLAMA_TOP, _LLAMA_LAYER, "model.layers") for arch in ("llama", "qwen2", "qwen3",
                                                                  "gpt2")}
# tensors that are not parameters: read into the config (cbatch.models.gguf.config)
CONFIG_TENSORS = ("rope_freqs.weight",)
_GPT2_CONV1D = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")


def hf_name(architecture: str, name: str) -> str:
    """The Hugging Face name of GGUF tensor ``name`` (``blk.0.attn_q.weight`` ->
    ``model.layers.0.self_attn.q_proj.weight``); ValueError for a name the architecture has
    no parameter for."""
    top, layer, prefix = NAMES[architecture]
    base, dot, suffix = name.rpartition(".")
    parts = base.split(".")
    if dot and suffix in ("weight", "bias"):
        if len(parts) == 1 and parts[0] in top:
            return f"{top[parts[0]]}.{suffix}"
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer:
            return f"{prefix}.{parts[1]}.{layer[parts[2]]}.{suffix}"
    raise ValueError(f"tensor {name} is not one of a {architecture} model's")


def to_hf(architecture: str, name: str, tensor: torch.Tensor, num_heads: int,
          num_kv_heads: int) -> torch.Tensor:
    """GGUF tensor ``name`` as Hugging Face stores it (``tensor`` in torch's order, rows
    last): llama's q/k rows unpermuted, GPT-2's Conv1D weights transposed back."""
    part = name.split(".")[-2]
    if architecture == "llama" and part in ("attn_q", "attn_k"):
        return unpermute(tensor, num_heads if part == "attn_q" else num_kv_heads)
    if architecture == "gpt2" and part in _GPT2_CONV1D and name.endswith(".weight"):
        return tensor.t()
    return tensor


def unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of llama.cpp's ``permute`` of ``w``'s rows (``[heads * D, ...]``): each head's
    interleaved pairs back to rotate-half order."""
    rows = w.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"{rows} rows do not split into {num_heads} heads of pairs")
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2) \
        .reshape(w.shape)
