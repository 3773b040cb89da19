"""The engine's configuration, a validated dataclass (a model's own configuration lives beside
the model: :class:`cbatch.models.gpt2.GPT2Config`, :class:`cbatch.models.llama.LlamaConfig`).
:class:`EngineConfig` is the one place that holds the engine's defaults and checks them: the
command line derives its engine flags from its fields (:func:`engine_fields`).  No torch at
import time, so ``cbatch --help`` answers at once."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

from cbatch import devices, quantization

POLICIES = ("fcfs", "priority", "sjf")  # continuous batching; "static" is the baseline
DEFAULT_MODEL = "random:gpt2"  # LLM's, Engine's, AsyncEngine's and the CLI's
SPECULATIVE_METHODS = ("ngram", "draft_model")


# Bounds of speculative_config (vLLM has none): past a few tokens a draft is almost never
# accepted whole, and every draft position costs the verifying step a row of logits and
# /metrics a counter; an n-gram longer than this is no better a match.
MAX_SPECULATIVE_TOKENS = 32
MAX_PROMPT_LOOKUP = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, as vLLM spells it (``speculative_config={"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}``).

    ``ngram`` (prompt lookup): each decoding request drafts up to ``num_speculative_tokens``
    tokens by finding the longest suffix of its tokens, ``prompt_lookup_max`` down to
    ``prompt_lookup_min`` long, that occurred earlier in its prompt or output, and proposing
    what followed it (:mod:`cbatch.core.spec_decode`).  As vLLM: with neither lookup bound
    given both are 5; with one, the other equals it.

    ``draft_model``: ``model`` (``random:<name>``, a checkpoint directory or a hub id; its
    vocabulary must be the target's) drafts ``num_speculative_tokens`` greedy tokens per
    request on a KV cache of its own (:mod:`cbatch.core.spec_decode.draft_model`), e.g.
    ``{"method": "draft_model", "model": "random:distilgpt2", "num_speculative_tokens": 4}``
    for ``random:gpt2``.

    ``adaptive`` (cbatch's own key; vLLM has no such rule): each request's draft length follows
    its recent acceptance (:class:`cbatch.core.spec_decode.adaptive.AdaptiveDraftLength`): it
    drafts k tokens while a moving average of its accepted/drafted stays above a threshold, none
    below it (probing again every few steps), so a request whose drafts the target keeps
    rejecting decodes as it would without speculation.  Default on; ``false`` always drafts k
    (what the proposer finds).
    """

    method: str = "ngram"
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    adaptive: bool = True
    model: str | None = None  # draft_model's draft

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method must be one of "
                             f"{SPECULATIVE_METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an int in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}] (the drafts a request verifies "
                             f"per step), got {k!r}")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError("speculative_config: method draft_model needs \"model\": the "
                             "draft model (random:<name>, a checkpoint directory or a hub id) "
                             "with the target's tokenizer")
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f"speculative_config: \"model\" is the draft model of method "
                             f"draft_model, not of {self.method!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError("speculative_config: adaptive must be true or false (each "
                             f"request's draft length from its acceptance), got "
                             f"{self.adaptive!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None and (not _is_int(value)
                                      or not 1 <= value <= MAX_PROMPT_LOOKUP):
                raise ValueError(f"speculative_config: {name} must be an int in [1, "
                                 f"{MAX_PROMPT_LOOKUP}], got {value!r}")
        if lo is None and hi is None:
            lo = hi = 5
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= "
                             f"prompt_lookup_max ({hi})")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    def describe(self) -> str:
        """One line for a server's log: the method, its drafts and the rule of their length."""
        how = (f"prompt lookup {self.prompt_lookup_min}-{self.prompt_lookup_max}"
               if self.method == "ngram" else f"draft model {self.model}")
        rule = "adaptive" if self.adaptive else "fixed"
        return (f"{self.method} ({how}), up to {self.num_speculative_tokens} draft tokens a "
                f"step, {rule} draft length")

    @classmethod
    def of(cls, value) -> SpeculativeConfig | None:
        """``value`` (a SpeculativeConfig, a dict of its fields, its JSON text, or None) as
        a SpeculativeConfig; a ValueError names an unknown key."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not JSON ({e}): {value!r:.80}") \
                    from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a dict like {\"method\": \"ngram\", "
                             f"\"num_speculative_tokens\": 4}}, got {value!r:.80}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: "
                             f"{sorted(known)}")
        return cls(**value)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _knob(default, help: str, **metadata):
    """A field of :class:`EngineConfig` with the help text its command-line flag shows."""
    return field(default=default, metadata={"help": help, **metadata})


@dataclass
class EngineConfig:
    """Keywords shared by :class:`cbatch.LLM` and :class:`cbatch.Engine` (docs/design.md)."""

    model: str = _knob(DEFAULT_MODEL, "random:<size>, a local Hugging Face checkpoint "
                       "directory, or a hub id", cli=False)
    device: str = _knob("cpu", "cpu, cuda or cuda:N", cli=False)
    dtype: str = _knob("auto", "auto (bfloat16 on a CPU that computes in it, float16 on CUDA, "
                       "else float32), float32, float16 or bfloat16", cli=False)
    attention_backend: str | None = _knob(
        None, "cuda, triton, cpu or torch (default: the fastest for the device)")
    quantization: str | None = _knob(
        None, "quantize the decoder's linears at load: int8, int4 (groups of 128), w8a8, w4a8 "
        "(int8 activations too; a checkpoint's own weights so), its own (default: own or none)",
        choices=tuple(quantization.METHODS))
    block_size: int = _knob(16, "tokens per KV-cache block")
    num_blocks: int | None = _knob(None, "KV-cache blocks (default: max_num_seqs sequences of "
                                   "the longest length, at most 1 GiB on a CPU and half the "
                                   "free memory of a GPU)")
    kv_cache_memory: int | float | None = _knob(
        None, "KV-cache bytes, or a fraction of free device memory", cli=False)
    gpu_memory_utilization: float | None = _knob(None, "vLLM's: the fraction of the device's "
        "memory (the machine's on a CPU) for weights and KV cache (default: see num-blocks)")
    max_model_len: int | None = _knob(None, "the longest prompt + output, in tokens (default: "
                                      "the model's context length)")
    max_num_seqs: int = _knob(64, "most sequences in one step")
    max_num_batched_tokens: int = _knob(2048, "most new tokens in one step (longer prompts "
                                        "are prefilled in chunks)")
    scheduling_policy: str = _knob("fcfs", "fcfs, priority or sjf (static: the "
                                   "static-batching baseline)", choices=POLICIES + ("static",))
    seed: int = _knob(0, "seed of random weights and of requests without their own seed")
    tokenizer: str | None = _knob(None, "a tokenizer directory or hub id (default: the "
                                  "model's own)", cli=False)
    cuda_graphs: bool | None = _knob(None, "decode steps, and steps verifying drafts, replay "
                                     "CUDA graphs (default: on for CUDA)")
    async_scheduling: bool | None = _knob(None, "schedule and launch step n+1 before step "
                                          "n's tokens are read (default: on for CUDA)")
    enable_prefix_caching: bool = _knob(True, "requests share the KV blocks of common "
                                        "prefixes")
    batch_invariant: bool = _knob(False, "a request's output never depends on what it is "
                                  "batched with")
    threads: int | None = _knob(None, "CPU threads per step (default: the cores this process "
                                "may run on, fewer while other processes take them)")
    max_logprobs: int = _knob(20, "the most logprobs a request may ask for (vLLM's default; "
                              "-1: the whole vocabulary)")
    max_prompt_logprobs: int = _knob(20, "the most prompt_logprobs a request may ask for (-1: "
                                     "the whole vocabulary); a request's prompt logprobs, "
                                     "(k + 1) x prompt tokens x n, are bounded too")
    speculative_config: dict | SpeculativeConfig | None = _knob(
        None, "speculative decoding as JSON, vLLM's keys: {\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 4} "
        "or {\"method\": \"draft_model\", \"model\": \"random:distilgpt2\", "
        "\"num_speculative_tokens\": 4} (default: off)")
    grammar_compile_workers: int = _knob(
        2, "processes that compile structured-output grammars, one core each at most (one "
        "pool per process: the largest of its engines' settings)")
    grammar_compile_timeout: float = _knob(
        10.0, "seconds a structured-output grammar may take to parse and compile, its wait "
        "for a worker included; a request whose grammar takes longer is refused (its compile "
        "is stopped)")
    max_grammar_bytes: int = _knob(
        32 << 20, "the most memory a compiled structured-output grammar (its token masks) may "
        "take; a request whose grammar takes more is refused")
    grammar_cache_bytes: int = _knob(
        512 << 20, "memory kept for compiled grammars, to reuse for requests with the same "
        "constraint (least recently used dropped first)")

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, str):
            self.dtype = str(self.dtype).removeprefix("torch.")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError("dtype must be float32, float16, bfloat16 or auto, got "
                             f"{self.dtype!r}")
        self.device = devices.check_device(self.device)
        quantization.get(self.quantization)
        if self.dtype == "auto":
            self.dtype = devices.auto_dtype(self.device)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        for name in ("max_logprobs", "max_prompt_logprobs"):
            value = getattr(self, name)
            if not _is_int(value) or value < -1:
                raise ValueError(f"{name} must be an int >= 0, or -1 for the whole "
                                 f"vocabulary, got {value!r}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        mem = self.kv_cache_memory
        if mem is not None and (mem <= 0 or (isinstance(mem, float) and mem > 1)):
            raise ValueError("kv_cache_memory must be a byte count or a fraction in (0, 1], "
                             f"got {mem}")
        util = self.gpu_memory_utilization
        if util is not None and not (type(util) in (int, float) and 0 < util <= 1):
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {util!r}")
        if self.scheduling_policy not in POLICIES + ("static",):
            raise ValueError(f"scheduling_policy must be one of {POLICIES + ('static',)}, got "
                             f"{self.scheduling_policy!r}")
        self.speculative_config = SpeculativeConfig.of(self.speculative_config)
        if self.speculative_config is not None and self.async_scheduling:
            raise ValueError("async_scheduling=True cannot run with speculative_config: a "
                             "speculative engine reads each step's accepted tokens before "
                             "it drafts and schedules the next; leave async_scheduling unset")
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str)
                                           or not self.tokenizer):
            raise ValueError("tokenizer must be a directory or hub id (a non-empty string), "
                             f"got {self.tokenizer!r}")
        for name, low in (("grammar_compile_workers", 1), ("max_grammar_bytes", 1),
                          ("grammar_cache_bytes", 0)):
            if not _is_int(getattr(self, name)) or getattr(self, name) < low:
                raise ValueError(f"{name} must be an int >= {low}, got {getattr(self, name)!r}")
        timeout = self.grammar_compile_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
                0 < timeout < float("inf")):
            raise ValueError(f"grammar_compile_timeout must be a finite number of seconds "
                             f"> 0, got {timeout!r}")

    @classmethod
    def for_model(cls, model, **kwargs) -> EngineConfig:
        """The config of an engine around an already built model: its device, dtype,
        attention backend and batch-invariant switch come from the model."""
        for name in ("device", "dtype", "attention_backend", "quantization"):
            if name in kwargs:
                raise ValueError(f"{name} comes from the model given to the engine; got {name}=")
        kwargs.setdefault("batch_invariant", model.batch_invariant)
        return cls(model="<model object>", device=str(model.device),
                   dtype=str(model.dtype).removeprefix("torch."),
                   attention_backend=model.attention_backend, **kwargs)

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def use_cuda_graphs(self) -> bool:
        """``cuda_graphs`` with None decided: on for CUDA."""
        return self.on_cuda if self.cuda_graphs is None else self.cuda_graphs

    @property
    def use_async_scheduling(self) -> bool:
        """``async_scheduling`` with None decided: on for CUDA unless speculating (a
        speculative engine resolves each step before it launches the next)."""
        if self.async_scheduling is None:
            return self.on_cuda and self.speculative_config is None
        return self.async_scheduling

    @property
    def cache_salt(self) -> str:
        """What decides the K/V of a token sequence besides its tokens: the weights (a random
        model's depend on the seed) and the dtype.  Prefix-cache hashes start from it."""
        weights = f"{self.model}@seed={self.seed}" if self.model.startswith("random:") \
            else self.model
        return "|".join([weights, self.dtype] + ([self.quantization] if self.quantization else []))


def engine_fields(cli_only: bool = True) -> list:
    """The fields of :class:`EngineConfig` (those with a command-line flag when ``cli_only``),
    each with ``.default`` and ``.metadata["help"]``."""
    return [f for f in fields(EngineConfig) if not cli_only or f.metadata.get("cli", True)]
