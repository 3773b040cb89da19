"""Compile the Triton kernels for sm_90 as the GPU would (no GPU needed).

The interpreter the other tests use is far more permissive than the compiler (types of
loop-carried values, dot operand dtypes, constexpr use) and always upcasts to fp32, so the
fp16/bf16 tensor-core paths are only ever compiled here.  Kernels decorated under
TRITON_INTERPRET=1 cannot be compiled, so the compilation runs in a subprocess without it.
"""

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

DTYPES = {"fp16": "*fp16", "bf16": "*bf16", "fp32": "*fp32"}


def _cases():
    """(name, kernel, pointer types, constexprs) for every kernel variant the GPU can run."""
    import torch

    from cbatch.kernels import (cache, decode_attention, grouped_decode_attention, matmul,
                                prefill_attention)

    def ptrs(dtype, **extra):
        return {"*": DTYPES[dtype], "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
                "cu_seqlens_ptr": "*i32", "slot_mapping_ptr": "*i64",
                "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32", **extra}

    for dtype in DTYPES:
        for head_dim in (64, 128):
            for split in (False, True):
                yield (f"decode {dtype} D={head_dim} split={split}",
                       decode_attention._paged_decode_kernel, ptrs(dtype),
                       {"HEAD_DIM": head_dim, "BLOCK_D": head_dim, "PAGE_SIZE": 16,
                        "SPLIT": split, **decode_attention.decode_config(head_dim)})
        for head_dim in (64, 128):  # grouped-query attention: a group of up to 16 heads
            for split in (False, True):
                yield (f"grouped decode {dtype} D={head_dim} split={split}",
                       grouped_decode_attention._paged_decode_grouped_kernel, ptrs(dtype),
                       {"HEAD_DIM": head_dim, "BLOCK_D": head_dim, "PAGE_SIZE": 16,
                        "BLOCK_G": 16, "UPCAST": dtype == "fp32",
                        "PRECISION": "ieee" if dtype == "fp32" else "tf32", "SPLIT": split,
                        **grouped_decode_attention.grouped_decode_config(head_dim)})
        yield (f"merge {dtype}", decode_attention._merge_kernel, ptrs(dtype),
               {"HEAD_DIM": 64, "BLOCK_D": 64})
        fp32 = dtype == "fp32"
        for has_bias in (False, True):
            yield (f"batch-invariant matmul {dtype} bias={has_bias}", matmul._matmul_kernel,
                   ptrs(dtype), {"HAS_BIAS": has_bias, "UPCAST": fp32,
                                 "PRECISION": "ieee" if fp32 else "tf32",
                                 "BLOCK_M": matmul.BLOCK_M, "BLOCK_N": matmul.BLOCK_N,
                                 "BLOCK_K": matmul.BLOCK_K})
        for head_dim, block_d in ((64, 64), (128, 128), (80, 128)):
            fp32 = dtype == "fp32"
            torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
            yield (f"prefill {dtype} D={head_dim}", prefill_attention._paged_prefill_kernel,
                   ptrs(dtype), {"HEAD_DIM": head_dim, "BLOCK_D": block_d, "PAGE_SIZE": 16,
                                 "UPCAST": fp32, "PRECISION": "ieee" if fp32 else "tf32",
                                 **prefill_attention.prefill_config(torch_dtype[dtype],
                                                                    head_dim)})
    yield ("write_kv_cache fp16", cache._write_kv_cache_kernel, ptrs("fp16"),
           {"ROW": 768, "BLOCK": 1024})


# Integer arguments that are multiples of 16 for GPT-2-like shapes (the cache strides
# B*H*D, H*D, D; a fused-qkv view's token stride 3*H*D and head stride D): at run time Triton
# specializes on that (16-byte vector loads), so the variant compiled here does too.
ALIGNED_INTS = {"stride_c_block", "stride_c_tok", "stride_c_head", "stride_q_t", "stride_q_h",
                "stride_o_t", "stride_o_h", "stride_k_t", "stride_v_t",
                "N", "K", "stride_x_m", "stride_w_n", "stride_o_m"}  # (matmul: GPT-2 widths)


def _compile(kernel, pointer_types: dict, constexprs: dict) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel  # the JITFunction (the launchers pick its config; autotuning is opt-in)
    signature, attrs = {}, {}
    for i, name in enumerate(inspect.signature(fn.fn).parameters):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            signature[name] = pointer_types.get(name, pointer_types["*"])
        else:
            signature[name] = "fp32" if name == "scale" else "i32"
        if name.endswith("_ptr") or name in ALIGNED_INTS:  # torch allocations: 16-B aligned
            attrs[(i,)] = [["tt.divisibility", 16]]
    constexprs = dict(constexprs)
    options = {"num_warps": constexprs.pop("num_warps", 4)}  # the launch's, not the kernel's
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def main() -> None:
    failures = 0
    for name, kernel, pointer_types, constexprs in _cases():
        try:
            ptx = _compile(kernel, pointer_types, constexprs)
            print(f"ok      {name} ({len(ptx)} bytes of PTX)", flush=True)
        except Exception as e:
            failures += 1
            print(f"FAILED  {name}: {type(e).__name__}: {str(e)[:1500]}", flush=True)
    sys.exit(1 if failures else 0)


@pytest.mark.slow
def test_triton_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    result = subprocess.run([sys.executable, __file__], capture_output=True, text=True,
                            env=env, cwd=Path(__file__).resolve().parents[2], timeout=900)
    report = result.stdout + result.stderr[-3000:]
    assert result.returncode == 0, report
    assert report.count("ok      ") >= 31, report


if __name__ == "__main__":
    main()
