"""Loading models: Hugging Face checkpoints (local or from the hub), and seeded random weights.

The checkpoint's ``config.json`` names its architecture (:mod:`cbatch.models.registry`).
Weights load the way nanoGPT and gpt-fast do: Hugging Face parameter names are kept (GPT-2's
Conv1D weights ``[in, out]`` transposed into ``nn.Linear``'s ``[out, in]``, the Llama family's
q/k/v and gate/up stacked into fused projections, each with a shape check), and the model is
built on the ``meta`` device and the checkpoint's tensors are assigned to it, so loading is one
copy.  Weights come from ``model.safetensors``, from shards listed in
``model.safetensors.index.json``, or from ``pytorch_model.bin``, in whatever float dtype they
were saved.  Hub ids and local directories are resolved by :mod:`cbatch.hub` (the tokenizer
and the server use it too; its names stay importable from here).
"""

from __future__ import annotations

import dataclasses
import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from cbatch import quantization as quant
from cbatch.hub import find_gguf_file, resolve_checkpoint_dir
from cbatch.layers.quantization import Place, quantize_head, quantize_model
from cbatch.logger import init_logger
from cbatch.models.assign import assign
from cbatch.models import quantized_checkpoint
from cbatch.models.gpt2 import MODEL_CONFIGS, GPT2Config, GPT2LMHeadModel
from cbatch.tokenizer import Tokenizer, load_tokenizer
from cbatch.models.registry import (architecture_of, model_class, outlier_channels,
                                    random_llama_configs)

logger = init_logger(__name__)


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


