"""What each ``quantization=`` method is: one record per method, read by every check and rule
on the way from ``--quantization`` to the kernel (vLLM keeps this in a ``QuantizationConfig``
per method).  No torch at import time: the command line's flags come from :data:`METHODS`.

A :class:`Scheme` says how one linear layer runs: ``bits`` of its weight, its ``group_size``
(k per scale; None: one scale per output channel) and ``act_bits`` (None: x as it is; 8: x
quantized to int8 at every call).  Its :attr:`~Scheme.kind` names the kernel that runs it
(``cbatch.ops.quantized``): ``"w8a16"`` / ``"w4a16"`` dequantize in registers, ``"w8a8"`` and
``"w4a8"`` sum int8 x int8 / int4 x int8 products in int32, and ``"w8a8g"`` (W8A8 per group:
int8 weights in groups, x int8 per token and group as W4A8's; llama.cpp's Q8_0 route) too.

A :class:`QuantizationMethod` is either *online* (it quantizes a float checkpoint's decoder
linears at load into its ``scheme``; ``head``: the lm_head's scheme where it is quantized
too) or a *checkpoint* format (GPTQ, AWQ, compressed-tensors, GGUF: the layers' schemes are
read from the file by ``cbatch.models.quantized_checkpoint``).  An online method with
``runs_checkpoints`` may also be asked for on a quantized checkpoint: its kernel then runs the
checkpoint's own weights, x quantized to int8 (as vLLM's ``gptq_marlin`` runs a ``gptq``
checkpoint), where :meth:`Scheme.refusal` accepts them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Scheme:
    """How one quantized linear layer runs (see the module docstring)."""

    bits: int
    group_size: int | None = None  # None: one group per output channel
    act_bits: int | None = None  # None: x as it is; 8: int8 per token (and group, for int4)

    def __post_init__(self) -> None:
        if self.bits not in (4, 8) or self.act_bits not in (None, 8):
            raise ValueError(f"a quantized layer's bits must be 4 or 8 and its act_bits None or "
                             f"8, got bits={self.bits!r}, act_bits={self.act_bits!r}")

    @classmethod
    def of(cls, bits: int, group_size: int, act_bits: int | None, in_features: int) -> Scheme:
        """The scheme of a weight of ``in_features`` k in groups of ``group_size``: an int8
        group as long as the row is one per output channel (None), as W8A8's kernel takes it."""
        per_channel = bits == 8 and group_size >= in_features
        return cls(bits, None if per_channel else group_size, act_bits)

    @property
    def kind(self) -> str:
        """The kernel's name: ``w{bits}a{act_bits or 16}``, and ``w8a8g`` for int8 weights in
        groups with int8 activations."""
        if self.bits == 8 and self.act_bits and self.group_size is not None:
            return "w8a8g"
        return f"w{self.bits}a{self.act_bits or 16}"

    @property
    def requirement(self) -> str:
        """What this scheme's kernel takes of a weight, a phrase."""
        if self.act_bits is None:
            return f"int{self.bits} weights"
        if self.bits == 4:
            return "int4 in groups of a multiple of 32 k, with zero points or without"
        return "symmetric int8 with one scale per output channel" if self.group_size is None \
            else "int8 in groups of a multiple of 16 k"

    def refusal(self, in_features: int, zero_points: bool) -> str | None:
        """Why this scheme's kernel cannot run a weight of ``in_features`` k in these groups
        (``zero_points``: asymmetric), or None (:attr:`requirement`)."""
        if self.act_bits is None:
            return None
        per_channel = self.group_size is None or self.group_size >= in_features
        if self.bits == 8:
            bad = zero_points if per_channel else self.group_size % 16
        else:
            bad = (in_features if per_channel else self.group_size) % 32
        return f"{self.kind.upper()} takes {self.requirement}" if bad else None

    def describe(self, in_features: int | None = None) -> str:
        """``int4 g128``, ``w8a8``, ``w4a8 g32``, ``w8a8 g32``: the phrase an engine's
        description uses (int4's groups always named; int8's where they are not the whole
        row)."""
        name = f"w{self.bits}a8" if self.act_bits else f"int{self.bits}"
        per_channel = self.group_size is None or (self.bits == 8 and in_features is not None
                                                  and self.group_size >= in_features)
        return name if per_channel else f"{name} g{self.group_size}"


