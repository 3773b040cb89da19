"""The CPU-only ops: linear layers on weights packed once, the lm_head's greedy screen, argmax,
and what the C++ CPU kernels report about themselves.

Linear routes (:data:`ROUTES`; why each, measured per shape and row count, in
benchmarks/NOTES.md, "CPU GEMM routes", with ``benchmarks/bench_linear.py``):

- ``"cbatch"``: cbatch's own kernel (``csrc/cpu/linear.cpp`` over the tiles of
  ``csrc/cpu/gemm.h``) on x86 CPUs with AVX-512 or with AVX2 and FMA: fp32, and bf16 with
  ``vdpbf16ps`` where the CPU has AVX512-BF16 or, on CPUs without AVX-512, widened to fp32
  in registers (each sum fp32, one fma per k, rounded to bf16 once after the epilogue; an
  AVX-512 CPU without AVX512-BF16 keeps oneDNN for bf16, not measured against it).  The
  weight is packed into blocks of 16 output columns, each ``[K, 16]`` (bf16: pairs of k side
  by side, the operand of ``vdpbf16ps``), streamed once per call; bias, GELU (tanh) and the
  residual add run in the epilogue.  Few-row GEMMs (decode steps) are memory-bound, and
  there it beats oneDNN (no per-call primitive set-up); it also runs long prefill chunks and
  the lm_head (bf16 on AVX2 too: oneDNN has no bf16 there, and ``F.linear``'s is several
  times slower at every row count).
- ``"onednn"``: ``torch.ops.mkldnn._linear_pointwise`` on a weight reordered once into
  oneDNN's blocked layout (the route of vLLM's and IPEX's CPU backends).  torch's fp32
  ``F.linear`` runs MKL's sgemm, which on a CPU that is not Intel's takes its AVX2 path even
  where the CPU has AVX-512.
- ``"torch"``: ``F.linear`` on the dense weight (CPUs without AVX2).

``$CBATCH_CPU_LINEAR`` (one of :data:`ROUTES`) overrides the choice.  Results differ from
``F.linear``'s only in summation order.

A greedy step needs only each row's argmax of the lm_head, a large share of the bytes a
decode step reads.  :func:`pack_screen` makes a :class:`GreedyScreen`, a smaller copy of the
lm_head's weight: int8 with a scale per column (fp32 and bf16 lm_heads, wherever cbatch's
kernel runs them), or, asked for, a bf16 copy of an fp32 lm_head; :func:`greedy_head`
screens every column on it, then computes the few it cannot rule out as the kernel does: the
argmax of the kernel's logits, bit for bit, from a half or a quarter of the bytes (the bound
that makes it exact is in ``csrc/cpu/greedy_head.cpp``).
``$CBATCH_GREEDY_SCREEN=0`` turns it off.

:func:`kernel_paths` says which path of each C++ CPU kernel ran how often (the tests assert
through it that a fast path ran), :func:`cpu_isa` which ISA the kernels use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cbatch import envs
from cbatch.ops import compiled
from cbatch.ops.checks import check_no_meta_mix

ROUTES = ("cbatch", "onednn", "torch")
BLOCK = 16  # output columns per block of the "cbatch" layout


def _onednn_available(dtype: torch.dtype) -> bool:
    # x86 with AVX2 or AVX-512: where it was measured against F.linear (benchmarks/NOTES.md,
    # "CPU GEMM routes" and "cbatch's kernel on AVX2").
    if not torch.backends.mkldnn.is_available() or not torch.cpu._is_avx2_supported():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


def load_kernels(t: torch.Tensor) -> bool:
    """Whether cbatch's C++ load-time passes take ``t`` (a CPU tensor, the extension built):
    GGUF blocks unpacked (csrc/cpu/gguf_blocks.cpp) and quantized weights packed
    (quantized_pack.cpp), each bitwise the torch code that documents it."""
    return t.device.type == "cpu" and "cpu" in compiled.compiled_backends()


def route_available(route: str, dtype: torch.dtype) -> bool:
    """Whether ``route`` runs ``dtype`` on this CPU with this build."""
    if route == "cbatch":
        return "cpu" in compiled.compiled_backends() and \
            torch.ops.cbatch.cpu_linear_supported(dtype)
    if route == "onednn":
        return _onednn_available(dtype)
    return route == "torch"


def cpu_linear_route(dtype: torch.dtype) -> str:
    """The route (one of :data:`ROUTES`) for ``dtype`` on this CPU: the first available of
    ``"cbatch"``, ``"onednn"``, ``"torch"``, unless ``$CBATCH_CPU_LINEAR`` names one."""
    forced = envs.CBATCH_CPU_LINEAR
    if forced:
        if not route_available(forced, dtype):
            raise ValueError(f"CBATCH_CPU_LINEAR={forced} does not run {dtype} on this CPU")
        return forced
    return next(r for r in ROUTES if route_available(r, dtype))


def pack(weight: torch.Tensor, route: str) -> torch.Tensor:
    """A dense ``[N, K]`` weight in ``route``'s layout: ``"onednn"``: an opaque mkldnn
    tensor; ``"cbatch"``: ``[ceil(N / 16), K, 16]`` (bf16 and int8: element ``[b, k, j]`` of
    ``[b, K / 2, 16, 2]`` order, i.e. pairs of k per column), zero past column N."""
    w = weight.detach().contiguous()
    if route == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(w)
    if route != "cbatch":
        raise ValueError(f"no packed layout for route {route!r}")
    N, K = w.shape
    blocks = -(-N // BLOCK)
    w = F.pad(w, (0, 0, 0, blocks * BLOCK - N))
    if w.dtype in (torch.bfloat16, torch.int8):
        return w.view(blocks, BLOCK, K // 2, 2).permute(0, 2, 1, 3).reshape(blocks, K, BLOCK)
    return w.view(blocks, BLOCK, K).permute(0, 2, 1).contiguous()


def is_packed(weight: torch.Tensor) -> bool:
    return weight.is_mkldnn or weight.dim() == 3


def unpack(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The dense ``[N, K]`` weight back from :func:`pack`'s result (bitwise)."""
    if packed.is_mkldnn:
        return packed.to_dense()
    blocks, K, _ = packed.shape
    if packed.dtype in (torch.bfloat16, torch.int8):
        dense = packed.view(blocks, K // 2, BLOCK, 2).permute(0, 2, 1, 3)
    else:
        dense = packed.permute(0, 2, 1)
    return dense.reshape(blocks * BLOCK, K)[:out_features].contiguous()


def packed_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the dense weight that :func:`pack` put in the ``"cbatch"`` layout,
    bitwise, read where they lie (a tied embedding's lookup from its lm_head's packed weight).

    packed: ``[ceil(N / 16), K, 16]``; ids: ``[T]`` integers below N → ``[T, K]``.
    """
    blocks, K, _ = packed.shape
    block, column = ids // BLOCK, ids % BLOCK
    pairs = {torch.bfloat16: torch.int32, torch.int8: torch.int16}.get(packed.dtype)
    if pairs is None:
        return packed[block, :, column]
    # a pair of k as one element twice as wide: a gather of whole elements (5-10x faster
    # than gathering [T, K / 2, 2] from the 4-d view)
    wide = packed.view(blocks, K // 2, BLOCK, 2).view(pairs).view(blocks, K // 2, BLOCK)
    return wide[block, :, column].view(packed.dtype)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int, gelu: str | None = None,
                  residual: torch.Tensor | None = None, amx: bool = False) -> torch.Tensor:
    """``residual + gelu(x @ W.T + bias)`` on a packed weight, the GELU and the add inside
    the matmul where the route has them.

    x: ``[M, K]``; packed: from :func:`pack` of ``W [N = out_features, K]``; bias: ``[N]``
    or None; gelu: None or ``F.gelu``'s ``approximate`` (``"tanh"``, ``"none"``); residual:
    ``[M, N]`` or None (not with ``gelu``) → a new ``[M, N]``.  On the ``"cbatch"`` layout a
    row's result never depends on the other rows (the kernel sums each output in k order),
    unless ``amx``: then a bf16 x of many rows runs on AMX tiles where the CPU has them
    (``csrc/cpu/amx_bf16_linear.h``; several times faster, the sums in another order), so a
    row's last bits follow the number of rows (not for batch-invariant engines).
    """
    if not packed.is_mkldnn:
        fused = gelu in (None, "tanh")
        y = torch.ops.cbatch.linear(x if x.stride(-1) == 1 else x.contiguous(), packed,
                                    out_features, bias, residual,
                                    "gelu_tanh" if gelu and fused else "none", amx)
        return y if fused else F.gelu(y, approximate=gelu)
    if residual is not None:
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, bias, "add")
    if gelu is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "gelu", [], gelu)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@dataclass(frozen=True)
class GreedyScreen:
    """A smaller copy of an lm_head's weight ``W [N, K]`` for :func:`greedy_head`.

    weight: packed as :func:`pack` packs ``W``: int8 ``q`` with ``W ~ scales[:, None] * q``
    (``scales``: fp32 ``[N]``, a column's largest magnitude / 127), or (an fp32 ``W``)
    ``bf16(W)`` with ``scales`` None.  The norms: the largest 2-norm over columns j (rows of
    the dense weight) of ``w_j``, of its copy (``s_j q_j``, ``bf16(w_j)``) and of their
    difference, in float64, rounded up."""

    weight: torch.Tensor
    w_norm: float
    screen_norm: float
    error_norm: float
    scales: torch.Tensor | None = None


def int8_screens() -> bool:
    """Whether an fp32 lm_head's screen is int8 here: wherever it has one (x86 with AVX2 and
    FMA, or AVX-512: ``vpdpwssd`` with AVX512-VNNI and AVX512-BF16, else AVX2's ``vpmaddwd``),
    as it reads half the bf16 screen's bytes (benchmarks/NOTES.md, "The lm_head's greedy
    screen").  A bf16 lm_head's screen, where it has one, is int8 (:func:`screen_available`)."""
    return "cpu" in compiled.compiled_backends() and \
        torch.ops.cbatch.greedy_head_supported(torch.float32)


def screen_available(dtype: torch.dtype) -> bool:
    """Whether an lm_head of ``dtype`` gets a :class:`GreedyScreen` here: fp32 on cbatch's
    kernel (x86 with AVX2 and FMA, or AVX-512; int8, :func:`int8_screens`), bf16 on cbatch's
    kernel too (AVX512-BF16, or AVX2 without AVX-512; int8); and ``$CBATCH_GREEDY_SCREEN``
    not ``0``."""
    return dtype in (torch.float32, torch.bfloat16) \
        and envs.CBATCH_GREEDY_SCREEN \
        and route_available("cbatch", dtype) and torch.ops.cbatch.greedy_head_supported(dtype)


def _quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` → int8 ``q`` and fp32 ``scales [N]`` (a column's largest magnitude / 127;
    1 for a zero column), ``w ~ scales[:, None] * q``."""
    top = w.float().abs().amax(dim=1)
    scales = torch.where(top > 0, top / 127, torch.ones_like(top))
    q = (w.float() / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scales


def _int8_screen(dtype: torch.dtype) -> bool:
    """Whether an lm_head of ``dtype`` gets the int8 screen (a bf16 one has no other)."""
    return dtype == torch.bfloat16 or int8_screens()


def screen_kind(dtype: torch.dtype) -> str | None:
    """The screen an lm_head of ``dtype`` gets here: ``"int8"``, ``"bf16"`` or None (see
    :func:`screen_available`)."""
    if not screen_available(dtype):
        return None
    return "int8" if _int8_screen(dtype) else "bf16"


def pack_screen(weight: torch.Tensor, int8: bool | None = None) -> GreedyScreen:
    """The :class:`GreedyScreen` of a dense fp32 or bf16 ``[N, K]`` weight (K even): int8,
    or (fp32 only) bf16; ``int8`` None: int8 where :func:`int8_screens`."""
    w = weight.detach()
    if int8 is None:
        int8 = _int8_screen(w.dtype)
    if not int8 and w.dtype != torch.float32:
        raise ValueError(f"a bf16 screen is for an fp32 weight, not {w.dtype}")
    if int8:
        copy, scales = _quantize_int8(w)
    else:
        copy, scales = w.to(torch.bfloat16), None
    norms = torch.zeros(3, dtype=torch.float64)  # NaN, if any, propagates (and disables it)
    rows = range(0, w.shape[0], 4096)  # float64 a slice at a time
    for r in rows:
        part, part_copy = w[r:r + 4096].double(), copy[r:r + 4096].double()
        if scales is not None:
            part_copy = part_copy * scales[r:r + 4096, None].double()
        for i, t in enumerate((part, part_copy, part - part_copy)):
            norms[i] = torch.maximum(norms[i], t.norm(dim=1).max())
    up = 1 + 1e-9  # float64 sums of K squares are within K * 2^-53 relative
    return GreedyScreen(pack(copy, "cbatch"), *(float(n) * up for n in norms), scales=scales)


def greedy_head(x: torch.Tensor, packed: torch.Tensor, screen: GreedyScreen,
                out_features: int, amx: bool = False) -> torch.Tensor:
    """``argmax(packed_linear(x, packed, None, out_features, amx=amx), dim=-1)`` bit for bit,
    reading ``screen`` instead of most of ``packed`` where that saves time.  x: ``[M, K]``,
    the dtype of ``packed`` (fp32 or bf16, :func:`pack`'s layout) → int64 ``[M]``."""
    return torch.ops.cbatch.greedy_head(x if x.stride(-1) == 1 else x.contiguous(), packed,
                                        screen.weight, out_features, screen.w_norm,
                                        screen.screen_norm, screen.error_norm, screen.scales,
                                        amx)


def has_amx() -> bool:
    """Whether the CPU has AMX tiles (torch's check): oneDNN's bf16 GEMM then sums a row
    differently as the number of rows grows."""
    return torch.cpu._is_amx_tile_supported()


def may_use_amx(batch_invariant: bool) -> bool:
    """The one rule for cbatch's kernels and AMX tiles: a batch-invariant model never takes
    them (tdpbf16ps sums a row in another order than the AVX-512 path, and which path runs
    depends on how many rows share the call; csrc/cpu/amx_bf16_linear.h)."""
    return not batch_invariant


def cpu_isa() -> str:
    """The x86 features the C++ CPU kernels use here, after ``$CBATCH_CPU_ISA``'s cap:
    space-separated from ``avx512 avx512bf16 avx512vnni amx-int8 avx2`` (amx-int8: the int8
    kernels' tiles, :func:`amx_int8_tiles`); "" without the extension or on a CPU with none
    of them."""
    if "cpu" not in compiled.compiled_backends():
        return ""
    return torch.ops.cbatch.cpu_isa()


def attention_step(head_dim: int, dtype: torch.dtype = torch.float32) -> str:
    """The step the C++ CPU attention kernels run for ``head_dim`` and ``dtype`` now:
    ``"avx512bf16"`` (bfloat16 on AVX512-BF16: q K^T on ``vdpbf16ps``), ``"avx512"``,
    ``"avx2"`` or ``"generic"`` (the kernels' own rule; "" without the extension)."""
    if "cpu" not in compiled.compiled_backends():
        return ""
    return torch.ops.cbatch.cpu_attention_step(head_dim, dtype)


def kernel_paths() -> dict[str, int]:
    """How many calls each path of the C++ CPU kernels has run in this process, by
    ``<op>.<path>`` (``linear.avx512``, ``linear.bf16.avx2``, ``quantized_linear.w4.avx2``,
    ``quantized_linear.w8a8.avx512vnni``, ``quantized_linear.w8a8.amx``,
    ``quantized_linear.w4a8.avx512vnni``, ``quantized_linear.w4a8.amx``,
    ``greedy_head.int8.avx2``, ``decode_attention.avx512``, ...;
    ``greedy_head.unsettled_rows`` counts rows the screen left to the kernel, not calls);
    empty without the extension.  Counts only grow: compare two readings."""
    if "cpu" not in compiled.compiled_backends():
        return {}
    return dict(zip(torch.ops.cbatch.cpu_path_names(), torch.ops.cbatch.cpu_path_counts()))


if "cpu" in compiled.compiled_backends():  # shapes for torch.compile and the meta device

    @torch.library.register_fake("cbatch::linear")
    def _(x, packed, out_features, bias, residual, activation, amx=False):
        check_no_meta_mix("cbatch::linear", x=x, packed=packed, bias=bias, residual=residual)
        return x.new_empty((x.shape[0], out_features))

    @torch.library.register_fake("cbatch::greedy_head")
    def _(x, packed, screen, out_features, w_norm, screen_norm, error_norm, scales=None,
          amx=False):
        check_no_meta_mix("cbatch::greedy_head", x=x, packed=packed, screen=screen, scales=scales)
        return x.new_empty((x.shape[0],), dtype=torch.long)
