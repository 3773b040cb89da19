"""Loading models: Hugging Face checkpoints (local or from the hub), and seeded random weights.

Weights load the way nanoGPT and gpt-fast do: Hugging Face parameter names are kept, exactly
the Conv1D weights ``[in, out]`` are transposed into ``nn.Linear``'s ``[out, in]`` (each with a
shape check), and the model is built on the ``meta`` device and the checkpoint's tensors are
assigned to it, so loading is one copy.  The tokenizer and the server find a checkpoint's other
files through :func:`resolve_checkpoint_dir`.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from cbatch.config import GPT2Config
from cbatch.models.gpt2 import GPT2LMHeadModel

CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                  "mlp.c_proj.weight")  # stored [in, out] by HF's Conv1D
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
        suffix = next((s for s in CONV1D_WEIGHTS if key.endswith(s)), None)
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
