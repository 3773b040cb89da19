"""The quantized linear's kernels, behind one dispatch: cbatch's C++ kernels on the CPU
(``csrc/cpu/quantized_linear*.cpp``), the Triton GEMMs on CUDA (``kernels/quant_matmul.py``,
the custom ops ``torch.ops.cbatch_triton.*``), else the pure-torch reference
(:mod:`cbatch.ops.reference`), which also defines them.

A kind (:attr:`cbatch.quantization.Scheme.kind`) names the arithmetic:

- ``"w8a16"``, ``"w4a16"``: int8 / int4 weights dequantized in registers, x as it is
  (``cbatch::quantized_linear``; Triton ``quantized_linear``);
- ``"w8a8"``: x to int8 per token, int8 x int8 sums in int32 (``cbatch::quantized_linear_w8a8``;
  Triton ``scaled_int8_quant`` then ``w8a8_linear``);
- ``"w4a8"``: x to int8 per token and per group, int4 x int8 sums in int32 per group
  (``cbatch::quantized_linear_w4a8``; CPU only);
- ``"w8a8g"``: W8A8 per group, int8 weights in groups and x as W4A8's, int8 x int8 sums in
  int32 per group (the same op on an int8 qweight; CPU only, AVX512-VNNI or AVX2).

:func:`available` and :func:`isa` say whether and how the C++ kernel of a kind runs here (the
tests assert through them, and through :func:`cbatch.ops.cpu.kernel_paths`, that it ran);
:func:`amx_int8_tiles` whether the int8-activation kinds take AMX tiles.
:class:`cbatch.layers.quantization.QuantizedLinear` decides nothing: it calls :func:`linear`.
"""

from __future__ import annotations

import functools

import torch

from cbatch.ops import compiled, reference
from cbatch.ops.backends import triton_available
from cbatch.ops.checks import check_no_meta_mix
from cbatch.ops.cpu import cpu_isa

KINDS = ("w8a16", "w4a16", "w8a8", "w4a8", "w8a8g")
GROUPED_A8 = ("w4a8", "w8a8g")  # x int8 per group: cbatch::quantized_linear_w4a8, CPU only


@functools.cache
def _cpu_kernels() -> bool:
    """Whether cbatch's quantized CPU kernels were built and run on this CPU (x86 with AVX2
    and FMA, or AVX-512).  Asked once: no ISA cap changes the answer."""
    return "cpu" in compiled.compiled_backends() and \
        torch.ops.cbatch.quantized_linear_supported()


def available(kind: str) -> bool:
    """Whether cbatch's C++ CPU kernel of ``kind`` runs here (W4A8's and W8A8 per group's
    need AVX2, which ``$CBATCH_CPU_ISA`` may cap); elsewhere that kind runs the pure-torch
    reference."""
    if kind in GROUPED_A8:
        return _cpu_kernels() and "avx2" in cpu_isa().split()
    return _cpu_kernels()


def isa(kind: str, dtype: torch.dtype = torch.float32) -> str:
    """The path ``kind``'s CPU kernel takes here now for an x of ``dtype`` (after
    ``$CBATCH_CPU_ISA``'s cap), or "" where it does not run: W8A16 / W4A16 ``"avx512"`` or
    ``"avx2"`` (``"avx512bf16"``: W4A16 on a bf16 x, ``vdpbf16ps``); W8A8 / W4A8
    ``"avx512vnni"`` (``vpdpbusd``) or ``"avx2"`` (``vpmaddubsw``), and calls
    of 8 rows and more may take AMX-INT8 tiles instead (:func:`amx_int8_tiles`); W8A8 per
    group ``"avx512vnni"`` (``vpdpbusd``) or ``"avx2"`` (``vpsignb``, ``vpmaddubsw``), never
    AMX tiles."""
    if not available(kind):
        return ""
    features = cpu_isa().split()
    if kind in ("w8a8", "w4a8", "w8a8g"):
        return "avx512vnni" if "avx512vnni" in features else "avx2"
    if kind == "w4a16" and dtype == torch.bfloat16 and "avx512bf16" in features:
        return "avx512bf16"
    return "avx512" if "avx512" in features else "avx2"


def amx_int8_tiles() -> bool:
    """Whether the W8A8 and W4A8 kernels run calls of 8 rows and more on AMX-INT8 tiles here
    now (``tdpbsud``; K whole tiles of 64 k, W4A8's groups multiples of 64 k; the same
    integers and output bits as the VNNI path): on a CPU with AMX-INT8 and AVX512-VNNI,
    unless ``set_cpu_options`` turned AMX off."""
    return _cpu_kernels() and "amx-int8" in cpu_isa().split()


