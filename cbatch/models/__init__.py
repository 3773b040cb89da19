"""Models over the flat step batch, and their loader."""

from cbatch.models.gpt2 import GPT2LMHeadModel
from cbatch.models.loader import load_model

__all__ = ["GPT2LMHeadModel", "load_model"]
