"""The static-batching baseline that continuous batching replaces (for comparison only).

Requests are cut into fixed batches in arrival order; each batch is left-padded to its
longest prompt, prefilled as one dense ``[B, L]`` tensor, and decoded until its *longest*
request finishes — finished rows keep computing (that is the padding cost).  It runs the
same GPT-2 weights and sampler as the engine, with dense per-batch K/V and torch's SDPA.
"""

from __future__ import annotations

import itertools
import time

import torch
import torch.nn.functional as F

from cbatch.config import EngineConfig
from cbatch.core.engine import load_model_and_tokenizer, request_output
from cbatch.models.gpt2 import GPT2LMHeadModel
from cbatch.outputs import RequestOutput
from cbatch.core.sampler import SamplingBatch, compute_logprobs, sample
from cbatch.sampling_params import SamplingParams
from cbatch.core.sequence import Sequence, SequenceStatus


def dense_forward(model: GPT2LMHeadModel, input_ids: torch.Tensor, position_ids: torch.Tensor,
                  key_mask: torch.Tensor, past: list[tuple[torch.Tensor, torch.Tensor]]
                  ) -> torch.Tensor:
    """One padded step: ``input_ids [B, L]`` after ``past`` (per layer ``[B, H, P, D]`` K/V,
    extended in place of the list); ``key_mask [B, P + L]`` marks real tokens.  Returns the
    last position's logits ``[B, V]``."""
    t = model.transformer
    B, L = input_ids.shape
    H, D = model.config.n_head, model.config.head_dim
    P = past[0][0].shape[2] if past else 0
    query_pos = torch.arange(P, P + L, device=input_ids.device)
    causal = torch.arange(P + L, device=input_ids.device)[None, :] <= query_pos[:, None]
    allowed = causal[None] & key_mask[:, None, :]  # [B, L, P + L]
    # a padding query sees only itself (a row with no key at all would be NaN)
    allowed[:, torch.arange(L), P + torch.arange(L)] = True
    x = t.wte(input_ids) + t.wpe(position_ids)
    for i, block in enumerate(t.h):
        q, k, v = block.attn.c_attn(block.ln_1(x)).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4)
        if past and len(past) > i:
            k = torch.cat([past[i][0], k], dim=2)
            v = torch.cat([past[i][1], v], dim=2)
            past[i] = (k, v)
        else:
            past.append((k, v))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
        x = x + block.attn.c_proj(o.transpose(1, 2).reshape(B, L, H * D))
        x = x + block.mlp(block.ln_2(x))
    return model.compute_logits(t.ln_f(x[:, -1]))


class StaticBatchEngine:
    """Fixed batches of ``max_num_seqs`` requests, padded on the left, run to the longest."""

    def __init__(self, model: str = "random:gpt2", **kwargs):
        kwargs.pop("scheduling_policy", None)
        self.config = EngineConfig(model=model, scheduling_policy="static", **kwargs)
        if self.config.batch_invariant:
            raise ValueError("batch_invariant needs the continuous engine: the static baseline "
                             "pads batches and runs torch's SDPA")
        torch.manual_seed(self.config.seed)
        self.model, self.tokenizer = load_model_and_tokenizer(self.config)
        self.occupancy_trace: list[int] = []  # unfinished rows per step
        self._order = itertools.count()

    def _make_seq(self, prompt, params: SamplingParams) -> Sequence:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        n_pos = self.model.config.n_positions
        if len(ids) + params.max_tokens > n_pos:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) "
                             f"exceeds the model's n_positions ({n_pos})")
        order = next(self._order)
        seed = params.seed if params.seed is not None else self.config.seed * 7919 + order
        return Sequence(str(order), ids, params, order, seed=seed)

    @torch.inference_mode()
    def _run_batch(self, batch: list[Sequence]) -> None:
        device = self.model.device
        eos = self.model.config.eos_token_id
        L = max(s.num_prompt_tokens for s in batch)
        pad = [L - s.num_prompt_tokens for s in batch]
        ids = torch.tensor([[eos] * p + s.prompt_token_ids for p, s in zip(pad, batch)],
                           device=device)
        key_mask = torch.tensor([[False] * p + [True] * (L - p) for p in pad], device=device)
        positions = (key_mask.long().cumsum(-1) - 1).clamp(min=0)
        past: list = []
        start = time.perf_counter()
        for s in batch:
            s.first_scheduled_time = start
            s.status = SequenceStatus.RUNNING
        while True:
            logits = dense_forward(self.model, ids, positions, key_mask, past)
            sampled = sample(logits, SamplingBatch(
                [s.params.temperature for s in batch], [s.params.top_k for s in batch],
                [s.params.top_p for s in batch], [s.seed for s in batch],
                [s.num_output_tokens for s in batch]))
            logprobs = compute_logprobs(logits, sampled, [s.params.logprobs for s in batch])
            tokens = sampled.tolist()
            now = time.perf_counter()
            self.occupancy_trace.append(sum(not s.is_finished for s in batch))
            for i, (s, tok) in enumerate(zip(batch, tokens)):
                if s.is_finished:
                    continue  # a padded row: computed, thrown away
                s.token_ids.append(tok)
                if logprobs is not None and logprobs[i] is not None:
                    s.output_logprobs.append(logprobs[i])
                s.first_token_time = s.first_token_time or now
                p = s.params
                if tok in p.stop_token_ids or (not p.ignore_eos and tok == eos):
                    s.finish_reason = "stop"
                elif s.num_output_tokens >= p.max_tokens:
                    s.finish_reason = "length"
                if s.finish_reason:
                    s.status, s.finished_time = SequenceStatus.FINISHED, now
            if all(s.is_finished for s in batch):
                return
            ids = torch.tensor([[s.token_ids[-1]] for s in batch], device=device)
            positions = positions[:, -1:] + 1
            key_mask = torch.cat([key_mask, key_mask.new_ones(len(batch), 1)], dim=1)

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams],
                 progress=None) -> list[RequestOutput]:
        """Run all prompts in fixed batches, in order; ``progress(n)`` is called per batch."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self._make_seq(p, sp) for p, sp in zip(prompts, params_list)]
        size = self.config.max_num_seqs
        for i in range(0, len(seqs), size):
            self._run_batch(seqs[i:i + size])
            if progress is not None:
                progress(len(seqs[i:i + size]))
        return [request_output(s, self.tokenizer) for s in seqs]
