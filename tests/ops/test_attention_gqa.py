"""Grouped-query attention: caches with H_kv heads serving H = group * H_kv query heads, every
backend against the float64 reference (query head h reads KV head h // group).

Group sizes 1, 2, 4, 7 and 8 (7: a group that is not a power of two, and an odd number of
query heads), head dims 64 and 128, ragged lengths (1, block_size +- 1, long), shuffled
block tables, fp32/fp16/bf16.  CPU kernels run here; Triton kernels on the GPU or in the
interpreter; the CUDA kernel where there is a GPU.
"""

import pytest
import torch

from cbatch import ops
from tests.helpers import assert_attention_close, paged_inputs, triton_device

HAS_CUDA = torch.cuda.is_available()
STATUS = ops.available_backends()
TRITON_DEVICE = triton_device() if STATUS["triton"].available else None
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GROUPS = [1, 2, 4, 7, 8]
B = 16
NUM_KV_HEADS = 2


def _backends(op):
    pairs = []
    if STATUS["cpu"].available:
        pairs.append(("cpu", "cpu"))
    if TRITON_DEVICE is not None:  # the interpreter takes seconds per case
        pairs.append(pytest.param("triton", TRITON_DEVICE, marks=pytest.mark.slow,
                                  id=f"triton-{TRITON_DEVICE}"))
    if STATUS["cuda"].available and HAS_CUDA and op == "paged_decode_attention":
        pairs.append(("cuda", "cuda"))
    return pairs


DECODE = _backends("paged_decode_attention")
PREFILL = _backends("paged_prefill_attention")
# Every group size in every dtype, each group at both head dims (the full product is 2x
# longer and adds no case a kernel treats differently; Triton's interpreter is slow).
CASES = [(group, dtype, (64, 128)[(i + group) % 2])
         for group in GROUPS for i, dtype in enumerate(DTYPES)]


def _seed():
    return torch.randint(0, 2**31, ()).item()  # fresh inputs every run


@pytest.mark.slow  # the float64 reference loops over query rows in Python
@pytest.mark.parametrize("backend,device", DECODE)
@pytest.mark.parametrize("group,dtype,head_dim", CASES)
def test_decode_gqa(backend, device, group, dtype, head_dim):
    lens = [1, B - 1, B, B + 1, 300]
    args = paged_inputs(lens, [1] * len(lens), NUM_KV_HEADS * group, head_dim, B, dtype,
                        device, _seed(), num_kv_heads=NUM_KV_HEADS)
    q, kc, vc, tables, cu, seq_lens = args
    out = ops.paged_decode_attention(q, kc, vc, tables, seq_lens,
                                     out=torch.full_like(q, float("nan")), backend=backend)
    assert out.shape == q.shape and out.dtype == dtype
    assert_attention_close(out, *args)


@pytest.mark.slow  # the float64 reference loops over query rows in Python
@pytest.mark.parametrize("backend,device", PREFILL)
@pytest.mark.parametrize("group,dtype,head_dim", CASES)
def test_prefill_gqa(backend, device, group, dtype, head_dim):
    # (seq_len, new tokens): fresh prompts, a chunk over a cached prefix, decode tokens
    cases = [(1, 1), (B - 1, B - 1), (B + 1, B + 1), (5 * B + 3, 20), (40, 1), (70, 5)]
    lens, new = zip(*cases)
    args = paged_inputs(list(lens), list(new), NUM_KV_HEADS * group, head_dim, B, dtype,
                        device, _seed(), num_kv_heads=NUM_KV_HEADS)
    q, kc, vc, tables, cu, seq_lens = args
    out = ops.paged_prefill_attention(q, kc, vc, tables, cu, seq_lens,
                                      out=torch.full_like(q, float("nan")), backend=backend)
    assert_attention_close(out, *args)


def test_reference_is_attention_over_repeated_kv_heads():
    """The reference's head mapping, checked against the definition spelled out another way:
    repeat every KV head `group` times (what transformers' repeat_kv does) and run plain
    multi-head attention."""
    from cbatch.ops import reference

    group, H_kv = 3, 2
    args = paged_inputs([7, 20], [7, 4], H_kv * group, 16, 4, torch.float64, "cpu", 0,
                        num_kv_heads=H_kv)
    q, kc, vc, tables, cu, seq_lens = args
    out = reference.paged_prefill_attention(*args, compute_dtype=torch.float64)
    repeated = [c.repeat_interleave(group, dim=2) for c in (kc, vc)]
    mha = reference.paged_prefill_attention(q, *repeated, tables, cu, seq_lens,
                                            compute_dtype=torch.float64)
    torch.testing.assert_close(out, mha, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not STATUS["cpu"].available, reason="C++ extension not built")
