"""One model on one device: the model, its paged KV pool, the block manager over that pool
and the model runner of the device, built together by :func:`build_worker`.

The engine builds one for the target; the ``draft_model`` proposer
(:mod:`cbatch.core.spec_decode.draft_model`) builds one for the draft, on a pool of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cbatch.config import EngineConfig
from cbatch.core.block_manager import BlockManager
from cbatch.core.cpu.memory import HugePages
from cbatch.core.cpu.model_runner import CPUModelRunner
from cbatch.core.model_runner import ModelRunner
from cbatch.layers.kv_cache import KVCache, num_kv_blocks
from cbatch.layers.quantization import Place


@dataclass
class Worker:
    model: nn.Module
    kv_cache: KVCache
    block_manager: BlockManager
    runner: ModelRunner
    num_params: int  # the model's as loaded (before a CPU runner packs its weights)

    def summary(self) -> str:
        """What the engine's "model ready" line says of it: ``124M parameters,
        GPT2LMHeadModel; KV cache 9216 tokens``."""
        return (f"{_count(self.num_params)} parameters, {type(self.model).__name__}; "
                f"KV cache {self.kv_cache.num_tokens} tokens")

    def memory_report(self, max_model_len: int | None = None) -> str:
        """The KV pool's one line (:meth:`KVCache.memory_report`)."""
        return self.kv_cache.memory_report(max_model_len)

    def describe(self) -> dict[str, str]:
        """The runner's fast paths (a CPU runner's; empty elsewhere)."""
        return self.runner.describe()

    def stats(self) -> dict:
        """Its pool's use and its runner's counts, as
        :class:`~cbatch.core.stats.EngineStats`'s fields."""
        return dict(kv_cache_usage=self.block_manager.usage,
                    graph_capture_s=self.runner.graph_capture_s,
                    graph_memory_bytes=self.runner.graph_memory_bytes,
                    steps_by_threads=self.runner.steps_by_threads())


def weight_place(device: torch.device | str) -> Place | None:
    """Where the runner of ``device`` keeps a model's weights, for the loader to move each
    quantized layer there as it makes it (``load_model``'s ``place``): a CPU runner's huge
    pages (:class:`HugePages`); None elsewhere."""
    return HugePages().copy if torch.device(device).type == "cpu" else None


def model_runner_class(device: torch.device | str) -> type[ModelRunner]:
    """The model runner of a device: :class:`CPUModelRunner` for the CPU, else the plain one
    (CUDA graphs and the rest of a GPU's path live in :class:`ModelRunner` itself)."""
    return CPUModelRunner if torch.device(device).type == "cpu" else ModelRunner


def make_runner(model: nn.Module, kv_cache: KVCache, config: EngineConfig, max_tokens: int
                ) -> ModelRunner:
    """The runner of ``config.device`` for ``model`` on ``kv_cache`` (the CPU's also takes
    ``config.threads``), for ``config.max_num_seqs`` rows and ``max_tokens`` tokens a step,
    with CUDA graphs as ``config`` says, for steps of up to k + 1 tokens a row too when it
    speculates k."""
    runner_class = model_runner_class(config.device)
    cpu_only = dict(threads=config.threads) if runner_class is CPUModelRunner else {}
    spec = config.speculative_config
    return runner_class(model, kv_cache, config.max_num_seqs, max_tokens,
                        config.use_cuda_graphs, spec.num_speculative_tokens if spec else 0,
                        **cpu_only)


def build_worker(model: nn.Module, config: EngineConfig, max_tokens: int,
                 prefix_caching: bool = False) -> Worker:
    """``model`` (loaded on ``config.device``) made batch-invariant as ``config`` says, a KV
    pool of :func:`num_kv_blocks` blocks for it, a block manager over the pool (with prefix
    caching, salted by ``config.cache_salt``, if ``prefix_caching``) and its runner
    (:func:`make_runner`, ``max_tokens`` tokens a step)."""
    num_params = model.num_parameters()  # quantized weights counted too
    model.set_batch_invariant(config.batch_invariant)
    num_blocks = num_kv_blocks(config, model.config, model.weight_bytes())
    kv_cache = KVCache(model.config, num_blocks, config.block_size, config.torch_dtype,
                       config.device, zeros=model_runner_class(config.device).kv_cache_zeros)
    block_manager = BlockManager(num_blocks, config.block_size, prefix_caching,
                                 config.cache_salt)
    runner = make_runner(model, kv_cache, config, max_tokens)
    return Worker(model, kv_cache, block_manager, runner, num_params)


def _count(n: int) -> str:
    """124439808 -> "124M" (as a model card says it)."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)
