"""Qwen3 (dense): the Llama decoder with an RMSNorm over each head of q and k before the
rotary embedding (``q_norm``, ``k_norm``: one weight of ``head_dim`` shared by all heads);
projection biases as ``attention_bias`` says."""

from __future__ import annotations

from cbatch.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    config_switches = {"qk_norm": True}
