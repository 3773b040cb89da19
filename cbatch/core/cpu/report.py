"""Which CPU fast paths are live on this machine: what ``cbatch --version`` reports.

A CPU engine's own paths (its dtype's route, its lm_head's screen) are in
:meth:`cbatch.core.cpu.model_runner.CPUModelRunner.describe`; which kernel paths actually
ran, in :func:`cbatch.ops.cpu.kernel_paths`.
"""

from __future__ import annotations

import torch

from cbatch import envs
from cbatch.core.cpu.memory import huge_pages_available
from cbatch.core.cpu.threads import ThreadPolicy
from cbatch.models import cpu_layers
from cbatch.ops import compiled, cpu, quantized

DTYPES = (torch.float32, torch.bfloat16)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _route(dtype: torch.dtype) -> str:
    try:
        return cpu.cpu_linear_route(dtype)
    except ValueError as e:  # CBATCH_CPU_LINEAR names a route that cannot run it
        return f"none ({e})"


def screen_phrase(kind: str | None) -> str:
    """A greedy screen's kind ("int8", "bf16"), or why there is none."""
    if kind:
        return kind
    return "off (CBATCH_GREEDY_SCREEN=0)" if not envs.CBATCH_GREEDY_SCREEN else "none"


def _screen(dtype: torch.dtype) -> str:
    kind = cpu.screen_kind(dtype)
    return screen_phrase(kind if _route(dtype) == "cbatch" else None)


def _attention() -> str:
    """The attention step of each kind of head dim, as the kernels choose it."""
    steps = [cpu.attention_step(d) for d in (16, 8, 4)]  # multiples of 16, of 8, the rest
    if not steps[0]:
        return "none: the pure-torch reference (no extension)"
    if len(set(steps)) == 1:
        why = " (CBATCH_CPU_ATTENTION=generic)" if envs.CBATCH_CPU_ATTENTION else ""
        return f"{steps[0]} for every head dim{why}"
    bf16 = cpu.attention_step(16, torch.bfloat16)
    parts = [f"{steps[0]} for head dims that are multiples of 16"
             + (f" ({bf16} for bfloat16)" if bf16 != steps[0] else "")]
    if steps[1] != steps[0]:
        parts.append(f"{steps[1]} for multiples of 8")
    return ", ".join(parts + [f"else {steps[2]}"])


def cpu_paths() -> dict[str, str]:
    """The CPU paths live here, a phrase each: ``isa`` (what the C++ kernels use, after
    ``$CBATCH_CPU_ISA``), ``attention``, ``linear`` (the route of each dtype), ``greedy
    screen`` (the lm_head's screen of each dtype), ``quantized linear``, ``loading`` (who
    unpacks and packs quantized weights), ``decoder layers`` (a Llama-family
    model's, in one C++ call a step or op by op), ``huge pages`` and ``threads``."""
    return {
        "isa": isa_phrase(),
        "attention": _attention(),
        "linear": ", ".join(f"{_name(d)} {_route(d)}" for d in DTYPES),
        "greedy screen": ", ".join(f"{_name(d)} {_screen(d)}" for d in DTYPES),
        "quantized linear": quantized_phrase(),
        "loading": loading_phrase(),
        "decoder layers": layers_phrase(),
        "huge pages": "on" if huge_pages_available() else
                      "off" + (" (CBATCH_HUGE_PAGES=0)" if not envs.CBATCH_HUGE_PAGES else ""),
        "threads": ThreadPolicy().describe(),
    }


def quantized_phrase() -> str:
    """Where int8 and int4 weights (W8A16, W4A16), W8A8, W4A8 and W8A8 per group run:
    cbatch's kernels and their ISA, or the reference."""
    isa = quantized.isa("w8a16")
    if isa:
        tiles = "; AMX-INT8 tiles from 8 rows" if quantized.amx_int8_tiles() else ""
        w4a8_isa = quantized.isa("w4a8")
        w4a8 = (f"cbatch's kernel ({w4a8_isa}{tiles}), int8 dot products" if w4a8_isa
                else "the pure-torch reference")
        bf16 = quantized.isa("w4a16", torch.bfloat16)
        return (f"int8, int4: cbatch's kernel ({isa}), dequantized in registers"
                + (f" (int4 on bf16: {bf16})" if bf16 != isa else "") + "; w8a8: "
                f"cbatch's kernel ({quantized.isa('w8a8')}{tiles}), int8 dot products; "
                f"w4a8: {w4a8}; w8a8 per group: "
                + (f"cbatch's kernel ({quantized.isa('w8a8g')})" if w4a8_isa
                   else "the pure-torch reference"))
    return "int8, int4, w8a8, w4a8: the pure-torch reference (no AVX2 or AVX-512 kernel here)"


def loading_phrase() -> str:
    """Who unpacks a GGUF file's blocks and packs quantized weights at load: cbatch's C++
    (csrc/cpu/gguf_blocks.cpp, quantized_pack.cpp; one pass each) or, without the extension,
    the torch code that documents them."""
    if "cpu" in compiled.compiled_backends():
        return "GGUF blocks unpacked and quantized weights packed by cbatch's C++, one pass each"
    return "GGUF blocks and quantized weights: the torch code (no extension)"


def layers_phrase() -> str:
    """How a Llama-family model's decoder layers run a CPU step here
    (:mod:`cbatch.models.cpu_layers`; an engine's runner says it for its own model)."""
    why = cpu_layers.unavailable()
    return f"op by op: {why}" if why else \
        "Llama family: one C++ call a step, where every layer runs a C++ kernel"


def isa_phrase() -> str:
    """What the C++ kernels use, with the cap if one is set."""
    cap = " (capped by CBATCH_CPU_ISA=avx2)" if envs.CBATCH_CPU_ISA else ""
    return (cpu.cpu_isa() or "none: portable C++ and torch") + cap


def format_paths(paths: dict[str, str], indent: str = "  ") -> list[str]:
    """One aligned line per entry of :func:`cpu_paths` or ``CPUModelRunner.describe``."""
    width = max(map(len, paths))
    return [f"{indent}{name:<{width}}  {value}" for name, value in paths.items()]
