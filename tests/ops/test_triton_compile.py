"""Compile every Triton kernel variant the GPU path launches, for sm_80 and sm_90, as the GPU
would (no GPU needed): Triton's compile-only path, ``triton.compile(ASTSource(...),
target=GPUTarget(...))``, down to the cubin (ptxas runs).

The interpreter the other tests use is far more permissive than the compiler (types of
loop-carried values, dot operand dtypes, constexpr use) and always upcasts to fp32, so the
fp16/bf16 tensor-core paths are only ever compiled here.  Kernels decorated under
TRITON_INTERPRET=1 cannot be compiled, so the compilation runs in subprocesses without it,
one per target, side by side.

A variant is what Triton specializes at launch: the kernel's constexprs, and for each integer
argument whether it equals 1 (then a constant) or is a multiple of 16.  Each case gives the
integer arguments of one real launch (GPT-2 small and a GQA Llama shape) and ``_compile``
derives the specialization from them by Triton's rule, so e.g. the prefill kernel compiles
both for multi-head attention (``kv_group`` 1, a constant) and for GQA.
"""

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

DTYPES = {"fp16": "*fp16", "bf16": "*bf16", "fp32": "*fp32"}
TARGETS = (80, 90)  # A100 (sm_80) and H100 (sm_90a); Triton adds the "a" for 90 itself
PAGE = 16
BLOCKS_PER_SEQ = 13  # a block table's width: its row stride (not a multiple of 16)


def _attention_ints(num_heads: int, num_kv_heads: int, head_dim: int) -> dict:
    """The strides of a launch on a fused-QKV view (query token stride (H + 2 H_kv) D) over a
    paged cache ``[num_blocks, PAGE, H_kv, D]``, into a dense ``[T, H, D]`` output."""
    return {"stride_q_t": (num_heads + 2 * num_kv_heads) * head_dim, "stride_q_h": head_dim,
            "stride_c_block": PAGE * num_kv_heads * head_dim,
            "stride_c_tok": num_kv_heads * head_dim, "stride_c_head": head_dim,
            "stride_bt": BLOCKS_PER_SEQ, "stride_o_t": num_heads * head_dim,
            "stride_o_h": head_dim}


# (num_heads, num_kv_heads) per head_dim: GPT-2 small (64, multi-head), a Llama-3-8B-like
# GQA model (128, groups of 4), and 80 (a head_dim that is not a power of two)
MHA = {64: (12, 12), 80: (32, 32), 128: (32, 32)}
GQA = {64: (12, 3), 80: (32, 8), 128: (32, 8)}