def load_state_dict(path: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The raw tensors of ``model.safetensors`` (preferred), of the shards that
    ``model.safetensors.index.json`` lists, or of ``pytorch_model.bin`` in ``path``."""
    from safetensors.torch import load_file

    if (path / "model.safetensors").is_file():
        return load_file(path / "model.safetensors", device=str(device))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shards that {path} lacks: {missing}")
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(path / shard, device=str(device)))
        return state
    if (path / "pytorch_model.bin").is_file():
        return torch.load(path / "pytorch_model.bin", map_location=device, weights_only=True)
    raise FileNotFoundError(f"{path} holds neither model.safetensors nor pytorch_model.bin "
                            "(nor shards listed in model.safetensors.index.json)")


def random_model_names() -> list[str]:
    """Every ``random:<name>``: GPT-2's sizes and the Llama family's."""
    return sorted(MODEL_CONFIGS) + sorted(random_llama_configs())


def load_model_and_tokenizer(config, place: Place | None = None
                             ) -> tuple[nn.Module, Tokenizer]:
    """The model and the tokenizer that ``config`` (an ``EngineConfig``) names (``place``:
    :func:`load_model`'s), the tokenizer
    built on a thread of its own while the model loads, then given the model's EOS: a GGUF
    file's tokenizer is seconds of Python (transformers' converter over its vocabulary) and
    the model's load mostly torch's kernels, which leave the GIL (benchmarks/NOTES.md,
    "Loading a model: cold start and memory after load")."""
    with ThreadPoolExecutor(1, thread_name_prefix="cbatch-tokenizer") as pool:
        building = pool.submit(load_tokenizer, config.model, config.tokenizer)
        model = load_model(config.model, config.device, config.torch_dtype, config.seed,
                           config.attention_backend, config.quantization, place)
        tokenizer = building.result()
    tokenizer.eos_token_id = model.config.eos_token_id
    return model, tokenizer


def load_model(name_or_path: str, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32, seed: int = 0,
               attention_backend: str | None = None,
               quantization: str | quant.QuantizationMethod | None = None,
               place: Place | None = None) -> nn.Module:
    """Build a model and load its weights.

    ``name_or_path`` is ``random:<name>`` (a name from :func:`random_model_names`, with
    seeded random weights), a local directory with Hugging Face files (config.json naming a
    supported architecture, plus weights: see :func:`load_state_dict`), a hub id fetched
    through huggingface_hub, or a GGUF file (a ``.gguf`` path, or a directory holding one:
    :mod:`cbatch.models.gguf`).  Real weights are loaded with one copy: the model is built on
    the meta device and the checkpoint tensors are assigned to it.

    ``quantization``: a name of :data:`cbatch.quantization.METHODS` or its record.  An online
    method (``"int8"``, ``"int4"``, ``"w8a8"``, ``"w4a8"``) quantizes the decoder layers'
    linear weights once loaded (:func:`cbatch.layers.quantization.quantize_model`).  A
    checkpoint that is quantized already (a ``quantization_config`` in config.json: GPTQ,
    AWQ, compressed-tensors) loads its own quantized layers
    (:mod:`cbatch.models.quantized_checkpoint`); ``quantization`` may then be None or that
    method, as in vLLM, or a method that ``runs_checkpoints`` (``"w4a8"``, ``"w8a8"``): its
    kernel runs the checkpoint's own weights, their inputs quantized to int8 at every call,
    where the layers hold what that kernel takes, and its ``head`` scheme quantizes the
    lm_head as the online method does.  Where each method runs: its record's ``check_run``.

    ``place``: where the model runner will keep the weights (a CPU runner's huge pages,
    :func:`cbatch.core.worker.weight_place`); each quantized layer of a quantized checkpoint
    or GGUF file moves there as soon as it is made, so that loading never holds every layer's
    unpacked and packed copies at once.  None: the runner moves them when it is built.
    """
    method = quant.get(quantization)  # the one check of the name; a record passes as it is
    what = f"({str(dtype).removeprefix('torch.')}, {device}" + \
        (f", {method.name})" if method else ")")
    if name_or_path.startswith("random:"):
        if method is not None and not method.online:
            raise ValueError(f"quantization={method.name!r} loads a {method.name} checkpoint, "
                             f"not {name_or_path} (random weights quantize online: "
                             f"{', '.join(map(repr, quant.ONLINE))})")
        _check_run(method, device, dtype)
        logger.info("loading %s %s ...", name_or_path, what)
        name = name_or_path.removeprefix("random:")
        llama = random_llama_configs()
        if name in llama:  # CPU fp32 first: seeded identically on every device
            architecture, config = llama[name]
            model = model_class(architecture)(config, attention_backend)
            model.init_random(seed, outliers=outlier_channels(name))
        elif name in MODEL_CONFIGS:
            model = GPT2LMHeadModel(GPT2Config.named(name), attention_backend)
            _init_random(model, seed)
        else:
            raise ValueError(f"unknown model size {name!r}; known: {random_model_names()}")
        return _quantized(model.to(device=device, dtype=dtype).eval(), method, device)

    if (gguf_file := find_gguf_file(name_or_path)) is not None:  # llama.cpp's format
        from cbatch.models.gguf.loader import load_gguf_model

        logger.info("loading %s %s ...", gguf_file, what)
        return load_gguf_model(gguf_file, device, dtype, attention_backend, method, place)
    path = resolve_checkpoint_dir(name_or_path)  # first: a name that is wrong is one line
    logger.info("loading %s %s ...", name_or_path, what)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json at {path / 'config.json'}")
    where = path / "config.json"
    raw = read_json_object(where)
    architecture = architecture_of(raw, where)
    found = quantized_checkpoint.quant_method(raw, where)
    kernel = quant.for_checkpoint(method, found, str(where))
    _check_run(method, device, dtype)
    _check_run(quant.get(found), device, dtype)
    cls = model_class(architecture)
    if found is not None and cls is GPT2LMHeadModel:
        raise ValueError(f"{where}: a quantized {architecture} checkpoint is not supported; "
                         "cbatch loads quantized Llama-family checkpoints")
    try:
        if cls is GPT2LMHeadModel:
            config = GPT2Config.from_hf(path)
        else:
            config = cls.config_class.from_hf(raw, **cls.config_switches)
    except KeyError as e:
        raise ValueError(f"{where}: field {e} is missing (a {architecture} config needs "
                         "it)") from None
    except (TypeError, ValueError) as e:  # a field of the wrong type or value
        message = str(e)
        raise ValueError(message if message.startswith(str(path)) else
                         f"{where}: {message}") from None
    raw_state = load_state_dict(path, device)
    mapped = {t.untyped_storage().data_ptr() for t in raw_state.values()}
    layers: dict = {}
    if cls is GPT2LMHeadModel:
        state = cls.convert_hf_state_dict(raw_state, config)
        tied = ("lm_head.weight", "transformer.wte.weight")
    else:
        config = _with_generation_eos(config, path)
        if found is not None:
            layers = quantized_checkpoint.read_layers(raw, raw_state, where)
        try:
            state = cls.convert_hf_state_dict(raw_state, config)
        except ValueError as e:
            raise ValueError(f"{path / 'model.safetensors'}: {e}") from None
        tied = ("lm_head.weight", "model.embed_tokens.weight") \
            if config.tie_word_embeddings else None
    with torch.device("meta"):
        model = cls(config, attention_backend)
    if found is not None:
        hint = quantized_checkpoint.suggested_kernel(layers) \
            if kernel is None and torch.device(device).type == "cpu" else None
        count = quantized_checkpoint.install(model, layers, state, where, device, dtype,
                                             kernel, place)  # (consumes layers)
        logger.info("loaded %d quantized linear layers (%s%s)", count, found,
                    f", run as {kernel.name}" if kernel else "")
        _say_faster(hint)
    assign(model, state, path, tied, device, dtype)
    del raw_state, state, layers
    if found is not None:
        if kernel and quantize_head(model, kernel.head):
            logger.info("quantized the lm_head to int8 (%s)", kernel.name)
    else:
        model = _quantized(model, method, device)
    return _own_memory(model.eval(), mapped)


def _say_faster(method: str | None) -> None:
    """Log that ``method``'s int8-activation kernel would run the weights just loaded faster
    on this CPU (a quantized checkpoint's, or online ``int4``'s)."""
    if method:
        logger.info("quantization=%r would run these weights with int8 activations, "
                    "faster on a CPU (benchmarks/NOTES.md, GPTQ as W4A8)", method)


def _check_run(method: quant.QuantizationMethod | None, device, dtype: torch.dtype) -> None:
    if method is not None:
        method.check_run(torch.device(device).type, str(dtype).removeprefix("torch."))


def _quantized(model: nn.Module, method: quant.QuantizationMethod | None,
               device: torch.device | str) -> nn.Module:
    if method is not None:
        count = quantize_model(model, method)
        logger.info("quantized %d linear layers to %s", count, method.name)
        if method.name == "int4" and torch.device(device).type == "cpu":
            _say_faster("w4a8")  # the same int4 weights; OpenVINO's int4 runs so on a CPU
    return model


def read_json_object(path: Path) -> dict:
    """A checkpoint's JSON file (config.json, generation_config.json) as a dict; ValueError
    naming the file and what is wrong with it (not JSON, or not a JSON object)."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e.msg} at line {e.lineno}, column "
                         f"{e.colno}") from None
    if not isinstance(raw, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
            type(raw), "a number")
        raise ValueError(f"{path} holds {kind}, not the JSON object ({{...}}) of a Hugging "
                         "Face config")
    return raw


