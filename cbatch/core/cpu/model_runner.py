"""The model runner of a CPU engine: what only a CPU does, around the one step path.

Over :class:`~cbatch.core.model_runner.ModelRunner` (the same step batch, forward and
sampler) it adds, for a CPU:

- **packing**: every linear layer's weight in its route's layout, once
  (:func:`~cbatch.core.cpu.packing.pack_linears`), the lm_head's greedy screen beside it;
- **huge pages**: the packed weights (quantized ones too), their screens and the KV pool, the
  bytes every decode step streams, on 2 MB transparent huge pages
  (:mod:`cbatch.core.cpu.memory`), and malloc keeping a step's freed activations for the next
  step;
- **the thread policy**: each step on the cores other processes leave free
  (:mod:`cbatch.core.cpu.threads`; fixed in batch-invariant mode);
- **the greedy-screen branch**: a step whose every row is greedy without logprobs takes its
  tokens from the lm_head's screen (:func:`cbatch.ops.cpu.greedy_head`) instead of the
  logits: the same tokens, bit for bit, from a half or a quarter of the lm_head's bytes.

:meth:`CPUModelRunner.describe` says which of these are live for this engine (``cbatch
serve`` prints it at start-up); :func:`cbatch.ops.cpu.kernel_paths` says which kernel paths
ran.
"""

from __future__ import annotations

import collections

import torch
from torch import nn

from cbatch.core.cpu.memory import HugePages, huge_page_zeros, keep_freed_memory, trim_heap
from cbatch.core.cpu.packing import pack_linears, place_quantized
from cbatch.core.cpu.report import isa_phrase, screen_phrase
from cbatch.core.cpu.threads import ThreadPolicy
from cbatch.core.model_runner import ModelRunner
from cbatch.core.step_outputs import PromptTargets
from cbatch.core.sampler import SamplingBatch
from cbatch.layers.kv_cache import KVCache
from cbatch.layers.linear import Linear
from cbatch.layers.quantization import QuantizedLinear
from cbatch.layers.step_batch import StepBatch
from cbatch.ops import cpu, quantized


class CPUModelRunner(ModelRunner):
    kv_cache_zeros = staticmethod(huge_page_zeros)  # the pool, zeroed page by page on use

    def __init__(self, model: nn.Module, kv_cache: KVCache, max_num_seqs: int,
                 max_num_batched_tokens: int, cuda_graphs: bool = False,
                 num_speculative_tokens: int = 0, threads: int | None = None):
        self.threads = ThreadPolicy(threads, adaptive=not model.batch_invariant)
        self.huge_pages = HugePages()
        # before the dry run of ModelRunner.__init__, so that it runs the packed kernels
        self.route = cpu.cpu_linear_route(model.dtype)
        self.packed = pack_linears(model, batch_invariant=model.batch_invariant,
                                   place=self.huge_pages.copy)
        place_quantized(model, self.huge_pages.copy)
        self.layers_phrase = model.bind_cpu_layers()  # on the packed and placed tensors
        trim_heap()  # what loading, quantizing and placing freed
        keep_freed_memory()
        super().__init__(model, kv_cache, max_num_seqs, max_num_batched_tokens, cuda_graphs,
                         num_speculative_tokens)

    @property
    def greedy_screen(self) -> cpu.GreedyScreen | None:
        """The lm_head's screen, where one runs here (else None)."""
        return getattr(self.model.lm_head, "greedy_screen", None)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` → int64 ``[N]``: the argmax of the lm_head's logits of each row, bit
        for bit, through its greedy screen (only where :attr:`greedy_screen`)."""
        head = self.model.lm_head
        return cpu.greedy_head(hidden, head.packed_weight, head.greedy_screen, head.out_features,
                               amx=cpu.may_use_amx(self.model.batch_invariant))

    def run(self, batch: StepBatch, sampling: SamplingBatch, num_logprobs: list[int | None],
            prompt: PromptTargets | None = None, rows: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None,
                       tuple[torch.Tensor, ...] | None]:
        # (a CPU runner captures no CUDA graphs: ModelRunner.logits replays none here)
        with self.threads.step():
            if (sampling.all_greedy and sampling.plain and prompt is None
                    and all(k is None for k in num_logprobs) and self.greedy_screen is not None):
                # no logits needed (speculative drafts' positions too: any rows of hidden)
                return self.greedy_tokens(self.last_hidden(batch, rows)), None, None
            return super().run(batch, sampling, num_logprobs, prompt, rows)

    def steps_by_threads(self) -> dict[int, int]:
        return dict(self.threads.steps_by_threads)

    def _quantized_phrase(self) -> str:
        """The quantized layers' schemes (``zp``: with zero points; ``mins``: with float
        minimums) and where they run
        (cbatch's kernel and its ISA, or the reference)."""
        layers = [m for m in self.model.modules() if isinstance(m, QuantizedLinear)]
        if not layers:
            return "none"
        kinds = sorted({m.scheme.describe(m.in_features)
                        + (" zp" if m.zeros is not None else "")
                        + (" mins" if m.mins is not None else "") for m in layers})
        # the kernel of the most layers says where they run (W4A16 on bf16 x: vdpbf16ps)
        kind = collections.Counter(m.kind for m in layers).most_common(1)[0][0]
        isa = quantized.isa(kind, self.model.dtype)
        where = f"cbatch {isa}" if isa else "the pure-torch reference"
        return f"{', '.join(kinds)}, {len(layers)} layers ({where})"

    def describe(self) -> dict[str, str]:
        """The CPU paths live in this engine, a phrase each: ``isa`` (what the C++ kernels
        use), ``attention`` (the step for the model's head dim), ``linear`` (the route of the
        model's dtype, and whether its weights are packed), ``greedy screen`` (int8, bf16 or
        off), ``quantized linear`` (the quantized layers and their kernel, or none), ``huge
        pages``, ``threads``."""
        screen, dtype = self.greedy_screen, str(self.model.dtype).removeprefix("torch.")
        kind = None if screen is None else "int8" if screen.scales is not None else "bf16"
        head_dim = self.model.config.head_dim
        return {
            "isa": isa_phrase(),
            "attention": f"{cpu.attention_step(head_dim, self.model.dtype) or 'torch'} "
                         f"(head dim {head_dim})",
            "linear": f"{self.route if self.packed else 'torch'} ({dtype}, "
                      f"{'packed' if self.packed else 'dense'} weights)"
            if any(isinstance(m, Linear) for m in self.model.modules())
            else "none (every linear layer is quantized)",
            "greedy screen": "none (the lm_head is quantized)"
            if isinstance(self.model.lm_head, QuantizedLinear) else screen_phrase(kind),
            "quantized linear": self._quantized_phrase(),
            "decoder layers": self.layers_phrase,
            "huge pages": "on" if self.huge_pages.enabled else "off",
            "threads": self.threads.describe(),
        }
