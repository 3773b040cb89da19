"""Qwen2 / Qwen2.5: the Llama decoder with a bias on the q, k and v projections (none on
the output projection), whatever ``attention_bias`` says."""

from __future__ import annotations

from cbatch.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    config_switches = {"qkv_bias": True, "o_bias": False}
