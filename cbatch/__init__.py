"""cbatch: continuous-batching inference for GPT-2-family models with ragged paged attention."""

from cbatch import ops
from cbatch.config import MODEL_CONFIGS, GPT2Config
from cbatch.kv_cache import KVCache, bytes_per_token
from cbatch.models.gpt2 import GPT2LMHeadModel, load_model

__version__ = "0.1.0"

__all__ = [
    "GPT2Config",
    "GPT2LMHeadModel",
    "KVCache",
    "MODEL_CONFIGS",
    "bytes_per_token",
    "load_model",
    "ops",
]
