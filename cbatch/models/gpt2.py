"""GPT-2 in plain torch over cbatch's flat step batch and paged KV cache.

Parameter names are Hugging Face's (``transformer.h.0.attn.c_attn.weight`` …), so checkpoints
load by name (:mod:`cbatch.models.loader`); ``lm_head`` is tied to ``wte``.  No transformers
import on this path.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from cbatch import ops
from cbatch.config import GPT2Config
from cbatch.layers.attention import PagedAttention
from cbatch.layers.embedding import Embedding
from cbatch.layers.kv_cache import KVCache
from cbatch.layers.layernorm import LayerNorm
from cbatch.layers.linear import Linear
from cbatch.layers.module import Module
from cbatch.layers.step_batch import StepBatch
from cbatch.models.base import PagedCausalLM

# activation -> F.gelu's ``approximate`` (fused into c_fc), or None for ReLU (applied after)
_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none", "relu": None}


class Attention(Module):
    def __init__(self, config: GPT2Config, layer_idx: int):
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = Linear(config.n_embd, config.n_embd)
        self.attn = PagedAttention(layer_idx, 1.0 / math.sqrt(config.head_dim))

    def forward(self, x: torch.Tensor, batch: StepBatch, kv_cache: KVCache,
                kernels: ops.BoundKernels, residual: torch.Tensor) -> torch.Tensor:
        """``residual + attention(x)``, the add fused into c_proj."""
        T = x.shape[0]
        # q, k, v: [T, H, D] views of the fused projection (dense rows, token stride 3C)
        q, k, v = self.c_attn(x).view(T, 3, self.n_head, self.head_dim).unbind(1)
        o = self.attn(q, k, v, batch, kv_cache, kernels)  # [T, H, D]
        return self.c_proj(o.reshape(T, -1), residual=residual)


class MLP(Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.c_fc = Linear(config.n_embd, config.mlp_dim)
        self.c_proj = Linear(config.mlp_dim, config.n_embd)
        self.gelu = _GELU[config.activation_function]

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + mlp(x)``: GELU fused into c_fc, the add into c_proj."""
        h = self.c_fc(x, gelu=self.gelu) if self.gelu else F.relu(self.c_fc(x))
        return self.c_proj(h, residual=residual)


class Block(Module):
    def __init__(self, config: GPT2Config, layer_idx: int):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = Attention(config, layer_idx)
        self.ln_2 = LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)

    def forward(self, x, batch, kv_cache, kernels):
        x = self.attn(self.ln_1(x), batch, kv_cache, kernels, residual=x)
        return self.mlp(self.ln_2(x), residual=x)


class GPT2Model(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.wte = Embedding(config.vocab_size, config.n_embd)
        self.wpe = Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.ln_f = LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)


class GPT2LMHeadModel(PagedCausalLM):
    """GPT-2 over a flat step batch (build one with :func:`cbatch.load_model`; generate with
    ``cbatch.LLM(model)``)."""

    def __init__(self, config: GPT2Config, attention_backend: str | None = None):
        super().__init__(config, attention_backend)
        self.transformer = GPT2Model(config)
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, batch: StepBatch, kv_cache: KVCache) -> torch.Tensor:
        """Run one step: write the new tokens' K/V into ``kv_cache`` and return the final
        hidden states ``[T, n_embd]`` (after ``ln_f``)."""
        t = self.transformer
        kernels = self.kernels(batch.input_ids.device)
        x = t.wte(batch.input_ids) + t.wpe(batch.positions)  # [T, C]
        for block in t.h:
            x = block(x, batch, kv_cache, kernels)
        return t.ln_f(x)