def on_triton(x: torch.Tensor) -> bool:
    """Whether the Triton GEMMs run for ``x``: CUDA tensors, where triton is installed (tests
    point this at CPU tensors under Triton's interpreter)."""
    return x.device.type == "cuda" and triton_available()


def linear(x: torch.Tensor, kind: str, qweight: torch.Tensor, scales: torch.Tensor,
           zeros: torch.Tensor | None, group_size: int, out_features: int,
           bias: torch.Tensor | None, mins: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for a weight packed for ``kind``
    (:mod:`cbatch.layers.quantization.weight`: ``pack``; ``pack_w8a8``; ``pack_w4a8``;
    ``pack_w8a8g``): the
    Triton GEMMs where :func:`on_triton`, cbatch's CPU kernel where :func:`available`, else
    the reference.

    x: ``[M, K]`` fp32 or bf16 (fp16 too on CUDA); scales: fp32 ``[G, N16]``; zeros: int8
    ``[G, N16]`` or None; bias: ``[N]`` or None; mins: fp32 ``[G, N16]`` or None (``W = scales
    * q - mins``, zeros None; not W8A8's) → ``[M, N = out_features]`` in x's dtype.
    ``group_size`` and ``zeros`` are unused by W8A8 (symmetric, one group per column)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if on_triton(x) and kind not in GROUPED_A8:
        return triton_linear(x, kind, qweight, scales, zeros, group_size, out_features, bias,
                             mins)
    cpu = x.is_cpu and available(kind)
    if kind == "w8a8":
        if mins is not None:
            raise ValueError("W8A8 takes symmetric int8 weights: no mins")
        op = torch.ops.cbatch.quantized_linear_w8a8 if cpu else reference.quantized_linear_w8a8
        return op(x, qweight, scales, out_features, bias)
    if kind in GROUPED_A8:  # the qweight's dtype tells the kernel its bits
        op = torch.ops.cbatch.quantized_linear_w4a8 if cpu else reference.quantized_linear_w4a8
        return op(x, qweight, scales, group_size, out_features, bias, zeros, mins)
    op = torch.ops.cbatch.quantized_linear if cpu else reference.quantized_linear
    return op(x, qweight, scales, zeros, 4 if kind == "w4a16" else 8, group_size,
              out_features, bias, mins)


def triton_linear(x: torch.Tensor, kind: str, qweight: torch.Tensor, scales: torch.Tensor,
                  zeros: torch.Tensor | None, group_size: int, out_features: int,
                  bias: torch.Tensor | None, mins: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`linear` in Triton (``kernels/quant_matmul.py``), for ``kind`` W8A16, W4A16
    (``torch.ops.cbatch_triton.quantized_linear``, dequantizing in registers) or W8A8 (x
    quantized per token by ``torch.ops.cbatch_triton.scaled_int8_quant``, then
    ``torch.ops.cbatch_triton.w8a8_linear``); x ``[M, K]`` contiguous."""
    from cbatch.ops import triton as triton_ops  # (importing triton is slow: on first use)

    if kind == "w8a8":
        if mins is not None:
            raise ValueError("W8A8 takes symmetric int8 weights: no mins")
        x_q, x_scale = triton_ops.scaled_int8_quant(x)
        return triton_ops.w8a8_linear(x_q, x_scale, qweight, scales, out_features, bias,
                                      x.dtype)
    if kind in GROUPED_A8:
        raise ValueError(f"{kind.upper()} has no Triton kernel (it runs on the CPU)")
    return triton_ops.quantized_linear(x, qweight, scales, zeros, 4 if kind == "w4a16" else 8,
                                       group_size, out_features, bias, mins)


if "cpu" in compiled.compiled_backends():  # shapes for torch.compile and the meta device

    @torch.library.register_fake("cbatch::quantized_linear")
    def _(x, qweight, scales, zeros, bits, group_size, out_features, bias, mins=None):
        check_no_meta_mix("cbatch::quantized_linear", x=x, qweight=qweight, scales=scales,
                          zeros=zeros, bias=bias, mins=mins)
        return x.new_empty((x.shape[0], out_features))

    @torch.library.register_fake("cbatch::quantized_linear_w8a8")
    def _(x, qweight, scales, out_features, bias):
        check_no_meta_mix("cbatch::quantized_linear_w8a8", x=x, qweight=qweight,
                          scales=scales, bias=bias)
        return x.new_empty((x.shape[0], out_features))

    @torch.library.register_fake("cbatch::quantized_linear_w4a8")
    def _(x, qweight, scales, group_size, out_features, bias, zeros=None, mins=None):
        check_no_meta_mix("cbatch::quantized_linear_w4a8", x=x, qweight=qweight,
                          scales=scales, bias=bias, zeros=zeros, mins=mins)
        return x.new_empty((x.shape[0], out_features))
