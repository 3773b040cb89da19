"""GPT-2 in plain torch over cbatch's flat step batch and paged KV cache.

Parameter names are Hugging Face's (``transformer.h.0.attn.c_attn.weight`` …), so checkpoints
load by name (:mod:`cbatch.models.loader`); ``lm_head`` is tied to ``wte``.  No transformers
import on this path.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from cbatch import ops
from cbatch.layers.attention import PagedAttention
from cbatch.layers.embedding import Embedding
from cbatch.layers.kv_cache import KVCache
from cbatch.layers.layernorm import LayerNorm
from cbatch.layers.linear import Linear
from cbatch.layers.module import Module
from cbatch.layers.step_batch import StepBatch
from cbatch.models.base import PagedCausalLM

CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                  "mlp.c_proj.weight")  # stored [in, out] by HF's Conv1D
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")

# activation -> F.gelu's ``approximate`` (fused into c_fc), or None for ReLU (applied after)
_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none", "relu": None}


@dataclass(frozen=True)
class GPT2Config:
    """Hyper-parameters of a GPT-2-family model (Hugging Face ``config.json`` names)."""

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None  # MLP width; None = 4 * n_embd
    layer_norm_epsilon: float = 1e-5
    activation_function: str = "gelu_new"
    bos_token_id: int = 50256
    eos_token_id: int = 50256

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPT2Config.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPT2Config.n_embd ({self.n_embd}) must be divisible by "
                             f"n_head ({self.n_head})")
        if self.activation_function not in _GELU:
            raise ValueError(f"GPT2Config.activation_function must be one of "
                             f"{sorted(_GELU)}, got {self.activation_function!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def mlp_dim(self) -> int:
        return self.n_inner or 4 * self.n_embd

    # The names the engine reads of any model's config (KV cache shape, prompt limits).
    @property
    def num_layers(self) -> int:
        return self.n_layer

    @property
    def num_heads(self) -> int:
        return self.n_head

    @property
    def num_kv_heads(self) -> int:
        return self.n_head

    @property
    def max_model_len(self) -> int:
        return self.n_positions

    @classmethod
    def named(cls, name: str) -> GPT2Config:
        """One of :data:`MODEL_CONFIGS` (``gpt2``, ``gpt2-medium``, ``gpt2-large``, ``gpt2-xl``,
        ``distilgpt2``) or a ``tiny`` test size."""
        if name not in MODEL_CONFIGS:
            raise ValueError(f"unknown model size {name!r}; known: {sorted(MODEL_CONFIGS)}")
        return MODEL_CONFIGS[name]

    @classmethod
    def from_hf(cls, path: str | Path) -> GPT2Config:
        """Read a Hugging Face ``config.json`` (a file or the directory holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {path}")
        raw = json.loads(path.read_text())
        model_type = raw.get("model_type")
        if model_type != "gpt2":
            raise ValueError(f"{path}: model_type is {model_type!r}; cbatch runs GPT-2-family "
                             "models (model_type 'gpt2')")
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if raw.get(flag):
                raise ValueError(f"{path}: {flag}=true is not supported by cbatch")
        if raw.get("scale_attn_weights") is False:
            raise ValueError(f"{path}: scale_attn_weights=false is not supported by cbatch")
        fields = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in raw.items() if k in fields and v is not None})


MODEL_CONFIGS: dict[str, GPT2Config] = {
    "gpt2": GPT2Config(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPT2Config(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPT2Config(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPT2Config(n_layer=48, n_head=25, n_embd=1600),
    "distilgpt2": GPT2Config(n_layer=6, n_head=12, n_embd=768),
    # Small enough for unit tests on a 2-core CPU.
    "tiny": GPT2Config(vocab_size=512, n_positions=256, n_layer=2, n_head=4, n_embd=64,
                       bos_token_id=511, eos_token_id=511),
}


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

    @classmethod
    def convert_hf_state_dict(cls, raw: dict[str, torch.Tensor], config: GPT2Config
                              ) -> dict[str, torch.Tensor]:
        """Map a Hugging Face GPT-2 state dict onto :class:`GPT2LMHeadModel`'s names.

        Accepts both ``GPT2LMHeadModel`` (``transformer.`` prefix) and bare ``GPT2Model``
        checkpoints; transposes exactly the Conv1D weights, checking each shape.
        """
        C, mlp = config.n_embd, config.mlp_dim
        conv_shapes = {"attn.c_attn.weight": (C, 3 * C), "attn.c_proj.weight": (C, C),
                       "mlp.c_fc.weight": (C, mlp), "mlp.c_proj.weight": (mlp, C)}
        out = {}
        for name, tensor in raw.items():
            if name.endswith(_IGNORED_SUFFIXES) or name == "lm_head.weight":
                continue  # causal-mask buffers; lm_head is tied to wte
            key = name if name.startswith("transformer.") else f"transformer.{name}"
            suffix = next((s for s in CONV1D_WEIGHTS if key.endswith(s)), None)
            if suffix is not None:
                if tuple(tensor.shape) != conv_shapes[suffix]:
                    raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                                     f"expected Conv1D [in, out] = {conv_shapes[suffix]}")
                tensor = tensor.t()
            out[key] = tensor
        return out

    def forward(self, batch: StepBatch, kv_cache: KVCache) -> torch.Tensor:
        """Run one step: write the new tokens' K/V into ``kv_cache`` and return the final
        hidden states ``[T, n_embd]`` (after ``ln_f``)."""
        t = self.transformer
        kernels = self.kernels(batch.input_ids.device)
        x = t.wte(batch.input_ids) + t.wpe(batch.positions)  # [T, C]
        for block in t.h:
            x = block(x, batch, kv_cache, kernels)
        return t.ln_f(x)
