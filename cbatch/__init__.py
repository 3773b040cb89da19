"""cbatch: continuous-batching inference for GPT-2 and the Llama family, with ragged paged
attention.

The names below are imported on first use, so ``import cbatch.ops`` or ``import cbatch.hf``
loads the kernels and nothing of the engine, the entry points or the server.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "cbatch.entrypoints.llm",
    "Engine": "cbatch.core.engine",
    "EngineConfig": "cbatch.config",
    "GPT2Config": "cbatch.models.gpt2",
    "MODEL_CONFIGS": "cbatch.models.gpt2",
    "RequestOutput": "cbatch.outputs",
    "SamplingParams": "cbatch.sampling_params",
    "GPT2LMHeadModel": "cbatch.models.gpt2",
    "load_model": "cbatch.models.loader",
    "KVCache": "cbatch.layers.kv_cache",
    "bytes_per_token": "cbatch.layers.kv_cache",
    "AsyncEngine": "cbatch.core.async_engine",
    "serve": "cbatch.entrypoints.ray_serve",
}

__all__ = sorted(_EXPORTS) + ["ops"]


def __getattr__(name: str):
    if name == "ops":
        return importlib.import_module("cbatch.ops")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cbatch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
