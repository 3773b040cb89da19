"""cbatch: continuous-batching inference for GPT-2-family models with ragged paged attention."""

from cbatch import ops
from cbatch.config import MODEL_CONFIGS, EngineConfig, GPT2Config
from cbatch.engine import Engine
from cbatch.kv_cache import KVCache, bytes_per_token
from cbatch.llm import LLM
from cbatch.models.gpt2 import GPT2LMHeadModel, load_model
from cbatch.outputs import RequestOutput
from cbatch.sampling_params import SamplingParams
from cbatch.static import StaticBatchEngine

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "Engine",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
    "StaticBatchEngine",
    "GPT2Config",
    "GPT2LMHeadModel",
    "KVCache",
    "MODEL_CONFIGS",
    "bytes_per_token",
    "load_model",
    "ops",
]