def _cases():
    """(name, kernel, pointer types, integer arguments, constexprs) for every kernel variant
    the GPU path launches, in fp16, bf16 and fp32."""
    import torch

    from cbatch.kernels import (cache, decode_attention, grouped_decode_attention, matmul,
                                prefill_attention, quant_matmul, sample)

    def ptrs(dtype, **extra):
        return {"*": DTYPES[dtype], "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
                "cu_seqlens_ptr": "*i32", "slot_mapping_ptr": "*i64",
                "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32", **extra}

    torch_dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    max_context = BLOCKS_PER_SEQ * PAGE
    for dtype in DTYPES:
        fp32 = dtype == "fp32"
        precision = "ieee" if fp32 else "tf32"
        for head_dim in (64, 128):
            for split in (False, True):
                # unsplit: one partition, the whole table (num_splits 1, a constant)
                splits = {"num_splits": 4, "partition": decode_attention.PARTITION_SIZE} \
                    if split else {"num_splits": 1, "partition": max_context}
                yield (f"decode {dtype} D={head_dim} split={split}",
                       decode_attention._paged_decode_kernel, ptrs(dtype),
                       {**_attention_ints(*MHA[head_dim], head_dim), **splits, "scale": 0.1},
                       {"HEAD_DIM": head_dim, "BLOCK_D": head_dim, "PAGE_SIZE": PAGE,
                        "SPLIT": split, **decode_attention.decode_config(head_dim)})
                num_heads, num_kv_heads = GQA[head_dim]
                group = num_heads // num_kv_heads
                yield (f"grouped decode (GQA) {dtype} D={head_dim} split={split}",
                       grouped_decode_attention._paged_decode_grouped_kernel, ptrs(dtype),
                       {**_attention_ints(num_heads, num_kv_heads, head_dim), **splits,
                        "kv_group": group, "scale": 0.1},
                       {"HEAD_DIM": head_dim, "BLOCK_D": head_dim, "PAGE_SIZE": PAGE,
                        "BLOCK_G": grouped_decode_attention.block_g(group), "UPCAST": fp32,
                        "PRECISION": precision, "SPLIT": split,
                        **grouped_decode_attention.grouped_decode_config(head_dim)})
        yield (f"merge {dtype}", decode_attention._merge_kernel, ptrs(dtype),
               {"num_splits": 4, "partition": decode_attention.PARTITION_SIZE,
                "stride_o_t": 768, "stride_o_h": 64},
               {"HEAD_DIM": 64, "BLOCK_D": 64})
        for heads, layout in ((MHA, "MHA"), (GQA, "GQA")):
            for head_dim, block_d in ((64, 64), (128, 128), (80, 128)):
                if layout == "GQA" and head_dim == 80:
                    continue  # the padded head_dim is MHA's business; GQA runs 64 and 128
                num_heads, num_kv_heads = heads[head_dim]
                yield (f"prefill ({layout}) {dtype} D={head_dim}",
                       prefill_attention._paged_prefill_kernel, ptrs(dtype),
                       {**_attention_ints(num_heads, num_kv_heads, head_dim),
                        "kv_group": num_heads // num_kv_heads, "scale": 0.1},
                       {"HEAD_DIM": head_dim, "BLOCK_D": block_d, "PAGE_SIZE": PAGE,
                        "UPCAST": fp32, "PRECISION": precision,
                        **prefill_attention.prefill_config(torch_dtypes[dtype], head_dim)})
        # the batch-invariant matmul: GPT-2's fused QKV projection (with bias) and its
        # lm_head (no bias; 50257 columns, not a multiple of 16)
        for n, has_bias in ((2304, True), (50257, False)):
            yield (f"batch-invariant matmul {dtype} N={n} bias={has_bias}",
                   matmul._matmul_kernel, ptrs(dtype),
                   {"M": 37, "N": n, "K": 768, "stride_x_m": 768, "stride_w_n": 768,
                    "stride_o_m": n},
                   {"HAS_BIAS": has_bias, "UPCAST": fp32, "PRECISION": precision,
                    "BLOCK_M": matmul.BLOCK_M, "BLOCK_N": matmul.BLOCK_N,
                    "BLOCK_K": matmul.BLOCK_K, "num_warps": matmul.NUM_WARPS,
                    "num_stages": matmul.NUM_STAGES})
        yield from _quant_cases(dtype, quant_matmul)
        yield (f"write_kv_cache {dtype}", cache._write_kv_cache_kernel, ptrs(dtype),
               {"stride_k_t": 2304, "stride_v_t": 2304}, {"ROW": 768, "BLOCK": 1024})
        # the sampling draw over the model's logits (a rule's logits are fp32): GPT-2's
        # vocabulary (50257) and Qwen's (151936, a multiple of 16)
        for vocab in (50257, 151936):
            yield (f"sample {dtype} V={vocab}", sample._sample_kernel,
                   ptrs(dtype, rows_ptr="*i64", temperature_ptr="*fp32", top_k_ptr="*i64",
                        top_p_ptr="*fp32", min_p_ptr="*fp32", u_ptr="*fp64", out_ptr="*i64"),
                   {"stride": vocab, "V": vocab},
                   {"ONE_BITS": sample._ONE_BITS, "BLOCK": 1024})


def _quant_cases(dtype: str, quant_matmul):
    """The quantized GEMMs (kernels/quant_matmul.py) on SmolLM2-360M's projections: its fused
    qkv (N 1600, K 960, with a bias as Qwen2's) at a decode step and its down projection
    (N 960, K 2560) in a prefill; W8A16 and W4A16 with group-128 zero points (GPTQ's), one
    scale per channel (online int8) and groups that are not whole tiles (per-weight scales),
    and float mins (GGUF's Q4_K, groups of 32; and per weight);
    W8A8's GEMM on pack_w8a8's layout and its per-token quantization (both without fp
    contraction, as they launch)."""
    fp32 = dtype == "fp32"
    for bits in (8, 4):
        weight = "*i8" if bits == 8 else "*u8"
        for (m, n, k), group, zeros, bias, mins in (
                ((1, 1600, 960), 128, True, True, False),
                ((37, 960, 2560), 2560, False, False, False),
                ((3, 1600, 960), 48, True, False, False),
                ((1, 1600, 960), 32, False, True, True),
                ((37, 960, 2560), 48, False, False, True)):
            block_m, block_n, block_k, per_tile = quant_matmul.tile_config(m, bits, k, group)
            rows = k if bits == 8 else -(-k // 2)
            yield (f"W{bits}A16 {dtype} M={m} N={n} K={k} group={group} zeros={zeros} "
                   f"bias={bias} mins={mins}", quant_matmul._wna16_kernel,
                   {"*": DTYPES[dtype], "qweight_ptr": weight, "scales_ptr": "*fp32",
                    "zeros_ptr": "*i8" if zeros else "*fp32", "mins_ptr": "*fp32",
                    "bias_ptr": DTYPES[dtype] if bias else "*fp32"},
                   {"M": m, "N": n, "K": k, "group_size": group, "stride_x_m": k,
                    "stride_o_m": n, "stride_q_b": rows * 16, "stride_s_g": -(-n // 16) * 16},
                   {"BITS": bits, "HAS_ZEROS": zeros, "HAS_MINS": mins, "HAS_BIAS": bias,
                    "SCALE_PER_TILE": per_tile, "UPCAST": fp32,
                    "PRECISION": "ieee" if fp32 else "tf32", "BLOCK_M": block_m,
                    "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 3})
    for (m, n, k), bias in (((1, 1600, 960), True), ((37, 960, 2560), False)):
        block_m, block_n, block_k, _ = quant_matmul.tile_config(m, 8, k, k)
        yield (f"W8A8 out {dtype} M={m} N={n} K={k} bias={bias}", quant_matmul._w8a8_kernel,
               {"*": DTYPES[dtype], "x_q_ptr": "*i8", "x_scale_ptr": "*fp32",
                "qweight_ptr": "*u8", "scales_ptr": "*fp32",
                "bias_ptr": DTYPES[dtype] if bias else "*fp32"},
               {"M": m, "N": n, "K": k, "stride_x_m": k, "stride_o_m": n,
                "stride_q_b": -(-k // 4) * 64},
               {"HAS_BIAS": bias, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
                "num_warps": 4, "num_stages": 3, "enable_fp_fusion": False})
    yield (f"scaled_int8_quant {dtype}", quant_matmul._scaled_int8_quant_kernel,
           {"*": DTYPES[dtype], "x_q_ptr": "*i8", "scale_ptr": "*fp32"},
           {"K": 960, "stride_x_m": 960, "stride_q_m": 960},
           {"RINT": quant_matmul._RINT, "BLOCK": 1024, "enable_fp_fusion": False})


def _compile(kernel, pointer_types: dict, ints: dict, constexprs: dict, arch: int) -> str:
    """PTX of ``kernel`` (a JITFunction) specialized as a launch with these arguments would
    be (Triton's rule: an integer equal to 1 becomes a constant, one that is a multiple of 16
    is marked divisible by 16, unless the kernel says do_not_specialize; torch allocations
    are 16-byte aligned), compiled for ``sm_<arch>``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs, constexprs = {}, {}, dict(constexprs)
    options = {k: constexprs.pop(k) for k in ("num_warps", "num_stages", "enable_fp_fusion")
               if k in constexprs}
    for i, param in enumerate(kernel.params):
        name = param.name
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointer_types.get(name, pointer_types["*"])
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(ints[name], float):
            signature[name] = "fp32"
        elif ints[name] == 1 and not param.do_not_specialize:
            signature[name] = "constexpr"
            constexprs[name] = 1
        else:
            signature[name] = "i32" if ints[name] < 2**31 else "i64"
            if ints[name] % 16 == 0 and not param.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
    assert set(inspect.signature(kernel.fn).parameters) == set(signature), kernel.fn.__name__
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    assert compiled.asm["cubin"], "ptxas produced no cubin"
    return compiled.asm["ptx"]


def main(arch: int) -> None:
    failures = 0
    for name, kernel, pointer_types, ints, constexprs in _cases():
        try:
            ptx = _compile(kernel, pointer_types, ints, constexprs, arch)
            print(f"ok      sm_{arch} {name} ({len(ptx)} bytes of PTX)", flush=True)
        except Exception as e:
            failures += 1
            print(f"FAILED  sm_{arch} {name}: {type(e).__name__}: {str(e)[:1500]}", flush=True)
    sys.exit(1 if failures else 0)


@pytest.mark.slow
def test_triton_kernels_compile_for_sm80_and_sm90(tmp_path):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    logs = {arch: tmp_path / f"sm_{arch}.log" for arch in TARGETS}  # files: no pipe fills up
    procs = {}
    for arch in TARGETS:
        with logs[arch].open("w") as log:
            procs[arch] = subprocess.Popen([sys.executable, __file__, str(arch)], env=env,
                                           stdout=log, stderr=subprocess.STDOUT,
                                           cwd=Path(__file__).resolve().parents[2])
    try:
        for proc in procs.values():
            proc.wait(timeout=900)
    finally:
        for proc in procs.values():
            proc.kill()  # a no-op once it exited; else it timed out (or its sibling did)
    cases = [name for name, *_ in _cases()]
    for arch, proc in procs.items():
        report = logs[arch].read_text()
        assert proc.returncode == 0, report[-6000:]
        compiled = [line.rsplit(" (", 1)[0] for line in report.splitlines()
                    if line.startswith("ok")]
        assert compiled == [f"ok      sm_{arch} {name}" for name in cases], report[-6000:]

if __name__ == "__main__":
    main(int(sys.argv[1]))