def _with_generation_eos(config, path: Path):
    """The end-of-sequence ids of config.json and of ``generation_config.json`` together (chat
    checkpoints put the end-of-turn token in the latter, and generation stops at either)."""
    gen = path / "generation_config.json"
    if not gen.is_file():
        return config

    def ids(value) -> tuple[int, ...]:
        return tuple(value) if isinstance(value, list | tuple) else () if value is None \
            else (value,)

    eos = ids(config.eos_token_id)
    eos += tuple(i for i in ids(read_json_object(gen).get("eos_token_id")) if i not in eos)
    return dataclasses.replace(config, eos_token_id=eos[0] if len(eos) == 1 else eos or None)


def _own_memory(model: nn.Module, mapped: set[int]) -> nn.Module:
    """Copy the parameters and buffers still viewing the checkpoint's storages (``mapped``:
    their data pointers; a safetensors file is memory-mapped, and one tensor left in it keeps
    the whole file's pages in the process) into memory of their own.  What quantization and
    the fused projections replaced is then released with the file (issue 74: a bf16
    checkpoint quantized to w4a8 held 2.1 GB of file pages for 0.7 GB of weights)."""
    for t in (*model.parameters(), *model.buffers()):  # a tied weight once, then not mapped
        if t.untyped_storage().data_ptr() in mapped:
            t.data = t.data.clone()
    return model
