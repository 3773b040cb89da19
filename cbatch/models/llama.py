"""The Llama decoder (Llama 2/3, TinyLlama, SmolLM2) in plain torch over the flat step batch.

RMSNorm, rotary position embeddings, grouped-query attention over the paged cache (the
cache holds ``num_key_value_heads`` heads), a SwiGLU MLP, embeddings tied or not.  Qwen2
(:mod:`cbatch.models.qwen2`) and Qwen3 (:mod:`cbatch.models.qwen3`) are this model with
switches of :class:`LlamaConfig`: QKV bias, per-head q/k RMSNorm.

Parameter names are Hugging Face's, except that q/k/v are one ``qkv_proj`` and gate/up one
``gate_up_proj`` (one matmul each instead of three and two, as vLLM does);
:meth:`LlamaForCausalLM.convert_hf_state_dict` stacks the checkpoint's tensors into them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from cbatch import ops
from cbatch.layers.attention import PagedAttention
from cbatch.layers.embedding import Embedding
from cbatch.layers.kv_cache import KVCache
from cbatch.layers.layernorm import RMSNorm
from cbatch.layers.linear import Linear
from cbatch.layers.module import Module
from cbatch.layers.rotary_embedding import (RotaryAngles, RotaryEmbedding, max_positions,
                                             rope_parameters)
from cbatch.layers.step_batch import StepBatch
from cbatch.models import cpu_layers
from cbatch.models.base import PagedCausalLM
from cbatch.ops import layer_ops


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama-family model (Hugging Face ``config.json`` names), plus
    the switches that make it Qwen2 (``qkv_bias``) or Qwen3 (``qk_norm``)."""

    architecture: str = "LlamaForCausalLM"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | tuple[int, ...] | None = 2

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a "
                             f"multiple of num_key_value_heads ({self.num_key_value_heads})")
        rope_parameters({"rope_parameters": self.rope})  # checks the type

    # The names the engine reads of any model's config (KV cache shape, prompt limits).
    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def num_heads(self) -> int:
        return self.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.num_key_value_heads

    @property
    def max_model_len(self) -> int:
        """The longest sequence the model serves (rope scaling may stretch the config's)."""
        return max_positions(self.max_position_embeddings, self.rope)

    @classmethod
    def from_hf(cls, raw: dict, **switches) -> LlamaConfig:
        """From a Hugging Face config dict; ``switches`` are the architecture's fixed ones
        (qwen2: ``qkv_bias=True``)."""
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {raw['hidden_act']!r} is not supported (silu only)")
        if raw.get("use_sliding_window"):
            raise ValueError("sliding-window attention (use_sliding_window=true) is not "
                             "supported")
        heads = raw["num_attention_heads"]
        bias = bool(raw.get("attention_bias", False))
        eos = raw.get("eos_token_id")
        kwargs = dict(
            architecture=(raw.get("architectures") or [cls.architecture])[0],
            vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope=rope_parameters(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=bias, o_bias=bias, mlp_bias=bool(raw.get("mlp_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos)
        kwargs.update(switches)
        return cls(**kwargs)

    @classmethod
    def from_dir(cls, path: Path, **switches) -> LlamaConfig:
        return cls.from_hf(json.loads((Path(path) / "config.json").read_text()), **switches)


class LlamaAttention(Module):
    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = D = config.head_dim
        self.sizes = [self.num_heads * D, self.num_kv_heads * D, self.num_kv_heads * D]
        self.qkv_proj = Linear(config.hidden_size, sum(self.sizes), bias=config.qkv_bias)
        self.o_proj = Linear(self.num_heads * D, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(D, config.rms_norm_eps)
            self.k_norm = RMSNorm(D, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.attn = PagedAttention(layer_idx, 1.0 / math.sqrt(D))

    def forward(self, x: torch.Tensor, batch: StepBatch, kv_cache: KVCache,
                kernels: ops.BoundKernels, rotary: RotaryEmbedding,
                angles: RotaryAngles) -> torch.Tensor:
        T, D = x.shape[0], self.head_dim
        # (split_with_sizes: Tensor.split is a Python wrapper around it, ~5 µs a layer)
        q, k, v = self.qkv_proj(x).split_with_sizes(self.sizes, dim=-1)
        # q: [T, H, D]; k, v: [T, H_kv, D] (v a view of the projection: dense rows)
        q, k, v = q.view(T, -1, D), k.view(T, -1, D), v.view(T, -1, D)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(angles, q, k)
        o = self.attn(q, k, v, batch, kv_cache, kernels)  # [T, H, D]
        return self.o_proj(o.reshape(T, -1))


class LlamaMLP(Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size,
                                   bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size,
                                bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(layer_ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(Module):
    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x, residual, batch, kv_cache, kernels, rotary, angles):
        """vLLM's residual plumbing: x is the previous layer's output (the embeddings at the
        first layer, residual None), residual the stream before it; returns this layer's
        (output, residual).  Each norm adds x into the residual first (one fused pass)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, batch, kv_cache, kernels, rotary, angles)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                      config.rope)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


T = TypeVar("T")

# our fused projection -> its shards' checkpoint names, in the order they are stacked along N
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fuse_shards(named: dict[str, T]) -> dict[str, T | list[T]]:
    """``named`` (checkpoint names -> tensors, quantized layers, ...) with the shards of each
    fused projection gathered under our fused name in stacking order
    (``model.layers.0.self_attn.k_proj.weight`` is shard 1 of
    ``model.layers.0.self_attn.qkv_proj.weight``); other names as they are.  A ValueError
    names the shards that are missing."""
    shard_of = {n: (fused, i) for fused, names in FUSED.items() for i, n in enumerate(names)}
    out: dict = {}
    shards: dict[str, tuple[list[str], dict[int, T]]] = {}
    for name, value in named.items():
        parts = name.split(".")
        i = next((i for i, p in enumerate(parts) if p in shard_of), None)
        if i is None:
            out[name] = value
            continue
        fused, index = shard_of[parts[i]]
        key = ".".join(parts[:i] + [fused] + parts[i + 1:])
        shards.setdefault(key, (parts[:i] + ["{}"] + parts[i + 1:], {}))[1][index] = value
        shards[key][1]["fused"] = fused
    for key, (pattern, found) in shards.items():
        names = FUSED[found.pop("fused")]
        missing = [n for i, n in enumerate(names) if i not in found]
        if missing:
            there = [n for n in names if n not in missing]
            raise ValueError(f"{' and '.join('.'.join(pattern).format(n) for n in missing)} "
                             f"{'is' if len(missing) == 1 else 'are'} missing (its layer's "
                             f"{' and '.join(there)} {'is' if len(there) == 1 else 'are'} "
                             "there)")
        out[key] = [found[i] for i in range(len(names))]
    return out


class LlamaForCausalLM(PagedCausalLM):
    """A Llama-family causal LM over the flat step batch (the interface GPT-2 has)."""

    config_class = LlamaConfig
    config_switches: dict = {}  # what the architecture fixes (see Qwen2ForCausalLM)

    def __init__(self, config: LlamaConfig, attention_backend: str | None = None):
        super().__init__(config, attention_backend)
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, batch: StepBatch, kv_cache: KVCache) -> torch.Tensor:
        """One step: write the new tokens' K/V into ``kv_cache``; the final hidden states
        ``[T, hidden_size]`` (after the last RMSNorm)."""
        x, residual = self.model.embed_tokens(batch.input_ids), None
        if cpu_layers.usable(self.cpu_layers):  # the same ops, called from C++
            decode = self.model.layers[0].self_attn.attn.kernel_for(batch) == "decode"
            return cpu_layers.run(self, self.cpu_layers, x, batch, kv_cache, decode)
        kernels = self.kernels(batch.input_ids.device)
        rotary = self.model.rotary
        angles = rotary.angles(batch.positions, x.dtype)  # one gather for every layer
        for layer in self.model.layers:
            x, residual = layer(x, residual, batch, kv_cache, kernels, rotary, angles)
        return self.model.norm(x, residual)[0]

    def bind_cpu_layers(self) -> str:
        """Gather the layers for one C++ call a step where every op has a CPU kernel
        (:mod:`cbatch.models.cpu_layers`); a phrase saying whether they were."""
        self.cpu_layers = cpu_layers.bind(self)
        return "one C++ call" if isinstance(self.cpu_layers, cpu_layers.BoundLayers) \
            else f"op by op: {self.cpu_layers}"

    @classmethod
    def convert_hf_state_dict(cls, raw: dict[str, torch.Tensor], config: LlamaConfig
                              ) -> dict[str, torch.Tensor]:
        """Hugging Face names → ours: q/k/v and gate/up stacked into the fused projections
        (:func:`fuse_shards`), ``lm_head`` dropped when tied."""
        kept = {name: tensor for name, tensor in raw.items()
                if not name.endswith("rotary_emb.inv_freq")  # a buffer old checkpoints saved
                and not (name == "lm_head.weight" and config.tie_word_embeddings)}
        return {name: torch.cat(value) if isinstance(value, list) else value
                for name, value in fuse_shards(kept).items()}

    def init_random(self, seed: int, outliers: int = 0) -> None:
        """Seeded random weights (normal, std 0.02; norms 1, biases 0), device-independent;
        ``outliers``: that many seeded channels of the hidden state get decoder-layer
        RMSNorm weights uniform in [20, 50] (:data:`cbatch.models.registry.OUTLIER_SHAPES`)."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():  # a tied lm_head is listed once
                if name.endswith("bias"):
                    value = torch.zeros(p.shape)
                elif name.endswith("norm.weight"):
                    value = torch.ones(p.shape)
                else:
                    value = torch.randn(p.shape, generator=gen) * 0.02
                p.copy_(value)
            if outliers:
                hidden = self.config.hidden_size
                channels = torch.randperm(hidden, generator=gen)[:outliers]
                for layer in self.model.layers:
                    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                        norm.weight[channels] = 20 + 30 * torch.rand(outliers, generator=gen)
