"""The one step path: persistent step buffers, batch-size buckets padded for CUDA graphs
(run eagerly on the CPU with cuda_graphs=True), graph capture and replay on CUDA."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cbatch import LLM, Engine, SamplingParams
from cbatch.core.model_runner import graph_buckets
from cbatch.core.scheduler import ScheduledSequence
from cbatch.core.sequence import Sequence

POLICIES = ["fcfs", "priority", "sjf", "static"]
CONFIGS = {
    "roomy": dict(max_num_seqs=10, max_num_batched_tokens=512),
    "chunked-prefill": dict(max_num_seqs=10, max_num_batched_tokens=7),
    "preempting": dict(max_num_seqs=10, max_num_batched_tokens=64, block_size=4,
                       num_blocks=14),
}


def _workload(n, seed=3):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 511, (int(torch.randint(1, 30, (1,), generator=gen)),),
                             generator=gen).tolist() for _ in range(n)]
    params = [SamplingParams(max_tokens=int(torch.randint(1, 12, (1,), generator=gen)),
                             ignore_eos=True, temperature=0.8 * (i % 2), seed=i)
              for i in range(n)]
    return prompts, params


def test_graph_buckets():
    assert graph_buckets(1) == [1]
    assert graph_buckets(10) == [1, 2, 4, 8, 10]
    assert graph_buckets(256)[:8] == [1, 2, 4, 8, 16, 24, 32, 40]
    assert graph_buckets(256)[-3:] == [224, 240, 256]


# batch sizes at the bucket edges of max_num_seqs=10: 1, a bucket (4), bucket + 1, the max
@pytest.mark.parametrize("num_requests", [1, 4, 5, 10])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_padded_bucket_path_gives_the_same_tokens(num_requests, policy, config):
    prompts, params = _workload(num_requests)
    outs = {}
    for graphs in (False, True):
        llm = LLM("random:tiny", scheduling_policy=policy, cuda_graphs=graphs,
                  **CONFIGS[config])
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.engine.block_manager.check_whole()
        if config == "preempting" and num_requests == 10:
            assert llm.engine.stats().num_preemptions > 0
    assert outs[True] == outs[False]


def _decode_items(engine, n):
    """n running sequences with a few computed tokens each and one new token to decode."""
    bm = engine.block_manager
    items = []
    for i in range(n):
        seq = Sequence(str(i), list(range(1, 6 + i)), SamplingParams(), i)
        bm.grow(seq.block_table, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens - 1
        items.append(ScheduledSequence(seq, 1))
    return items


def test_padded_rows_write_nothing():
    engine = Engine("random:tiny", max_num_seqs=10, cuda_graphs=True, num_blocks=64)
    items = _decode_items(engine, 5)
    used = {b for item in items for b in item.seq.block_table}
    free = [b for b in range(64) if b not in used]
    engine.kv_cache.data[:, :, free] = float("nan")  # poisoned: a padded row writing shows
    batch = engine.runner.prepare(items)
    assert batch.num_seqs == 8 and batch.num_padded_seqs == 3  # bucket 8 holds 5 rows
    assert batch.slot_mapping[5:].tolist() == [-1, -1, -1]
    with torch.inference_mode():
        engine.runner.logits(batch)
    for block in free:
        assert engine.kv_cache.data[:, :, block].isnan().all(), f"free block {block} written"
    # each real sequence wrote exactly its new token's slot, in every layer
    for item in items:
        pos = item.seq.num_computed_tokens
        block = item.seq.block_table[pos // engine.block_manager.block_size]
        assert not engine.kv_cache.data[:, :, block, pos % 16].isnan().any()


class _AllocationCounter(TorchDispatchMode):
    """Records every op whose output does not live in one of the given storages."""

    def __init__(self, storages):
        super().__init__()
        self.storages = storages
        self.allocations = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and \
                    t.untyped_storage().data_ptr() not in self.storages:
                self.allocations.append(func)
        return out


@pytest.mark.parametrize("graphs", [False, True])
def test_preparing_a_step_allocates_no_tensor(graphs):
    engine = Engine("random:tiny", max_num_seqs=10, cuda_graphs=graphs, num_blocks=64)
    builder = engine.runner.builder
    storages = {t.untyped_storage().data_ptr() for t in builder._host + builder._dev}
    for n in (1, 5, 10):
        items = _decode_items(engine, n)
        with _AllocationCounter(storages) as counter:
            batch = engine.runner.prepare(items)
            batch.block_tables.shape  # the views exist
        assert counter.allocations == [], counter.allocations
        for item in items:
            engine.block_manager.free(item.seq.block_table)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cuda_graph_capture_and_replay_match_eager(dtype):
    prompts, params = _workload(10, seed=5)
    outs, engines = {}, {}
    for graphs in (False, True):
        llm = LLM("random:tiny", device="cuda", dtype=dtype, cuda_graphs=graphs,
                  max_num_seqs=10)
        engines[graphs] = llm.engine
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    stats = engines[True].stats()
    assert sorted(engines[True].runner._graphs) == graph_buckets(10)
    assert stats.graph_capture_s > 0
    if dtype == "float32":
        assert outs[True] == outs[False]
    # a replay computes what the eager forward computes for the same padded batch
    engine = engines[True]
    items = _decode_items(engine, 5)
    batch = engine.runner.prepare(items)
    with torch.inference_mode():
        replayed = engine.runner.logits(batch).clone()
        hidden = engine.model(batch, engine.kv_cache)
        eager = engine.model.compute_logits(hidden[:5])
    torch.testing.assert_close(replayed, eager)
