"""Paged decode/prefill attention: every backend against the reference.

CPU kernels run here; Triton kernels run on the GPU or, without one, in Triton's CPU
interpreter (TRITON_INTERPRET=1, set by conftest); CUDA kernels need a GPU.
"""

import pytest
import torch

from cbatch import ops
from tests.helpers import (assert_attention_close, paged_inputs, triton_device,
                           triton_skip_reason)

HAS_CUDA = torch.cuda.is_available()
TRITON_DEVICE = triton_device() if ops.available_backends()["triton"].available else None
STATUS = ops.available_backends()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _backends(op):
    """(backend, device) pairs that can run `op` here."""
    pairs = []
    if STATUS["cpu"].available:
        pairs.append(("cpu", "cpu"))
    if TRITON_DEVICE is not None:  # the GPU, or CPU tensors in a working interpreter
        pairs.append(("triton", TRITON_DEVICE))
    if STATUS["cuda"].available and HAS_CUDA and op == "paged_decode_attention":
        pairs.append(("cuda", "cuda"))
    return pairs


def _ids(pairs):
    return [f"{b}-{d}" for b, d in pairs]


DECODE = _backends("paged_decode_attention")
PREFILL = _backends("paged_prefill_attention")
B = 16
EDGE_LENS = [1, B - 1, B, B + 1, 5 * B + 3]


def _poisoned_out(query):
    return torch.full_like(query, float("nan"))


@pytest.mark.parametrize("backend,device", DECODE, ids=_ids(DECODE))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_edge_lengths(backend, device, dtype, head_dim):
    seed = torch.randint(0, 2**31, ()).item()  # fresh inputs every run
    args = paged_inputs(EDGE_LENS, [1] * len(EDGE_LENS), 2, head_dim, B, dtype, device, seed)
    q, kc, vc, tables, cu, lens = args
    out = ops.paged_decode_attention(q, kc, vc, tables, lens, out=_poisoned_out(q),
                                     backend=backend)
    assert out.dtype == dtype and out.shape == q.shape
    assert_attention_close(out, *args)


@pytest.mark.parametrize("backend,device", DECODE, ids=_ids(DECODE))
@pytest.mark.parametrize("block_size", [8, 16])
def test_decode_ragged_long_tail(backend, device, block_size):
    gen = torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())
    lens = (torch.distributions.LogNormal(3.5, 1.0).sample((12,)).clamp(1, 700).long()
            .tolist())
    args = paged_inputs(lens, [1] * len(lens), 3, 64, block_size, torch.float16, device,
                        int(torch.randint(0, 2**31, (), generator=gen)))
    q, kc, vc, tables, _, seq_lens = args
    out = ops.paged_decode_attention(q, kc, vc, tables, seq_lens, backend=backend)
    assert_attention_close(out, *args)


