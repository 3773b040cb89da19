"""The flags every command shares: the model's, and the engine's, derived from
:class:`~cbatch.config.EngineConfig` so that its defaults and help live in one place."""

from __future__ import annotations

import argparse
import json
import re

from cbatch.config import DEFAULT_MODEL, engine_fields


def model_parser() -> argparse.ArgumentParser:
    """The model flags, as a parent parser of the commands that load a model."""
    model = argparse.ArgumentParser(add_help=False)
    model.add_argument("--model", default=None,  # None: not given (serve's MODEL may be)
                       help="random:<size>, a local HF checkpoint dir, a hub id, or a .gguf "
                            f"file (default: {DEFAULT_MODEL})")
    model.add_argument("--tokenizer", default=None,
                       help="a tokenizer dir or hub id (default: the model's own)")
    model.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (default: auto, "
                       "cuda when available, else cpu)")
    model.add_argument("--dtype", default="auto", type=dtype_name,
                       choices=DTYPES + tuple(DTYPE_ALIASES),
                       help="weights, activations and KV cache; vLLM's half and float are "
                            "float16 and float32 (default: auto: float16 on CUDA, bfloat16 on "
                            "a CPU with native bf16 (AVX512-BF16, AMX), else float32)")
    model.add_argument("--debug", action="store_true",
                       help="show the Python traceback of an error (or CBATCH_DEBUG=1)")
    return model


DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's --dtype names


def dtype_name(text: str) -> str:
    """A ``--dtype``, vLLM's aliases (half, float) as the names cbatch uses."""
    return DTYPE_ALIASES.get(text, text)


def human_readable_int(text: str) -> int:
    """An int as vLLM's flags read one (its ``human_readable_int``): ``32k`` is 32,000 and
    ``32K`` 32,768 (k, m, g, t: powers of 1000, decimals allowed, ``25.6k``; K, M, G, T:
    powers of 1024, whole numbers only), anything else a plain int."""
    text = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", text)
    if match is None:
        return int(text)
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
    if "." in number:
        raise argparse.ArgumentTypeError(f"decimals are not allowed with binary suffixes like "
                                         f"{suffix}; did you mean {number}{suffix.lower()}?")
    return int(number) * 1024 ** ("KMGT".index(suffix) + 1)


human_readable_int.__name__ = "int (32k = 32000, 32K = 32768)"  # argparse's "invalid ..."
# the engine flags that take human-readable ints, as vLLM's do
HUMAN_READABLE = frozenset({"max_model_len", "max_num_batched_tokens"})


def json_object(text: str) -> dict:
    """A flag's JSON object (``--speculative-config '{"method": "ngram", ...}'``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object {{...}} is needed, got {text!r}")
    return value


json_object.__name__ = "JSON object"  # what argparse's "invalid ... value" message calls it

_TYPES = {"int": int, "str": str, "float": float, "dict": json_object}


def add_engine_args(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """One flag per :class:`EngineConfig` field that has one: ``--max-num-seqs`` for
    ``max_num_seqs``; switches as ``--name`` / ``--no-name``."""
    group = parser.add_argument_group("engine (cbatch.EngineConfig)")
    names = [f.name for f in engine_fields() if f.name not in exclude]
    # what engine_kwargs reads: an excluded field's name may be another flag's (generate's
    # --seed is the sampling seed, not the engine's)
    parser.set_defaults(engine_fields=tuple(names))
    for f in engine_fields():
        if f.name not in names:
            continue
        flag = "--" + f.name.replace("_", "-")
        help = f.metadata["help"]
        if f.type in ("bool", "bool | None"):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                               help=help)
            continue
        kind = _TYPES[f.type.split(" | ")[0]]  # "int | None" -> int, "dict | ..." -> JSON
        if f.name in HUMAN_READABLE:
            kind = human_readable_int
            said, default, rest = help.partition(" (default")
            help = f"{said}; 32k is 32000, 32K 32768, as vLLM reads them{default}{rest}"
        group.add_argument(flag, type=kind, default=f.default,
                           choices=f.metadata.get("choices"), help=help)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine flags of ``args`` (and the model's) as :class:`EngineConfig` keywords."""
    kwargs = {name: getattr(args, name) for name in getattr(args, "engine_fields", ())}
    return dict(kwargs, device=args.device, dtype=args.dtype, tokenizer=args.tokenizer)


def resolve_model(args: argparse.Namespace) -> None:
    """Set ``args.model``: ``serve``'s positional MODEL or ``--model`` (the same model given
    both ways is fine; two different ones are refused, not one silently dropped), else
    :data:`DEFAULT_MODEL`."""
    tag = getattr(args, "model_tag", None)
    if tag is not None and args.model is not None and tag != args.model:
        raise ValueError(f"two models given: {tag!r} (positional) and --model {args.model!r}; "
                         "give one")
    args.model = tag or args.model or DEFAULT_MODEL


def resolve_device_and_dtype(args: argparse.Namespace) -> None:
    """Fill in ``args.device`` ("auto": CUDA when present) and ``args.dtype`` ("auto": see
    :func:`cbatch.devices.auto_dtype`), checking that this machine has the device."""
    import torch

    from cbatch.devices import auto_dtype, check_device

    if args.device in (None, "auto"):
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.device = check_device(args.device)
    if args.dtype in (None, "auto"):
        args.dtype = auto_dtype(args.device)


def load_llm(args: argparse.Namespace, **kwargs):
    """The ``LLM`` for the model flags of ``args`` (and its engine flags, if it has them);
    ``kwargs`` override them."""
    from cbatch.entrypoints.llm import LLM

    resolve_model(args)
    resolve_device_and_dtype(args)
    return LLM(args.model, **{**engine_kwargs(args), **kwargs})

