"""GPT-2 in plain torch over cbatch's flat step batch and paged KV cache.

Parameter names are Hugging Face's (``transformer.h.0.attn.c_attn.weight`` …), so checkpoints
load by name; HF's Conv1D weights ``[in, out]`` are transposed into ``nn.Linear``'s
``[out, in]``, and ``lm_head`` is tied to ``wte``.  No transformers import on this path.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from cbatch import cpu_linear, ops
from cbatch.batch import StepBatch
from cbatch.config import GPT2Config
from cbatch.invariant import Linear
from cbatch.kv_cache import KVCache

_ACT = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}


class Attention(nn.Module):
    batch_invariant = False  # set by GPT2LMHeadModel.set_batch_invariant

    def __init__(self, config: GPT2Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor, batch: StepBatch, kv_cache: KVCache,
                kernels: ops.BoundKernels) -> torch.Tensor:
        T = x.shape[0]
        # q, k, v: [T, H, D] views of the fused projection (dense rows, token stride 3C)
        q, k, v = self.c_attn(x).view(T, 3, self.n_head, self.head_dim).unbind(1)
        key_cache, value_cache = kv_cache.layer(self.layer_idx)
        kernels.write_kv_cache(k, v, key_cache, value_cache, batch.slot_mapping)
        if batch.is_decode:
            o = kernels.decode(q, key_cache, value_cache, batch.block_tables, batch.seq_lens,
                               self.scale)
        else:
            o = kernels.prefill(q, key_cache, value_cache, batch.block_tables,
                                batch.cu_seqlens_q, batch.seq_lens, self.scale,
                                batch.max_query_len)
        return self.c_proj(o.reshape(T, -1))


class MLP(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.c_fc = Linear(config.n_embd, config.mlp_dim)
        self.c_proj = Linear(config.mlp_dim, config.n_embd)
        self.act = _ACT[config.activation_function]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPT2Config, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = Attention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)

    def forward(self, x, batch, kv_cache, kernels):
        x = x + self.attn(self.ln_1(x), batch, kv_cache, kernels)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)


class GPT2LMHeadModel(nn.Module):
    """GPT-2 over a flat step batch.

    >>> model = GPT2LMHeadModel.from_pretrained("random:tiny")
    >>> model.generate([[1, 2, 3], [4, 5]], max_new_tokens=4)[0].__len__()
    4
    """

    def __init__(self, config: GPT2Config, attention_backend: str | None = None):
        super().__init__()
        self.config = config
        self.attention_backend = attention_backend
        self.transformer = GPT2Model(config)
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight
        self._kernels: tuple[torch.device, ops.BoundKernels] | None = None
        self.batch_invariant = False  # see set_batch_invariant

    def kernels(self, device: torch.device) -> ops.BoundKernels:
        """The attention kernels for ``device``, resolved once (``attention_backend``, else
        ``$CBATCH_ATTENTION_BACKEND``, else the fastest available), not at every op call."""
        if self._kernels is None or self._kernels[0] != device:
            self._kernels = device, ops.bind_kernels(device, self.config.head_dim,
                                                     self.attention_backend)
        return self._kernels[1]

    def forward(self, batch: StepBatch, kv_cache: KVCache) -> torch.Tensor:
        """Run one step: write the new tokens' K/V into ``kv_cache`` and return the final
        hidden states ``[T, n_embd]`` (after ``ln_f``)."""
        t = self.transformer
        kernels = self.kernels(batch.input_ids.device)
        x = t.wte(batch.input_ids) + t.wpe(batch.positions)  # [T, C]
        for block in t.h:
            x = block(x, batch, kv_cache, kernels)
        return t.ln_f(x)

    def set_batch_invariant(self, enabled: bool) -> None:
        """Batch-invariant mode: each token's hidden states and logits are bitwise the same
        whatever else is in the step.  The linear layers run :func:`cbatch.invariant.linear`,
        and every step's attention runs the prefill kernel, so that a token's attention does
        not switch kernels (and summation order) with its batch-mates' chunk lengths."""
        self.batch_invariant = enabled
        if enabled:  # the invariant linear pads rows on the dense weights
            cpu_linear.unpack_linears(self)
        for module in self.modules():
            if isinstance(module, (Linear, Attention)):
                module.batch_invariant = enabled

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, n_embd]`` hidden states → ``[N, vocab_size]`` logits."""
        return self.lm_head(hidden)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @classmethod
    def from_pretrained(cls, name_or_path: str, device: torch.device | str = "cpu",
                        dtype: torch.dtype = torch.float32, seed: int = 0,
                        attention_backend: str | None = None) -> GPT2LMHeadModel:
        """See :func:`load_model`."""
        return load_model(name_or_path, device, dtype, seed, attention_backend)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, block_size: int = 16,
                 stop_at_eos: bool = False) -> list[list[int]]:
        """Greedy continuation of several token-id prompts at once: a convenience for using
        the model without building an engine yourself.  It runs the engine's own loop
        (:class:`cbatch.Engine` around this model, a KV pool just big enough, every prompt
        admitted in the first step); ``stop_at_eos`` ends a sequence at
        ``config.eos_token_id``.  Returns the new tokens of each prompt.
        """
        from cbatch.core.engine import Engine
        from cbatch.sampling_params import SamplingParams

        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs at least one prompt, and no empty prompt")
        lengths = [len(p) + max_new_tokens for p in prompts]
        engine = Engine(self, block_size=block_size, max_num_seqs=len(prompts),
                        max_num_batched_tokens=sum(map(len, prompts)),
                        num_blocks=sum(-(-n // block_size) for n in lengths))
        params = SamplingParams(max_tokens=max_new_tokens, ignore_eos=not stop_at_eos)
        return [out.token_ids for out in engine.generate(prompts, params)]


# ----------------------------------------------------------------------------- loading

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def _init_random(model: GPT2LMHeadModel, seed: int) -> None:
    """GPT-2's own initialisation (as in Hugging Face's), seeded and device-independent."""
    gen = torch.Generator().manual_seed(seed)
    std_proj = 0.02 / math.sqrt(2 * model.config.n_layer)
    with torch.no_grad():
        for name, p in model.named_parameters():  # lm_head is tied: not listed twice
            if name.endswith("bias"):
                value = torch.zeros(p.shape)
            elif ".ln_" in name:
                value = torch.ones(p.shape)
            else:
                std = std_proj if name.endswith("c_proj.weight") else 0.02
                value = torch.randn(p.shape, generator=gen) * std
            p.copy_(value)


CHECKPOINT_FILES = ("config.json", "*.safetensors", "pytorch_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json",
                   "chat_template.jinja")


def resolve_checkpoint_dir(name_or_path: str,
                           allow_patterns: tuple[str, ...] = CHECKPOINT_FILES + TOKENIZER_FILES
                           ) -> Path:
    """A local directory as it is, or a hub id's files matching ``allow_patterns``
    fetched (or found in the cache) by huggingface_hub."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if path.exists() or name_or_path.startswith((".", "/")):
        raise FileNotFoundError(f"{name_or_path} is not a directory (one holding "
                                f"{', '.join(allow_patterns)})")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name_or_path, allow_patterns=list(allow_patterns)))
    except Exception as e:  # offline, unknown repo, no huggingface_hub
        raise FileNotFoundError(f"{name_or_path!r} is neither a local directory nor "
                                f"a reachable Hugging Face hub id ({type(e).__name__}: {e})"
                                ) from e


