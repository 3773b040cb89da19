"""The one step path: persistent step buffers, batch-size buckets padded for CUDA graphs
(run eagerly on the CPU with cuda_graphs=True), graph capture and replay on CUDA."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cbatch import LLM, Engine, SamplingParams
from cbatch.core.model_runner import graph_buckets
from cbatch.core.scheduler import ScheduledSequence
from cbatch.core.sequence import Sequence
from tests.helpers import STRESS_CONFIGS

POLICIES = ["fcfs", "priority", "sjf", "static"]
CONFIGS = {k: v for k, v in STRESS_CONFIGS.items() if k != "few-seqs"}


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


def _run(prompts, params, **kwargs):
    llm = LLM("random:tiny", **kwargs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.block_manager.check_whole()
    assert not llm.engine._in_flight  # nothing left on the device once all is done
    return llm.engine, outs


# batch sizes at the bucket edges of max_num_seqs=10: 1, a bucket (4), bucket + 1, the max
@pytest.mark.slow
@pytest.mark.parametrize("num_requests", [1, 4, 5, 10])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_padded_buckets_and_async_scheduling_give_the_same_tokens(num_requests, policy,
                                                                   config):
    prompts, params = _workload(num_requests)
    outs = {}
    for graphs, async_ in [(False, False), (True, False), (False, True), (True, True)]:
        engine, got = _run(prompts, params, scheduling_policy=policy, cuda_graphs=graphs,
                           async_scheduling=async_, **CONFIGS[config])
        outs[graphs, async_] = [o.token_ids for o in got]
        if config == "preempting" and num_requests == 10:
            assert engine.stats().num_preemptions > 0
    assert outs[True, False] == outs[False, False]
    assert outs[False, True] == outs[False, False]
    assert outs[True, True] == outs[False, False]


def test_a_request_whose_last_token_is_in_flight_frees_its_blocks_and_slot_at_once():
    """As in the synchronous engine, where it has finished by the next schedule: no
    preemption for want of its blocks, no admission held back for want of its slot."""
    runs = {}
    for async_ in (False, True):
        # 12-token prompt with one token to make, beside one that needs blocks to grow
        engine, outs = _run([list(range(1, 13)), list(range(100, 108))],
                            [SamplingParams(max_tokens=1, ignore_eos=True),
                             SamplingParams(max_tokens=6, ignore_eos=True)],
                            block_size=4, num_blocks=5, max_num_seqs=4,
                            async_scheduling=async_)
        assert engine.stats().num_preemptions == 0
        engine = Engine("random:tiny", max_num_seqs=2, async_scheduling=async_)
        for i in range(6):
            engine.add_request([1 + i] * 5, SamplingParams(max_tokens=2, ignore_eos=True))
        for _ in range(30):
            if not engine.has_unfinished_requests():
                break
            engine.step()
        runs[async_] = ([o.token_ids for o in outs], engine.occupancy_trace)
    assert runs[True] == runs[False]


def _deferred_counter(engine):
    """Counts the new tokens that reach each step from the device (in-flight tokens)."""
    counts, build = [], engine.runner.builder.build

    def spy(runs, **kwargs):
        counts.append(len(kwargs.get("deferred", ())))
        return build(runs, **kwargs)

    engine.runner.builder.build = spy
    return counts


@pytest.mark.parametrize("policy", POLICIES)
def test_async_scheduling_with_stops_logprobs_and_aborts(policy):
    """Requests that end on a stop token, EOS or a stop string give their step-n+1 row back
    unused; logprobs travel with the tokens; an abort mid-flight loses nothing."""
    prompts, params = _workload(8, seed=11)
    _, plain = _run(prompts, params, max_num_seqs=8)
    stopping = []
    for i, (sp, out) in enumerate(zip(params, plain)):
        mid = out.token_ids[len(out.token_ids) // 2]  # ends the request early
        piece = out.text[len(out.text) // 2:][:3]
        how = [dict(stop_token_ids=[mid], logprobs=2), dict(logprobs=3),
               dict(stop=[piece]) if piece and "\ufffd" not in piece
               else dict(stop_token_ids=[mid]),
               dict(logprobs=1, ignore_eos=False)][i % 4]
        stopping.append(SamplingParams(max_tokens=sp.max_tokens, temperature=sp.temperature,
                                       seed=sp.seed, **{"ignore_eos": True, **how}))
    results = {}
    for async_ in (False, True):
        engine, outs = _run(prompts, stopping, max_num_seqs=8, scheduling_policy=policy,
                            async_scheduling=async_)
        results[async_] = [(o.token_ids, o.finish_reason, o.logprobs) for o in outs]
    assert results[True] == results[False]
    assert any(reason == "stop" for _, reason, _ in results[False])

    # an abort while the request's token is in flight: the others finish as without it
    engine = Engine("random:tiny", max_num_seqs=8, async_scheduling=True)
    counts = _deferred_counter(engine)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    victim = max(range(8), key=lambda i: params[i].max_tokens)
    finals = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        if len(counts) == 3:
            assert engine._requests[ids[victim]].num_inflight == 1
            engine.abort(ids[victim])
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    assert sum(counts) > 0  # tokens did reach steps from the device
    assert finals[ids[victim]].finish_reason == "abort"
    engine.block_manager.check_whole()
    for i, rid in enumerate(ids):
        if i != victim:
            assert finals[rid].token_ids == plain[i].token_ids


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


def test_block_tables_rewritten_only_where_they_changed_and_always_right():
    from cbatch.core.input_batch import StepBatchBuilder

    builder = StepBatchBuilder(4, 16, 6, 4)
    tables = [[3, 1], [5], [0, 2, 4], [7]]

    def check(full_width):
        runs = [([9], 4 * len(t) - 1, t) for t in tables]
        batch = builder.build(runs, full_width=full_width)
        for row, table in zip(batch.block_tables.tolist(), tables):
            assert row[:len(table)] == table

    check(False)
    tables[1].append(6)  # a sequence grew a block (its list changes in place)
    check(False)
    tables[0], tables[2] = tables[2], tables[0]  # sequences changed rows
    check(False)
    tables[3][0] = 8  # preempted and readmitted: same length, other blocks
    check(False)
    check(True)  # another width: every row again
    del tables[3]  # fewer rows, then a padded step
    check(True)
    batch = builder.build([([9], 0, [5])], pad_to=3, full_width=True)
    assert batch.block_tables[:, 0].tolist() == [5, 0, 0]


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


@pytest.mark.parametrize("graphs", [False, True])
def test_in_flight_tokens_are_fed_from_the_device_without_allocating(graphs):
    engine = Engine("random:tiny", max_num_seqs=10, cuda_graphs=graphs, num_blocks=64)
    runner, builder = engine.runner, engine.runner.builder
    items = _decode_items(engine, 5)
    # the last token of sequences 1 and 3 is in flight: the previous step sampled it in
    # rows 4 and 0 of its own batch
    runner._sampled = torch.tensor([300, 7, 7, 7, 400])
    runner._sampled_rows = {id(items[1].seq): 4, id(items[3].seq): 0}
    for i in (1, 3):
        items[i].seq.token_ids.pop()
        items[i].seq.num_inflight = 1
    storages = {t.untyped_storage().data_ptr()
                for t in builder._host + builder._dev + (runner._sampled,)}
    with _AllocationCounter(storages) as counter:
        batch = runner.prepare(items)
    assert counter.allocations == [], counter.allocations
    want = [item.seq.token_ids[-1] for item in items]
    want[1], want[3] = 400, 300
    assert batch.input_ids[:5].tolist() == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cuda_graph_capture_and_replay_match_eager(dtype):
    """Graphs and async scheduling on CUDA (the defaults there) against the eager,
    synchronous engine."""
    prompts, params = _workload(10, seed=5)
    outs, engines = {}, {}
    for graphs, async_ in [(False, False), (True, False), (True, True)]:
        llm = LLM("random:tiny", device="cuda", dtype=dtype, cuda_graphs=graphs,
                  async_scheduling=async_, max_num_seqs=10)
        engines[graphs, async_] = llm.engine
        outs[graphs, async_] = [o.token_ids for o in llm.generate(prompts, params,
                                                                   use_tqdm=False)]
        llm.engine.block_manager.check_whole()
    engine = engines[True, True]
    assert engine.async_scheduling and engines[False, False].runner.buckets == []
    assert sorted(engine.runner._graphs) == graph_buckets(10)
    assert engine.stats().graph_capture_s > 0
    if dtype == "float32":
        assert outs[True, False] == outs[False, False]
        assert outs[True, True] == outs[False, False]
    # a replay computes what the eager forward computes for the same padded batch
    items = _decode_items(engine, 5)
    batch = engine.runner.prepare(items)
    with torch.inference_mode():
        replayed = engine.runner.logits(batch).clone()
        hidden = engine.model(batch, engine.kv_cache)
        eager = engine.model.compute_logits(hidden[:5])
    torch.testing.assert_close(replayed, eager)