@pytest.mark.parametrize("threads", [1, 3, 8])
@pytest.mark.parametrize("group,num_kv_heads", [(7, 2), (4, 1), (8, 3)])
def test_cpu_work_items_split_and_straddle_kv_groups(threads, group, num_kv_heads):
    """The CPU kernel cuts query heads into work items by the thread count: items of whole
    KV groups, items inside one group, items straddling two groups."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for lens, new in (([300], [1]), ([5, 40, 17, 1, 90], [1] * 5), ([50, 20], [50, 3])):
            args = paged_inputs(lens, new, num_kv_heads * group, 64, B, torch.bfloat16, "cpu",
                                threads, num_kv_heads=num_kv_heads)
            q, kc, vc, tables, cu, seq_lens = args
            if sum(new) == len(new):
                out = ops.paged_decode_attention(q, kc, vc, tables, seq_lens, backend="cpu")
            else:
                out = ops.paged_prefill_attention(q, kc, vc, tables, cu, seq_lens,
                                                  backend="cpu")
            assert_attention_close(out, *args)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("backend", ["torch"] + (["cpu"] if STATUS["cpu"].available else []))
def test_query_heads_must_be_a_multiple_of_kv_heads(backend):
    q, kc, vc, tables, cu, lens = paged_inputs([5, 17], [1, 1], 6, 64, B, torch.float32, "cpu",
                                               0, num_kv_heads=3)
    for bad in (q[:, :4], q[:, :2]):  # 4 and 2 query heads over 3 KV heads
        with pytest.raises(ValueError, match="multiple of 3"):
            ops.paged_decode_attention(bad.contiguous(), kc, vc, tables, lens, backend=backend)
        with pytest.raises(ValueError, match="multiple of 3"):
            ops.paged_prefill_attention(bad.contiguous(), kc, vc, tables, cu, lens,
                                        backend=backend)


@pytest.mark.skipif(not STATUS["cpu"].available, reason="C++ extension not built")
def test_compiled_op_checks_the_head_ratio_itself():
    q, kc, vc, tables, cu, lens = paged_inputs([5, 17], [1, 1], 6, 64, B, torch.float32, "cpu",
                                               0, num_kv_heads=3)
    with pytest.raises(ValueError, match="multiple of the cache's heads"):
        torch.ops.cbatch.paged_decode_attention(q[:, :4].contiguous(), kc, vc, tables, lens,
                                                0.125)
    for dtype in DTYPES:
        args = paged_inputs([3, 20], [3, 6], 8, 64, B, dtype, "cpu", 2, num_kv_heads=2)
        qp, kc, vc, tables, cu, lens = args
        torch.library.opcheck(torch.ops.cbatch.paged_prefill_attention,
                              (qp, kc, vc, tables, cu, lens, 0.1))


def test_warmup_takes_query_and_kv_heads():
    used = ops.warmup(torch.float32, 64, 16, "cpu", num_heads=6, num_kv_heads=2)
    assert set(used) == {"write_kv_cache", "paged_decode_attention", "paged_prefill_attention"}
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ops.warmup(torch.float32, 64, 16, "cpu", num_heads=6, num_kv_heads=4)


@pytest.mark.slow
@pytest.mark.skipif(TRITON_DEVICE is None, reason="Triton cannot run here")
@pytest.mark.parametrize("group", [2, 7, 20])
def test_triton_grouped_decode_split_kv_and_batch_invariance(group):
    """The grouped kernel (one program per KV head) with split-KV forced (partitions of 128
    tokens) and without; a group wider than 16 rows; each sequence's output bitwise the same
    alone and in the batch."""
    from cbatch.kernels import decode_attention

    lens = [1, 127, 129, 300]
    args = paged_inputs(lens, [1] * len(lens), 2 * group, 64, B, torch.float32, TRITON_DEVICE,
                        group, num_kv_heads=2)
    q, kc, vc, tables, _, seq_lens = args
    for partition in (128, None):
        out = decode_attention.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.125,
                                                      partition_size=partition)
        assert_attention_close(out, *args)
        for s in range(len(lens)):
            alone = decode_attention.paged_decode_attention(
                q[s:s + 1], kc, vc, tables[s:s + 1], seq_lens[s:s + 1], 0.125,
                partition_size=partition)
            assert torch.equal(alone, out[s:s + 1])