def load_state_dict(path: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The raw tensors of ``model.safetensors`` (preferred) or ``pytorch_model.bin`` in ``path``."""
    if (path / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(path / "model.safetensors", device=str(device))
    if (path / "pytorch_model.bin").is_file():
        return torch.load(path / "pytorch_model.bin", map_location=device, weights_only=True)
    raise FileNotFoundError(f"{path} holds neither model.safetensors nor pytorch_model.bin")


def convert_hf_state_dict(raw: dict[str, torch.Tensor], config: GPT2Config
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
        suffix = next((s for s in _CONV1D if key.endswith(s)), None)
        if suffix is not None:
            if tuple(tensor.shape) != conv_shapes[suffix]:
                raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                                 f"expected Conv1D [in, out] = {conv_shapes[suffix]}")
            tensor = tensor.t()
        out[key] = tensor
    return out


def load_model(name_or_path: str, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32, seed: int = 0,
               attention_backend: str | None = None) -> GPT2LMHeadModel:
    """Build a GPT-2 and load its weights.

    ``name_or_path`` is ``random:<size>`` (a size from :data:`cbatch.config.MODEL_CONFIGS`
    with seeded random weights), a local directory with Hugging Face files (config.json plus
    model.safetensors or pytorch_model.bin), or a hub id fetched through huggingface_hub.
    Real weights are loaded with one copy: the model is built on the meta device and the
    checkpoint tensors are assigned to it.
    """
    if name_or_path.startswith("random:"):
        config = GPT2Config.named(name_or_path.removeprefix("random:"))
        model = GPT2LMHeadModel(config, attention_backend)  # CPU fp32: seeded identically
        _init_random(model, seed)
        return model.to(device=device, dtype=dtype).eval()

    path = resolve_checkpoint_dir(name_or_path)
    config = GPT2Config.from_hf(path)
    state = convert_hf_state_dict(load_state_dict(path, device), config)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config, attention_backend)
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match the GPT-2 config: missing "
                         f"{missing[:5]}{'…' if len(missing) > 5 else ''}, unexpected "
                         f"{unexpected[:5]}{'…' if len(unexpected) > 5 else ''}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, the "
                             f"config expects {tuple(expected[name].shape)}")
        state[name] = tensor.to(device=device, dtype=dtype).contiguous()
    state["lm_head.weight"] = state["transformer.wte.weight"]
    model.load_state_dict(state, assign=True, strict=True)
    model.lm_head.weight = model.transformer.wte.weight
    return model.eval()
