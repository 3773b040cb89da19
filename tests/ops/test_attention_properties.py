"""Property test: the C++ CPU kernels against the reference on random ragged batches
(lengths, chunk sizes, block sizes, KV head counts, query heads per KV head, head widths,
dtypes, thread counts)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cbatch import ops
from tests.helpers import assert_attention_close, paged_inputs, needs_cpu_ext

pytestmark = needs_cpu_ext


@st.composite
def batches(draw):
    """(seq_lens, num_new): each sequence has 1..seq_len new tokens (decode when 1)."""
    lens = draw(st.lists(st.integers(1, 200), min_size=1, max_size=7))
    decode_only = draw(st.booleans())
    new = [1 if decode_only else draw(st.integers(1, n)) for n in lens]
    return lens, new


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(batch=batches(), block_size=st.sampled_from([1, 5, 8, 16, 32]),
       heads=st.integers(1, 6), group=st.sampled_from([1, 2, 3, 4, 7]),
       head_dim=st.sampled_from([8, 24, 64, 80]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       threads=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_cpu_kernels_match_the_reference(batch, block_size, heads, group, head_dim, dtype,
                                         threads, seed):
    lens, new = batch
    args = paged_inputs(lens, new, heads * group, head_dim, block_size, dtype, "cpu", seed,
                        num_kv_heads=heads)
    q, kc, vc, tables, cu, seq_lens = args
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if all(n == 1 for n in new):
            out = ops.paged_decode_attention(q, kc, vc, tables, seq_lens, backend="cpu")
        else:
            out = ops.paged_prefill_attention(q, kc, vc, tables, cu, seq_lens, backend="cpu")
    finally:
        torch.set_num_threads(before)
    assert out.shape == q.shape and out.dtype == dtype
    assert_attention_close(out, *args)
