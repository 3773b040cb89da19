"""A GGUF file as a cbatch model, through the checkpoint loaders' paths.

The file is memory-mapped and each tensor decoded once (:mod:`cbatch.models.gguf.blocks`),
renamed and reshaped as Hugging Face stores it (:mod:`cbatch.models.gguf.names`).  On the CPU
the quantized linears become :class:`~cbatch.models.quantized_checkpoint.layer.Layer` in the
exact form of their block type (:mod:`cbatch.models.gguf.quantized`) and are installed as
quantized checkpoints' are (q/k/v and gate/up fused, or stacked where their types differ);
the other tensors are dequantized to fp32, cast to the model's dtype and handed to what loads
every Hugging Face checkpoint (the model class's ``convert_hf_state_dict``, then
:func:`cbatch.models.assign.assign`).
"""

from __future__ import annotations

import functools
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from cbatch.layers.embedding import tied_embeddings, weight_holders
from cbatch import file_cache
from cbatch.layers.quantization import Place, QuantizedLinear
from cbatch.quantization import QuantizationMethod
from cbatch.logger import init_logger
from cbatch.models.assign import assign
from cbatch.models.gguf.blocks import BLOCK_TYPES, dequantize_tensor
from cbatch.models.gguf.config import model_config
from cbatch.models.gguf.names import CONFIG_TENSORS, hf_name, to_hf
from cbatch.models.gguf.quantized import is_quantized_linear, read_layer
from cbatch.models.quantized_checkpoint import install
from cbatch.models.quantized_checkpoint.layer import Layer, finite
from cbatch.models.gguf.reader import ARCHITECTURES, GGUFFile
from cbatch.models.module_file import load_module, save_module
from cbatch.models.registry import model_class
from cbatch.ops.quantized import GROUPED_A8

logger = init_logger(__name__)


def load_gguf_model(path: str | Path, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32, attention_backend: str | None = None,
                    quantization: QuantizationMethod | None = None,
                    place: Place | None = None) -> nn.Module:
    """The model in GGUF file ``path`` (:func:`read_gguf_model`), on the CPU read back from
    the file cache where an earlier start made it (:mod:`cbatch.file_cache`), else made and
    written there: its packed tensors are then the cache file's pages, mapped as llama.cpp
    maps its file, not copied to ``place`` (benchmarks/NOTES.md, "Loading a model: cold start
    and memory after load")."""
    path = Path(path)
    cached = None
    if torch.device(device).type == "cpu":
        from cbatch.ops.cpu import cpu_isa

        cached = file_cache.entry(
            "model", path, args=dict(dtype=str(dtype), backend=attention_backend,
                                     quantization=quantization and quantization.name),
            depends=dict(torch=torch.__version__, isa=cpu_isa()))
    if cached is not None and cached.exists:
        start = time.perf_counter()
        try:
            model = load_module(cached.path)
        except Exception as e:  # noqa: BLE001 (a damaged entry is made anew)
            logger.warning("%s: the cached model %s did not load (%s: %s); reading the file",
                           path.name, cached.path, type(e).__name__, e)
            cached.remove()
        else:
            for layer in model.modules():
                if isinstance(layer, QuantizedLinear):
                    layer.placed = True  # (the runner leaves them in the mapped file)
            logger.info("%s: read the packed model from %s in %.2f s", path.name, cached.path,
                        time.perf_counter() - start)
            return model
    model = read_gguf_model(path, device, dtype, attention_backend, quantization, place)
    if cached is not None:
        start = time.perf_counter()
        if cached.write(functools.partial(save_module, model), model.weight_bytes()):
            logger.info("%s: wrote the packed model to %s in %.2f s (read back at the next "
                        "start; CBATCH_FILE_CACHE=0: never)", path.name, cached.path,
                        time.perf_counter() - start)
    return model


def read_gguf_model(path: str | Path, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32, attention_backend: str | None = None,
                    quantization: QuantizationMethod | None = None,
                    place: Place | None = None) -> nn.Module:
    """The model in GGUF file ``path`` on ``device``, its float tensors in ``dtype``.

    On the CPU the decoder's quantized linears (and an untied quantized lm_head) run on
    cbatch's quantized kernels, each in the exact form of its block type
    (:mod:`cbatch.models.gguf.quantized`); elsewhere, and for GPT-2 files, every tensor is
    dequantized to ``dtype``.  ``quantization``: None or ``"w4a8"``: every quantized layer's
    inputs quantized to int8 per token and per group of its k at every call, as llama.cpp runs
    them (W4A8 on 4-bit levels, W8A8 per group on 8-bit ones; 2.2-2.5x faster than float
    inputs on AVX2), and a tied lm_head of a quantized embedding run as the embedding's own
    blocks, the embedding reading its rows from them (a float copy of a Llama 3 vocabulary is
    1 GB); on an outlier-channel model Q4_0 stays as close to the float model as with float
    activations, Q8_0 and Q6_K move about as far as llama.cpp's (benchmarks/NOTES.md,
    "Quantized weights' accuracy on outlier channels").  ``"gguf"``: every layer with float
    inputs and a float head, the dequantized weights' products up to fp32 rounding.
    ``place``: :func:`cbatch.models.loader.load_model`'s.
    """
    path = Path(path)
    if quantization is not None and quantization.name not in ("gguf", "w4a8"):
        raise ValueError(f"quantization={quantization.name!r} does not apply to {path}: a GGUF "
                         "file's tensors are quantized by the file itself; leave quantization "
                         "unset or 'w4a8' (int8 activations per group), or 'gguf' "
                         "(float activations)")
    kernels = torch.device(device).type == "cpu"
    int8 = quantization is None or quantization.name == "w4a8"  # llama.cpp's route
    with GGUFFile(path) as f:
        cls = model_class(ARCHITECTURES[f.architecture])
        config = model_config(f)
        layers: dict[str, Layer] | None = {} if kernels else None
        head = tied_head(f, config) if kernels and int8 else None
        # (a tied head's embedding is never dequantized: it reads its rows from the head)
        raw = hf_state_dict(f, config, dtype, layers,
                            skip=frozenset({"token_embd.weight"} if head else ()))
        logger.info("%s: %s; %s", path.name, f.describe_types(),
                    f"{len(layers)} linear weights run as they are quantized, the rest in "
                    f"{str(dtype).removeprefix('torch.')}" if layers else
                    f"dequantized to {str(dtype).removeprefix('torch.')}")
    state = cls.convert_hf_state_dict(raw, config)
    if f.architecture == "gpt2":
        tied = ("lm_head.weight", "transformer.wte.weight")
    else:
        tied = ("lm_head.weight", "model.embed_tokens.weight") \
            if config.tie_word_embeddings else None
    with torch.device("meta"):
        model = cls(config, attention_backend)
    if layers:
        if int8:
            layers = {name: with_int8_activations(one) for name, one in layers.items()}
        install(model, layers, state, path, device, dtype, place=place)
    if head is not None:
        tie_head(model, head, path, device, dtype, place)
        tied = None  # the embedding has no weight of its own left to tie
    assign(model, state, path, tied, device, dtype)
    return model.eval()


