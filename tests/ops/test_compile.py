"""cbatch's ops under torch.compile(fullgraph=True) (CPU here; CUDA graphs on a GPU)."""

import pytest
import torch

from cbatch import ops
from tests.helpers import paged_inputs, triton_device

STATUS = ops.available_backends()
HAS_CUDA = torch.cuda.is_available()


def _step(q, k, v, key_cache, value_cache, slots, tables, seq_lens, backend):
    ops.write_kv_cache(k, v, key_cache, value_cache, slots, backend=backend)
    return ops.paged_decode_attention(q, key_cache, value_cache, tables, seq_lens,
                                      backend=backend) * 2.0


def _decode_inputs(device):
    q, kc, vc, tables, _, lens = paged_inputs([5, 17, 33], [1, 1, 1], 2, 64, 16, torch.float32,
                                              device, 0)
    kc, vc = kc.nan_to_num(), vc.nan_to_num()
    # the new token of each sequence sits at position seq_len - 1
    pos = (lens - 1).long()
    slots = tables[torch.arange(3, device=device), pos // 16].long() * 16 + pos % 16
    k, v = torch.randn_like(q), torch.randn_like(q)
    return q, k, v, kc, vc, slots, tables, lens


@pytest.mark.slow
@pytest.mark.parametrize("backend", [b for b in ("cpu", "triton") if STATUS[b].available
                                     and (b != "triton" or triton_device() == "cpu")])
def test_fullgraph_compile_cpu(backend):
    args = _decode_inputs("cpu")
    eager_kc, eager_vc = args[3].clone(), args[4].clone()
    expected = _step(*args[:3], eager_kc, eager_vc, *args[5:], backend)
    torch._dynamo.reset()
    compiled = torch.compile(_step, fullgraph=True, backend="aot_eager" if backend == "triton"
                             else "inductor")
    got = compiled(*args, backend)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(args[3], eager_kc)  # the in-place cache write happened


@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
@pytest.mark.parametrize("backend", [b for b in ("cuda", "triton") if STATUS[b].available])
def test_cuda_graph_capture_and_replay(backend):
    args = list(_decode_inputs("cuda"))
    expected = _step(*args[:3], args[3].clone(), args[4].clone(), *args[5:], backend)
    _step(*args, backend)  # warm-up: autotuning and lazy init outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _step(*args, backend)
    new_q = torch.randn_like(args[0])
    args[0].copy_(new_q)
    graph.replay()
    fresh = _step(*args, backend)
    torch.testing.assert_close(out, fresh)
    assert not torch.equal(out, expected)  # the replay saw the new query
