"""Small GGUF files for tests, written as llama.cpp's ``convert_hf_to_gguf.py`` writes them
(then quantized as ``llama-quantize`` would, tensor by tensor, in whatever types a test asks).

- metadata: the converter's keys for llama, qwen2, qwen3 and gpt2 (``TextModel`` and each
  model's ``set_gguf_parameters``), the file type left out (it is informational);
- tensor names: gguf-py's own map (``gguf.get_tensor_name_map``), not cbatch's;
- llama's q/k rows permuted by the converter's ``permute``; GPT-2's Conv1D weights transposed,
  and its tied head written as a copy, ``output.weight``; Llama 3.1's rope scaling as the
  ``rope_freqs`` tensor of per-pair divisors (``LlamaModel.generate_extra_tensors``);
- 1-D tensors (norms, biases) in F32, others in the type ``type_of`` names: the float types
  and Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 by ``gguf.quants.quantize``, the K-quants by
  :func:`quantize_k` here (gguf-py has no K-quant quantizer; any valid blocks do);
- a vocabulary (:mod:`tests.models.gguf_vocab`) padded to the model's with ``[PAD<i>]`` tokens.

:func:`write_gguf` returns the Hugging Face state dict holding exactly the weights the file
holds (gguf's ``dequantize`` of each tensor, back in Hugging Face's layout): the reference
checkpoint the GGUF model must match.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import numpy as np
import torch

gguf = __import__("pytest").importorskip("gguf")
QT = gguf.GGMLQuantizationType


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.permute``, as it is."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def quantize_k(x: np.ndarray, qtype: str) -> np.ndarray:
    """uint8 ``[N, K / 256 * type_size]``: ``x [N, K]`` as Q4_K, Q5_K or Q6_K blocks (a plain
    min/max quantizer, not llama.cpp's search; the layout is llama.cpp's)."""
    x = x.astype(np.float32).reshape(-1, 256)
    nb = len(x)
    if qtype == "Q6_K":
        sub = x.reshape(nb, 16, 16)
        scale = np.abs(sub).max(-1) / 31
        d = (np.abs(scale).max(-1, keepdims=True) / 127).astype(np.float16)
        sc = np.clip(np.round(_div(scale, d.astype(np.float32))), -128, 127).astype(np.int8)
        eff = d.astype(np.float32) * sc.astype(np.float32)
        q = (np.clip(np.round(_div(sub, eff[..., None])), -32, 31) + 32).astype(np.uint8)
        q = q.reshape(nb, 256)
        lo = (q & 0xF).reshape(nb, 2, 2, 64)
        ql = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(nb, 128)
        hi = (q >> 4).reshape(nb, 2, 4, 32)
        qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6))
        return np.concatenate([ql, qh.reshape(nb, 64), sc.view(np.uint8),
                               d.view(np.uint8)], axis=1)
    levels = 15 if qtype == "Q4_K" else 31
    sub = x.reshape(nb, 8, 32)
    low = np.minimum(sub.min(-1), 0)
    scale, mins = (sub.max(-1) - low) / levels, -low
    d = (scale.max(-1, keepdims=True) / 63).astype(np.float16)
    dmin = (mins.max(-1, keepdims=True) / 63).astype(np.float16)
    sc = np.clip(np.round(_div(scale, d.astype(np.float32))), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(_div(mins, dmin.astype(np.float32))), 0, 63).astype(np.uint8)
    eff_scale = d.astype(np.float32) * sc
    eff_min = dmin.astype(np.float32) * mn
    q = np.clip(np.round(_div(sub + eff_min[..., None], eff_scale[..., None])), 0, levels)
    q = q.astype(np.uint8)  # [nb, 8, 32]
    packed = np.concatenate([
        sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)], axis=1)
    qs = ((q[:, 0::2] & 0xF) | ((q[:, 1::2] & 0xF) << 4)).reshape(nb, 128)
    parts = [d.view(np.uint8), dmin.view(np.uint8), packed]
    if qtype == "Q5_K":
        bits = (q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]  # [nb, 8, 32]
        parts.append(np.bitwise_or.reduce(bits, axis=1))
    return np.concatenate(parts + [qs], axis=1)


def _div(a, b):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b == 0, 0, a / np.where(b == 0, 1, b))


def quantize(x: np.ndarray, qtype: str) -> np.ndarray:
    """``x [N, K]`` in GGUF type ``qtype``: what the writer stores (floats as numpy floats,
    blocks as uint8 rows)."""
    if qtype in ("Q4_K", "Q5_K", "Q6_K"):
        return quantize_k(x, qtype).reshape(x.shape[0], -1)
    return gguf.quants.quantize(x.astype(np.float32), QT[qtype])


def dequantize(data: np.ndarray, qtype: str) -> np.ndarray:
    return gguf.quants.dequantize(data, QT[qtype]).astype(np.float32)


def write_gguf(model, path: Path, type_of: Callable[[str], str] = lambda name: "F32",
               vocab=None, chat_template: str | None = None) -> dict[str, torch.Tensor]:
    """Write transformers ``model`` (llama, qwen2, qwen3, gpt2) to ``path`` as the converter
    would; ``type_of(gguf_name)`` picks each 2-D tensor's type; ``vocab``: a
    :class:`tests.models.gguf_vocab.Vocab` (else none is written).  Returns the Hugging Face
    state dict of the file's weights (see the module docstring)."""
    cfg = model.config
    arch = cfg.model_type
    n_layers = cfg.num_hidden_layers if arch != "gpt2" else cfg.n_layer
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    _write_hparams(writer, cfg, arch)
    if vocab is not None:
        vocab.write(writer, cfg.vocab_size, chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_layers)
    reference = {}
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if arch == "gpt2":  # the converter writes the tied head as a copy of the embedding
        state.setdefault("lm_head.weight", state["transformer.wte.weight"])
    for hf_name, w in state.items():
        if hf_name.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")):
            continue
        if arch != "gpt2" and hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        name = f"{names.get_name(base)}.{suffix}"
        stored = w
        conv1d = arch == "gpt2" and hf_name.endswith(
            (".c_attn.weight", ".c_proj.weight", ".c_fc.weight"))
        if conv1d:
            stored = w.T
        if arch == "llama" and base.endswith("q_proj"):
            stored = permute(w, cfg.num_attention_heads, cfg.num_attention_heads)
        if arch == "llama" and base.endswith("k_proj"):
            stored = permute(w, cfg.num_attention_heads, cfg.num_key_value_heads)
        qtype = "F32" if stored.ndim == 1 else type_of(name)
        data = quantize(np.ascontiguousarray(stored), qtype)
        writer.add_tensor(name, data, raw_dtype=QT[qtype] if data.dtype == np.uint8 else None)
        # the reference: the same quantization of the tensor in Hugging Face's layout (blocks
        # run along rows, and llama's permutation only reorders rows)
        same = quantize(np.ascontiguousarray(w.T if conv1d else w), qtype)
        ref = dequantize(same, qtype).reshape(w.T.shape if conv1d else w.shape)
        reference[hf_name] = torch.from_numpy(ref.T.copy() if conv1d else ref)
    factors = _rope_factors(cfg) if arch == "llama" else None
    if factors is not None:
        writer.add_tensor("rope_freqs.weight", factors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def _write_hparams(writer, cfg, arch: str) -> None:
    if arch == "gpt2":  # GPT2Model.set_gguf_parameters
        writer.add_block_count(cfg.n_layer)
        writer.add_context_length(cfg.n_positions)
        writer.add_embedding_length(cfg.n_embd)
        writer.add_feed_forward_length(4 * cfg.n_embd)
        writer.add_head_count(cfg.n_head)
        writer.add_layer_norm_eps(cfg.layer_norm_epsilon)
        return
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if getattr(cfg, "head_dim", None) is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":  # LlamaModel.set_gguf_parameters
        writer.add_vocab_size(cfg.vocab_size)
        writer.add_rope_dimension_count(head_dim)
        rope = cfg.rope_parameters
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])


def _rope_factors(cfg) -> np.ndarray | None:
    """LlamaModel.generate_extra_tensors: Llama 3.1's scaling as one divisor per pair (its
    ``original_max_position_embeddings`` read from the top level, else 8192, as it reads it)."""
    rope = cfg.rope_parameters
    if rope.get("rope_type") != "llama3":
        return None
    base = rope["rope_theta"]
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = getattr(cfg, "original_max_position_embeddings", None) or 8192
    low_wavelen, high_wavelen = old / low, old / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)
