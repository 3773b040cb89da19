"""The paged KV cache: one allocation shared by all layers, cut into fixed-size blocks.

The pool is ``[num_layers, 2, num_blocks, block_size, H_kv, D]``; layer l reads its
``key_cache`` and ``value_cache``, each ``[num_blocks, block_size, H_kv, D]`` (token-major,
FlashInfer's "NHD"), and a token's slot is ``block_id * block_size + offset``.  A token costs
``2 * num_layers * H_kv * D * dtype_bytes`` bytes (GPT-2 small in fp16: 36 KiB)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from cbatch.config import EngineConfig
from cbatch.devices import to_device


class ModelShape(Protocol):
    """What the cache reads of a model's config (GPT2Config, LlamaConfig, ...)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int


def bytes_per_token(config: ModelShape, dtype: torch.dtype) -> int:
    """KV-cache bytes one token costs across all layers:
    ``2 * num_layers * num_kv_heads * head_dim * dtype_bytes`` (GPT-2 small in fp16: 36 KiB)."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.itemsize


_CPU_DEFAULT_KV_BYTES = 1 << 30


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of ``device``'s memory: a GPU's; on the CPU, the machine's
    available and physical memory, or the process's cgroup (v2) limit when it is lower."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    free = total
    try:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) << 10 for line in f
                        if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max" and int(limit) < total:
            total, free = int(limit), min(free, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(free, 0), total


def memory_in_use(device: torch.device, weight_bytes: int) -> int:
    """What counts against ``gpu_memory_utilization`` before the KV cache: on a GPU, all
    that torch holds there (the weights, a draft model's cache); on the CPU, the weights."""
    if device.type == "cuda":
        return max(torch.cuda.memory_reserved(device), weight_bytes)
    return weight_bytes


def num_kv_blocks(config: EngineConfig, model_config: ModelShape, weight_bytes: int = 0) -> int:
    """Blocks for the KV cache: ``num_blocks``, else ``kv_cache_memory``, else
    ``gpu_memory_utilization`` (vLLM's fraction of the device's memory, less what is in use:
    ``weight_bytes``, the model's weights), else a default.  A fraction, and the default,
    hold at most ``max_num_seqs`` full-length sequences (the default at most 1 GiB on the CPU,
    half the free memory on a GPU)."""
    if config.num_blocks is not None:
        return config.num_blocks
    per_block = bytes_per_token(model_config, config.torch_dtype) * config.block_size
    device = torch.device(config.device)
    max_len = config.max_model_len or model_config.max_model_len
    want = config.max_num_seqs * max_len // config.block_size + 1
    mem = config.kv_cache_memory
    if mem is None and config.gpu_memory_utilization is not None:
        return _blocks_of_fraction(config, device, per_block, want, weight_bytes)
    free = device_memory(device)[0] if device.type == "cuda" else None
    if isinstance(mem, float):
        if free is None:
            raise ValueError("a fractional kv_cache_memory needs a CUDA device; give bytes")
        mem = int(mem * free)
    if mem is None:
        cap = free // 2 if free is not None else _CPU_DEFAULT_KV_BYTES
        return max(1, min(want, cap // per_block))
    if mem < per_block:
        raise ValueError(f"kv_cache_memory={mem} bytes holds no block ({per_block} bytes)")
    return mem // per_block


def _blocks_of_fraction(config: EngineConfig, device: torch.device, per_block: int, want: int,
                        weight_bytes: int) -> int:
    fraction = config.gpu_memory_utilization
    free, total = device_memory(device)
    in_use = memory_in_use(device, weight_bytes)
    budget = int(fraction * total) - in_use
    if budget < per_block:
        raise ValueError(f"gpu_memory_utilization={fraction:g} leaves the KV cache no room: "
                         f"{fraction:g} of the {total / 2**30:.2f} GiB of {device.type} is "
                         f"{fraction * total / 2**30:.2f} GiB, and {in_use / 2**30:.2f} GiB are "
                         "in use (the weights); raise it")
    blocks = min(want, budget // per_block)
    if blocks * per_block > free:
        raise ValueError(f"gpu_memory_utilization={fraction:g} gives the KV cache "
                         f"{blocks * per_block / 2**30:.2f} GiB, more than the "
                         f"{free / 2**30:.2f} GiB free on {device.type} now; lower it, or "
                         "max_num_seqs or max_model_len")
    return blocks


class KVCache:
    """``data: [num_layers, 2, num_blocks, block_size, H_kv, D]``; :meth:`layer` gives one layer's
    ``key_cache, value_cache`` views, each ``[num_blocks, block_size, H, D]`` and contiguous."""

    def __init__(self, config: ModelShape, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 zeros: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None):
        """``zeros(shape, dtype)``: how a CPU pool is allocated (the engine's: on huge pages,
        :func:`cbatch.core.cpu.memory.huge_page_zeros`); default ``torch.zeros`` on
        ``device``.  A pool from ``zeros`` must be on ``device``."""
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads,
                 config.head_dim)
        if zeros is None:
            self.data = torch.zeros(shape, dtype=dtype, device=device)
        else:
            self.data = zeros(shape, dtype)
            if self.data.device.type != torch.device(device).type:
                raise ValueError(f"the KV pool's zeros gave a {self.data.device} tensor for "
                                 f"a {device} cache")
        # each layer's views made once: every layer of every step asks for them
        self._layers = [(self.data[i, 0], self.data[i, 1]) for i in range(config.num_layers)]
        # the same views as one list, key then value per layer (cbatch::decoder_layers)
        self.flat_layers = [view for pair in self._layers for view in pair]

    def touch(self) -> None:
        """Fault in every page of the pool now (it holds zeros already; this writes them
        again).  A pool from lazily zeroed pages (the CPU engine's) otherwise takes each page
        from the OS inside the step that first writes it, which under a burst of new requests
        is a cost of its own, largest in a VM whose host backs guest memory on first use
        (benchmarks/NOTES.md, "CPU memory").  A server calls this at start-up, as
        vLLM allocates its whole cache then."""
        self.data.zero_()

    @property
    def num_tokens(self) -> int:
        """Tokens the cache holds, over all sequences."""
        return self.num_blocks * self.block_size

    def memory_report(self, max_model_len: int | None = None) -> str:
        """One line: how many tokens fit (and sequences of ``max_model_len``, default the
        model's), in how many bytes, and where the bytes per token come from (grouped-query
        models keep only their KV heads)."""
        c, itemsize = self.config, self.data.dtype.itemsize
        max_model_len = max_model_len or c.max_model_len
        full = self.num_tokens // max_model_len
        return (f"KV cache: {self.num_tokens} tokens ({self.num_blocks} blocks of "
                f"{self.block_size}; {full} sequences of max_model_len {max_model_len}) in "
                f"{self.data.nbytes / 2**20:.1f} MiB: {bytes_per_token(c, self.data.dtype)} "
                f"bytes per token = 2 x {c.num_layers} layers x {c.num_kv_heads} KV heads x "
                f"head_dim {c.head_dim} x {itemsize} bytes")

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[i]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``source -> destination`` in every layer, K and V (all sources
        are read before any destination is written)."""
        src, dst = (to_device(list(ids), self.data.device) for ids in zip(*pairs))
        self.data[:, :, dst] = self.data[:, :, src]
