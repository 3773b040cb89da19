"""A GGUF file as a cbatch model, through the checkpoint loader's float path.

The file is memory-mapped and each tensor decoded once (:mod:`cbatch.models.gguf.blocks`) to
fp32, renamed and reshaped as Hugging Face stores it (:mod:`cbatch.models.gguf.names`), cast
to the model's dtype, then handed to what loads every Hugging Face checkpoint
(``convert_hf_state_dict`` and ``_assign`` of :mod:`cbatch.models.loader`).  In this version the
quantized types are dequantized at load and run as float weights: the file's blocks are not
yet run by a quantized kernel.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from cbatch.quantization import QuantizationMethod
from cbatch.logger import init_logger
from cbatch.models.gguf.blocks import dequantize_tensor
from cbatch.models.gguf.config import model_config
from cbatch.models.gguf.names import CONFIG_TENSORS, hf_name, to_hf
from cbatch.models.gguf.reader import ARCHITECTURES, GGUFFile
from cbatch.models.registry import model_class

logger = init_logger(__name__)


def load_gguf_model(path: str | Path, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32, attention_backend: str | None = None,
                    quantization: QuantizationMethod | None = None) -> nn.Module:
    """The model in GGUF file ``path``, its weights dequantized to ``dtype`` on ``device``.

    ``quantization`` must be None: the file's own types are what it runs (dequantized in this
    version); quantizing its float weights again online is not offered.
    """
    from cbatch.models.loader import _assign, convert_hf_state_dict

    path = Path(path)
    if quantization is not None:
        raise ValueError(f"quantization={quantization.name!r} does not apply to {path}: a GGUF "
                         "file's tensors are quantized by the file itself; leave "
                         "quantization unset")
    with GGUFFile(path) as f:
        cls = model_class(ARCHITECTURES[f.architecture])
        config = model_config(f)
        logger.info("%s: %s; this version dequantizes them to %s at load", path.name,
                    f.describe_types(), str(dtype).removeprefix("torch."))
        raw = hf_state_dict(f, config, dtype)
    if f.architecture == "gpt2":
        state = convert_hf_state_dict(raw, config)
        tied = ("lm_head.weight", "transformer.wte.weight")
    else:
        state = cls.convert_hf_state_dict(raw, config)
        tied = ("lm_head.weight", "model.embed_tokens.weight") \
            if config.tie_word_embeddings else None
    with torch.device("meta"):
        model = cls(config, attention_backend)
    _assign(model, state, path, tied, device, dtype)
    return model.eval()


def hf_state_dict(f: GGUFFile, config, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every parameter tensor of ``f`` under its Hugging Face name, dequantized (fp32, bitwise
    gguf's) and cast to ``dtype`` as the checkpoint loader would cast it."""
    heads, kv_heads = config.num_heads, config.num_kv_heads
    state = {}
    for name in f.tensor_names:
        if name in CONFIG_TENSORS:
            continue
        try:
            key = hf_name(f.architecture, name)
        except ValueError as e:
            raise ValueError(f"{f.path}: {e}") from None
        if f.architecture == "gpt2" and name == "output.weight":
            _check_gpt2_head(f)
            continue  # cbatch's GPT-2 ties its head to the embedding
        tensor = dequantize_tensor(f.raw(name), f.qtype(name), f.shape(name))
        state[key] = to_hf(f.architecture, name, tensor, heads, kv_heads).to(dtype)
    return state


def _check_gpt2_head(f: GGUFFile) -> None:
    """llama.cpp's converter writes GPT-2's tied head as a copy, ``output.weight``; cbatch's
    GPT-2 reads the embedding for both, which is that copy unless a quantizer stored the two in
    different types."""
    same = f.qtype("output.weight") == f.qtype("token_embd.weight") and \
        torch.equal(f.raw("output.weight"), f.raw("token_embd.weight"))
    if not same:
        logger.warning("%s: output.weight (%s) differs from token_embd.weight (%s); cbatch's "
                       "GPT-2 ties its head to the embedding, so its logits use token_embd",
                       f.path.name, f.qtype("output.weight"), f.qtype("token_embd.weight"))