@dataclass(frozen=True)
class QuantizationMethod:
    """One ``quantization=`` name and everything cbatch does with it."""

    name: str
    summary: str  # one phrase: what it does to weights and activations
    scheme: Scheme | None = None  # online: what each decoder linear becomes
    head: Scheme | None = None  # online: the lm_head's, where it is quantized too
    runs_checkpoints: bool = False  # online: may run a quantized checkpoint's own weights
    devices: tuple[str, ...] = ("cpu", "cuda")
    # activation dtypes on each device (CUDA's Triton GEMMs take float16 too)
    dtypes: tuple[tuple[str, tuple[str, ...]], ...] = (
        ("cpu", ("float32", "bfloat16")), ("cuda", ("float32", "bfloat16", "float16")))

    @property
    def online(self) -> bool:
        return self.scheme is not None

    def check_run(self, device: str, dtype: str) -> None:
        """A ValueError unless this method's layers run on ``device`` (a torch device's type:
        ``"cpu"``, ``"cuda"``) in activations of ``dtype`` (``"bfloat16"``, ...)."""
        if device not in self.devices:
            others = [m.name for m in METHODS.values() if m.online and device in m.devices]
            name = {"cuda": "CUDA"}.get(device, device)
            where = "on the CPU and on CUDA (Triton)" if "cuda" in self.devices else \
                f"on the CPU only (there is no {name} kernel for it)"
            raise ValueError(f"quantization={self.name!r} runs {where}; on {name} choose "
                             f"{', '.join(others[:-1])} or {others[-1]}" if others else
                             f"quantization={self.name!r} runs {where}, not on {device}")
        runs = dict(self.dtypes)[device]
        if dtype not in runs:
            each = "; ".join(f"{', '.join(names)} on {where}" for where, names in self.dtypes
                             if where in self.devices)
            raise ValueError(f"quantization={self.name!r} runs activations of {each}: not "
                             f"{dtype} on {device}")


METHODS: dict[str, QuantizationMethod] = {m.name: m for m in (
    QuantizationMethod("int8", "int8 weights per output channel, symmetric; x as it is",
                       Scheme(8)),
    QuantizationMethod("int4", "int4 weights in groups of 128 k, symmetric; x as it is",
                       Scheme(4, 128)),
    QuantizationMethod("w8a8", "int8 weights per output channel and x int8 per token (vLLM "
                       "has no online name for it)", Scheme(8, None, 8), runs_checkpoints=True),
    QuantizationMethod("w4a8", "int4 weights in groups of 128 k and x int8 per token and "
                       "group (llama.cpp's Q4_0 x Q8_0 route); the lm_head int8 (W8A8)",
                       Scheme(4, 128, 8), head=Scheme(8, None, 8), runs_checkpoints=True,
                       devices=("cpu",)),
    QuantizationMethod("gptq", "a GPTQ checkpoint's own int4/int8 weights"),
    QuantizationMethod("awq", "an AWQ checkpoint's own int4 weights"),
    QuantizationMethod("compressed-tensors", "a compressed-tensors checkpoint's own int4/int8 "
                       "weights (W4A16, W8A16, W8A8)"),
    QuantizationMethod("gguf", "a GGUF file's own block types (llama.cpp's Q4_K, Q6_K, Q8_0, "
                       "...), each run exactly by cbatch's quantized kernels on the CPU with "
                       "float activations (unset, every layer takes int8 ones per group, as "
                       "llama.cpp runs them); dequantized to float on other devices"),
)}
ONLINE = tuple(n for n, m in METHODS.items() if m.online)
CHECKPOINT = tuple(n for n, m in METHODS.items() if not m.online)


def get(method: str | QuantizationMethod | None) -> QuantizationMethod | None:
    """The record of ``method`` (a name; a record passes as it is; None: no quantization); a
    ValueError that names an unknown one.  The one check of a method's name."""
    if method is None or isinstance(method, QuantizationMethod):
        return method
    if method not in METHODS:
        raise ValueError(f"quantization={method!r} is not supported; cbatch runs "
                         f"{', '.join(ONLINE)} (online) and a checkpoint's own "
                         f"{', '.join(CHECKPOINT)}")
    return METHODS[method]


def for_checkpoint(requested: QuantizationMethod | None, found: str | None, where: str
                   ) -> QuantizationMethod | None:
    """Which online method's kernel runs a checkpoint's weights: ``requested`` is what the
    user asked for, ``found`` the checkpoint's own method (None: a float checkpoint).  None:
    the layers as the checkpoint says (or no quantization).  A ValueError, naming ``where``
    (the checkpoint's config file), when the two contradict."""
    if found is None:
        if requested is not None and not requested.online:
            raise ValueError(f"{where} has no quantization_config: it is no {requested.name} "
                             f"checkpoint (quantization={requested.name!r})")
        return None
    if requested is None or requested.name == found:
        return None
    if requested.runs_checkpoints:
        return requested
    kernels = [m.name for m in METHODS.values() if m.runs_checkpoints]
    raise ValueError(f"{where}: the checkpoint is quantized by {found} (its "
                     f"quantization_config), which quantization={requested.name!r} "
                     "contradicts; leave quantization unset to load it (or choose "
                     f"{' or '.join(kernels)}: its weights, int8 activations)")
