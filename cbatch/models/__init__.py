"""Models that run cbatch's flat step batch over a paged KV cache."""

from cbatch.models.gpt2 import GPT2LMHeadModel, load_model

__all__ = ["GPT2LMHeadModel", "load_model"]