def tied_head(f: GGUFFile, config) -> Layer | None:
    """The blocks of ``f``'s tied quantized embedding as the lm_head's layer, its inputs int8
    per group (:func:`with_int8_activations`); None for an untied head, a float embedding or
    GPT-2's (which ties its own), or blocks no int8-activation kernel takes."""
    if f.architecture == "gpt2" or not config.tie_word_embeddings \
            or f.qtype("token_embd.weight") not in BLOCK_TYPES:
        return None
    head = with_int8_activations(checked_layer(f, "token_embd.weight", config.num_heads,
                                               config.num_kv_heads))
    return head if head.act_bits == 8 else None


def tie_head(model: nn.Module, head: Layer, path: Path, device, dtype,
             place: Place | None = None) -> None:
    """``model``'s lm_head (still on the meta device, tied to its embedding) as ``head``
    (:func:`tied_head`): int8 activations per group (W8A8 per group for Q8_0's and Q6_K's
    levels, W4A8 for 4-bit ones), the embedding reading its rows, in ``dtype``, from it, as
    llama.cpp reads ``token_embd`` for both: no float copy of the vocabulary, ever, and the
    file's weights bitwise."""
    embeddings = tied_embeddings(weight_holders(model), model.lm_head)
    install(model, {"lm_head": head}, {}, path, device, dtype, place=place)
    for embedding in embeddings or ():
        embedding.tie_quantized(model.lm_head, dtype)


def with_int8_activations(layer: Layer) -> Layer:
    """``layer`` with its inputs quantized to int8 per token and per group of its k, as
    llama.cpp quantizes them (W4A8 on 4-bit levels in groups of 32, W8A8 per group on 8-bit
    ones: Q8_0, Q5_0, Q6_K's groups of 16, Q5_1 and Q5_K's levels with mins), where the
    kernel takes it; else as it is."""
    int8 = replace(layer, act_bits=8)
    if int8.scheme.kind in GROUPED_A8 and \
            int8.scheme.refusal(layer.q.shape[1], layer.zeros is not None) is None:
        return int8
    return layer


def hf_state_dict(f: GGUFFile, config, dtype: torch.dtype,
                  layers: dict[str, Layer] | None = None,
                  skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Every parameter tensor of ``f`` under its Hugging Face name, dequantized (fp32, bitwise
    gguf's) and cast to ``dtype`` as the checkpoint loader would cast it; or, where
    ``layers`` is given, the quantized linears into it as :class:`Layer` (Hugging Face's
    layer names) instead; ``skip``: GGUF names left out.  A NaN or inf (a value, or a
    block's scale or min) is refused, naming the tensor and the file."""
    heads, kv_heads = config.num_heads, config.num_kv_heads
    state = {}
    for name in f.tensor_names:
        if name in CONFIG_TENSORS or name in skip:
            continue
        try:
            key = hf_name(f.architecture, name)
        except ValueError as e:
            raise ValueError(f"{f.path}: {e}") from None
        if f.architecture == "gpt2" and name == "output.weight":
            _check_gpt2_head(f)
            continue  # cbatch's GPT-2 ties its head to the embedding
        if layers is not None and is_quantized_linear(f, name):
            layers[key.removesuffix(".weight")] = checked_layer(f, name, heads, kv_heads)
            continue
        tensor = finite(dequantize_tensor(f.raw(name), f.qtype(name), f.shape(name)), name,
                        f.path)
        state[key] = to_hf(f.architecture, name, tensor, heads, kv_heads).to(dtype)
    return state


def checked_layer(f: GGUFFile, name: str, heads: int, kv_heads: int) -> Layer:
    """:func:`read_layer`, a NaN or inf in its scales or mins refused naming the tensor and the
    file (the levels are integers)."""
    layer = read_layer(f, name, heads, kv_heads)
    for values in (layer.scales, layer.mins):
        if values is not None:
            finite(values, name, f.path)
    return layer


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