@pytest.mark.skipif(not STATUS["cpu"].available, reason="C++ extension not built")
@pytest.mark.parametrize("threads", [1, 3, 8])
def test_cpu_kernels_any_thread_count(threads):
    """The CPU kernels cut heads into groups by the thread count (one sequence: several
    items per head group; many: whole heads) and hand items out dynamically."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for lens, new in (([300], [1]), ([5, 40, 17, 1, 90, 33, 16, 2, 64], [1] * 9),
                          ([50, 20], [50, 3])):
            args = paged_inputs(lens, new, 5, 64, B, torch.bfloat16, "cpu", threads)
            q, kc, vc, tables, cu, seq_lens = args
            if sum(new) == len(new):
                out = ops.paged_decode_attention(q, kc, vc, tables, seq_lens, backend="cpu")
            else:
                out = ops.paged_prefill_attention(q, kc, vc, tables, cu, seq_lens,
                                                  backend="cpu")
            assert_attention_close(out, *args)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not STATUS["cpu"].available, reason="C++ extension not built")
@pytest.mark.parametrize("isa, attention", [("", ""), ("avx2", ""), ("", "generic")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_kernel_paths(isa, attention, dtype):
    """Every code path of the CPU kernels, each asserted to have run through the kernels' own
    path counters: the AVX-512 step (a CPU with AVX-512, head dims that are multiples of 16;
    bf16 on AVX512-BF16 takes its vdpbf16ps step),
    the AVX2 one (a CPU with AVX2 and a multiple of 8: head dim 72 on any AVX2 CPU, every
    head dim under the avx2 cap) and the portable one (the generic option, and any head dim
    no vector step takes), for decode and prefill, grouped queries, block sizes 8/16/32
    (more than 16 keys in a block), head dims 64/128/80/72/36."""
    from cbatch.ops import compiled, cpu

    torch.ops.cbatch.set_cpu_options(isa, attention)
    try:
        features = cpu.cpu_isa().split()
        seed = torch.randint(0, 2**31, ()).item()
        for block_size, head_dim, heads, kv_heads in ((8, 64, 4, 4), (16, 128, 4, 2),
                                                      (32, 64, 6, 2), (16, 80, 2, 1),
                                                      (16, 72, 4, 2), (8, 36, 2, 1)):
            if attention == "generic":
                step = "generic"
            elif "avx512bf16" in features and dtype == torch.bfloat16 and head_dim % 16 == 0:
                step = "avx512bf16"  # 80: 32 + 32 + a masked 16
            elif "avx512" in features and head_dim % 16 == 0:
                step = "avx512"
            elif "avx2" in features and head_dim % 8 == 0:
                step = "avx2"
            else:
                step = "generic"
            lens = [1, block_size - 1, block_size, block_size + 1, 7 * block_size + 3]
            decode = paged_inputs(lens, [1] * len(lens), heads, head_dim, block_size, dtype,
                                  "cpu", seed, num_kv_heads=kv_heads)
            q, kc, vc, tables, cu, seq_lens = decode
            before = cpu.kernel_paths()
            assert_attention_close(ops.paged_decode_attention(q, kc, vc, tables, seq_lens,
                                                              backend="cpu"), *decode)
            prefill = paged_inputs(lens, [1, 3, block_size, 1, 40], heads, head_dim,
                                   block_size, dtype, "cpu", seed + 1, num_kv_heads=kv_heads)
            q, kc, vc, tables, cu, seq_lens = prefill
            assert_attention_close(ops.paged_prefill_attention(q, kc, vc, tables, cu, seq_lens,
                                                               backend="cpu"), *prefill)
            after = cpu.kernel_paths()
            ran = {k for k in after if after[k] > before[k] and "attention" in k}
            # the x86 steps take a prefill tile's rows over each chunk's keys transposed
            transposed = {"prefill_attention.transposed_rows"} if step in ("avx2", "avx512") \
                else set()
            assert ran == {f"decode_attention.{step}", f"prefill_attention.{step}"} | transposed, \
                (head_dim, ran)
            assert cpu.attention_step(head_dim, dtype) == step
    finally:
        torch.ops.cbatch.set_cpu_options(*compiled._cpu_options())


@pytest.mark.skipif(not STATUS["cpu"].available, reason="C++ extension not built")
@pytest.mark.parametrize("isa", ["", "avx2"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_prompt_rows_are_decode_rows_bitwise(isa, dtype):
    """A prompt row's output is the same bits whichever way the CPU kernel takes it: beside
    its tile's other rows over the keys transposed (the counter moves), or alone over the keys
    as they lie, as a decode token at the same position is: the invariant batch-invariant
    engines rest on.  Chunks of 1, 3, 16, 17 and 40 rows over ragged cached contexts, grouped
    queries, blocks of 16 and 24 keys (chunks of 16, then 8), head dims 64 and 72."""
    from cbatch.ops import compiled, cpu

    torch.ops.cbatch.set_cpu_options(isa, "")
    try:
        seed = torch.randint(0, 2**31, ()).item()
        for block_size, (heads, kv_heads, head_dim) in ((16, (6, 2, 64)), (24, (4, 4, 72)),
                                                        (16, (8, 1, 72))):
            lens, new = [1, 20, 16, 50, 57], [1, 3, 16, 17, 40]
            q, kc, vc, tables, cu, seq_lens = paged_inputs(
                lens, new, heads, head_dim, block_size, dtype, "cpu", seed,
                num_kv_heads=kv_heads)
            before = cpu.kernel_paths()["prefill_attention.transposed_rows"]
            prompt = ops.paged_prefill_attention(q, kc, vc, tables, cu, seq_lens, backend="cpu")
            # every row as a decode token: its sequence's table, its own position + 1 keys
            seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(new))
            pos = torch.cat([torch.arange(n - k, n) for n, k in zip(lens, new)])
            rows = ops.paged_decode_attention(q, kc, vc, tables[seq].contiguous(),
                                              (pos + 1).to(torch.int32), backend="cpu")
            assert torch.equal(rows, prompt), (block_size, heads, kv_heads, head_dim)
            if cpu.attention_step(head_dim, dtype) in ("avx2", "avx512"):
                assert cpu.kernel_paths()["prefill_attention.transposed_rows"] > before
    finally:
        torch.ops.cbatch.set_cpu_options(*compiled._cpu_options())


@pytest.mark.skipif(TRITON_DEVICE is None, reason=triton_skip_reason())
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_decode_split_kv_path(dtype):
    """Force split-KV (partitions of 128 tokens): sequences spanning 1..4 partitions."""
    from cbatch.kernels import decode_attention

    device = TRITON_DEVICE
    lens = [1, 127, 128, 129, 300, 512]
    args = paged_inputs(lens, [1] * len(lens), 2, 64, B, dtype, device, 7)
    q, kc, vc, tables, _, seq_lens = args
    for partition in (128, 256):
        out = decode_attention.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.125,
                                                      partition_size=partition)
        assert_attention_close(out, *args)
    with pytest.raises(ValueError, match="multiple of 128"):
        decode_attention.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.125,
                                                partition_size=100)


@pytest.mark.skipif(not (HAS_CUDA and STATUS["cuda"].available), reason="needs a GPU")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_decode_split_and_unsplit(dtype):
    """Few sequences x heads with long contexts take the split-KV path; many take the
    single-pass path.  Both must match."""
    for lens in ([4000, 1, 700], [64] * 600):
        args = paged_inputs(lens, [1] * len(lens), 2, 64, B, dtype, "cuda", len(lens))
        q, kc, vc, tables, _, seq_lens = args
        out = ops.paged_decode_attention(q, kc, vc, tables, seq_lens, backend="cuda")
        assert_attention_close(out, *args)


@pytest.mark.parametrize("backend,device", PREFILL, ids=_ids(PREFILL))
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_chunks_over_cached_context(backend, device, dtype):
    # (seq_len, new tokens): fresh prompts, chunks continuing a cached prefix, decode tokens
    cases = [(1, 1), (B - 1, B - 1), (B, B), (B + 1, B + 1), (5 * B + 3, 20), (40, 1),
             (33, 33), (70, 5)]
    lens, new = zip(*cases)
    seed = torch.randint(0, 2**31, ()).item()
    args = paged_inputs(list(lens), list(new), 2, 64, B, dtype, device, seed)
    q, kc, vc, tables, cu, seq_lens = args
    out = ops.paged_prefill_attention(q, kc, vc, tables, cu, seq_lens, out=_poisoned_out(q),
                                      backend=backend)
    assert_attention_close(out, *args)


@pytest.mark.parametrize("backend,device", PREFILL, ids=_ids(PREFILL))
def test_prefill_odd_head_dim_and_empty_chunk(backend, device):
    """head_dim 80 (not a power of two); a sequence with no new tokens this step."""
    args = paged_inputs([20, 9, 35], [4, 0, 35], 3, 80, 8, torch.float32, device, 3)
    q, kc, vc, tables, cu, seq_lens = args
    out = ops.paged_prefill_attention(q, kc, vc, tables, cu, seq_lens, backend=backend)
    assert_attention_close(out, *args)


def test_cuda_head_dim_limit_falls_back_or_refuses():
    assert ops.resolve_backend("paged_decode_attention", torch.device("cpu"), None, 80) in (
        "cpu", "torch")
    if STATUS["cuda"].available:
        dev = torch.device("cuda")
        assert ops.resolve_backend("paged_decode_attention", dev, None, 80) == "triton"
        with pytest.raises(ValueError, match="supports head_dim"):
            ops.resolve_backend("paged_decode_attention", dev, "cuda", 80)


# ----------------------------------------------------------------------------- bad input


def _good(device="cpu"):
    return paged_inputs([5, 17], [1, 1], 2, 64, B, torch.float32, device, 0)


@pytest.mark.parametrize("backend", ["torch"] + [b for b, d in DECODE if d == "cpu"])
@pytest.mark.parametrize("mutate,exc,match", [
    (lambda a: a.update(query=a["query"].half()), TypeError, "query dtype"),
    (lambda a: a.update(query=a["query"][:, :1]), ValueError, "heads and head_dim"),
    (lambda a: a.update(query=a["query"][..., :32]), ValueError, "heads and head_dim"),
    (lambda a: a.update(key_cache=a["key_cache"].transpose(1, 2).contiguous().transpose(1, 2)),
     ValueError, "contiguous"),
    (lambda a: a.update(block_tables=a["block_tables"].long()), TypeError, "int32"),
    (lambda a: a.update(seq_lens=a["seq_lens"][:0], query=a["query"][:0],
                        block_tables=a["block_tables"][:0]), ValueError, "non-empty"),
    (lambda a: a.update(query=a["query"][:1]), ValueError, "one token per sequence"),
    (lambda a: a.update(key_cache=a["key_cache"].int(), value_cache=a["value_cache"].int(),
                        query=a["query"].int()), TypeError, "float32, float16 or bfloat16"),
])
def test_decode_bad_inputs(backend, mutate, exc, match):
    q, kc, vc, tables, _, lens = _good()
    args = dict(query=q, key_cache=kc, value_cache=vc, block_tables=tables, seq_lens=lens)
    mutate(args)
    with pytest.raises(exc, match=match):
        ops.paged_decode_attention(**args, backend=backend)


def test_seq_len_beyond_block_table():
    q, kc, vc, tables, cu, lens = _good()
    lens[1] = tables.shape[1] * B + 1
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = .* is outside"):
        ops.paged_decode_attention(q, kc, vc, tables, lens, check_bounds=True)
    if STATUS["cpu"].available:  # the CPU kernel checks on its own: lengths are host memory
        with pytest.raises(ValueError, match=r"seq_lens\[1\] = .* is outside"):
            ops.paged_decode_attention(q, kc, vc, tables, lens, backend="cpu")


def test_prefill_bad_cu_seqlens():
    q, kc, vc, tables, cu, lens = _good()
    with pytest.raises(ValueError, match="cu_seqlens_q must be"):
        ops.paged_prefill_attention(q, kc, vc, tables, cu[:-1], lens)
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        ops.paged_prefill_attention(q, kc, vc, tables, cu.long(), lens)
    bad = torch.tensor([0, 1, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q must run from 0 to T"):
        ops.paged_prefill_attention(q, kc, vc, tables, bad, lens, check_bounds=True)


# ----------------------------------------------------------------------------- opcheck


@pytest.mark.skipif(not STATUS["cpu"].available, reason="compiled CPU extension not built")
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_compiled_ops(dtype):
    q, kc, vc, tables, cu, lens = paged_inputs([3, 20], [1, 1], 2, 64, B, dtype, "cpu", 1)
    torch.library.opcheck(torch.ops.cbatch.paged_decode_attention, (q, kc, vc, tables, lens, 0.1))
    qp, kc, vc, tables, cu, lens = paged_inputs([3, 20], [3, 6], 2, 64, B, dtype, "cpu", 2)
    torch.library.opcheck(torch.ops.cbatch.paged_prefill_attention,
                          (qp, kc, vc, tables, cu, lens, 0.1))


@pytest.mark.skipif(TRITON_DEVICE is None, reason=triton_skip_reason())
def test_opcheck_triton_ops():
    from cbatch.ops import triton as triton_ops  # noqa: F401  (registers the cbatch_triton ops)

    device = TRITON_DEVICE
    q, kc, vc, tables, cu, lens = paged_inputs([3, 20], [1, 1], 2, 64, B, torch.float32,
                                               device, 1)
    torch.library.opcheck(torch.ops.cbatch_triton.paged_decode_attention,
                          (q, kc, vc, tables, lens, 0.1))
    qp, kc, vc, tables, cu, lens = paged_inputs([3, 20], [3, 6], 2, 64, B, torch.float32,
                                                device, 2)
    torch.library.opcheck(torch.ops.cbatch_triton.paged_prefill_attention,
                          (qp, kc, vc, tables, cu, lens, 0.1))
    slots = torch.tensor([5, -1, 40], device=device)
    k = torch.randn(3, 2, 64, device=device)
    torch.library.opcheck(torch.ops.cbatch_triton.write_kv_cache,
                          (k, k.clone(), kc.nan_to_num(), vc.nan_to_num(), slots))


@pytest.mark.parametrize("backend,device", PREFILL, ids=_ids(PREFILL))
def test_prefill_max_query_len_hint(backend, device):
    """The grid-sizing hint changes nothing but the launch; a too-small one is refused when
    bounds are checked."""
    args = paged_inputs([40, 7, 19], [33, 1, 19], 2, 64, B, torch.float32, device, 5)
    q, kc, vc, tables, cu, seq_lens = args
    out = ops.paged_prefill_attention(q, kc, vc, tables, cu, seq_lens, backend=backend,
                                      max_query_len=33)
    assert_attention_close(out, *args)
    with pytest.raises(ValueError, match="max_query_len 32"):
        ops.paged_prefill_attention(q, kc, vc, tables, cu, seq_lens, backend=backend,
                                    max_query_len=32, check_bounds=True)
