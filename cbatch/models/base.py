"""What every model over the step batch shares: the bound attention kernels, the
batch-invariant switch, the logits, and the device and dtype the engine reads."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from cbatch import ops
from cbatch.layers.attention import PagedAttention
from cbatch.layers.linear import Linear
from cbatch.layers.quantization import QuantizedLinear


class PagedCausalLM(nn.Module):
    """Base of the causal LMs: a subclass builds its layers and ``self.lm_head`` (a
    :class:`Linear`) and defines ``forward(batch, kv_cache) -> [T, hidden]``."""

    def __init__(self, config, attention_backend: str | None = None):
        super().__init__()
        self.config = config
        self.attention_backend = attention_backend
        self._kernels: tuple[torch.device, ops.BoundKernels] | None = None
        self.batch_invariant = False  # see set_batch_invariant
        # a Llama-family model's layers bound for one C++ call a step on the CPU, or why not
        # (bind_cpu_layers; a CPU model runner binds them once the weights are packed)
        self.cpu_layers = None

    def kernels(self, device: torch.device) -> ops.BoundKernels:
        """The attention kernels for ``device``, resolved once (``attention_backend``, else
        ``$CBATCH_ATTENTION_BACKEND``, else the fastest available), not at every op call."""
        if self._kernels is None or self._kernels[0] != device:
            self._kernels = device, ops.bind_kernels(device, self.config.head_dim,
                                                     self.attention_backend)
        return self._kernels[1]

    def set_batch_invariant(self, enabled: bool) -> None:
        """Batch-invariant mode: each token's hidden states and logits are bitwise the same
        whatever else is in the step (:func:`cbatch.layers.linear.batch_invariant_linear` for
        the linear layers, :meth:`PagedAttention.kernel_for` for attention; norms,
        activations and rotary embeddings work row by row already)."""
        self.batch_invariant = enabled
        self.cpu_layers = None  # bound for the other mode: bind again
        for module in self.modules():
            if isinstance(module, (Linear, PagedAttention)):
                module.batch_invariant = enabled

    def bind_cpu_layers(self) -> str:
        """Bind the layers for one C++ call a step (only the Llama family has one); a
        phrase saying whether they were."""
        return "op by op (no one-call path for this architecture)"

    def num_parameters(self) -> int:
        """The model's weights and biases; a quantized layer's weight counts its N x K values
        (it is held in buffers, not parameters)."""
        quantized = sum(m.in_features * m.out_features for m in self.modules()
                        if isinstance(m, QuantizedLinear))
        return sum(p.numel() for p in self.parameters()) + quantized

    def weight_bytes(self) -> int:
        """The bytes of the model's parameters and buffers (packed, quantized: as held)."""
        return sum(t.numel() * t.element_size()
                   for t in itertools.chain(self.parameters(), self.buffers()))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` hidden states → ``[N, vocab_size]`` logits."""
        return self.lm_head(hidden)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype: the first parameter's (a quantized lm_head has no float
        weight; the norms are in the model's dtype)."""
        return next(self.parameters()).dtype
