"""The one step path: persistent step buffers, batch-size buckets padded for CUDA graphs
(run eagerly on the CPU with cuda_graphs=True), graph capture and replay on CUDA."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cbatch import LLM, Engine, SamplingParams
from cbatch.core.input_batch import run_starts
from cbatch.core.model_runner import graph_buckets
from cbatch.core.scheduler import ScheduledSequence
from cbatch.core.sequence import Sequence
from tests.helpers import STRESS_CONFIGS, triton_device, triton_skip_reason

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


def test_runs_padded_at_the_front_to_a_query_length():
    from cbatch.core.input_batch import StepBatchBuilder, run_starts

    builder = StepBatchBuilder(4, 16, 3, 4)
    # a run verifying 2 drafts after 5 cached tokens, a decode row after 3, 2 padding rows
    runs = [([7, 8, 9], 5, [2, 6]), ([4], 3, [1])]
    batch = builder.build(runs, pad_to=4, full_width=True, query_len=3)
    assert batch.graph_shape == (4, 3) and batch.num_padded_seqs == 2
    assert not batch.is_decode and batch.max_query_len == 3
    assert batch.input_ids.tolist() == [7, 8, 9, 0, 0, 4] + [0] * 6
    # fillers recompute cached positions and write nothing
    assert batch.positions.tolist() == [5, 6, 7, 1, 2, 3] + [0] * 6
    assert batch.slot_mapping.tolist() == [25, 26, 27, -1, -1, 7] + [-1] * 6
    assert batch.cu_seqlens_q.tolist() == [0, 3, 6, 9, 12]
    assert batch.seq_lens.tolist() == [8, 4, 3, 3]  # the causal offset is the unpadded one
    assert batch.logits_indices.tolist() == [2, 5, 8, 11]
    assert run_starts([3, 1], 3) == [0, 5] and run_starts([3, 1]) == [0, 3]
    with pytest.raises(ValueError, match="a run of 1 tokens after 1 cached cannot be padded"):
        builder.build([([4], 1, [1])], query_len=3)  # too few cached positions to recompute
    assert builder.build(runs).graph_shape is None  # unpadded: no graph's shape
    # in-flight tokens land at their place in a padded run
    sampled = torch.tensor([11, 22])
    batch = builder.build(runs, pad_to=2, full_width=True, query_len=3,
                          deferred=[(0, 0, 1), (1, 0, 0)], sampled=sampled)
    assert batch.input_ids.tolist() == [22, 8, 9, 0, 0, 11]


@pytest.mark.parametrize("backend", [None, "triton"])
def test_a_verify_step_padded_to_its_graph_shape_computes_what_it_would_unpadded(backend):
    """Rows of one token and rows verifying drafts, padded to k + 1 tokens a row and a
    bucket: the logits at every sampled position are the unpadded step's, fillers read only
    written slots (every other slot holds NaN), and they and padding rows write no slot.
    ``triton``: the kernel a GPU runs, in Triton's interpreter."""
    if backend == "triton" and triton_device() != "cpu":
        pytest.skip(triton_skip_reason() if triton_device() is None else "a CPU test")
    engine = Engine("random:tiny", max_num_seqs=10, cuda_graphs=True, num_blocks=64,
                    attention_backend=backend,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    runner, bs = engine.runner, engine.block_manager.block_size
    items = _decode_items(engine, 5)
    unwritten = torch.ones(64 * bs, dtype=torch.bool)  # by slot
    for item, drafts in zip(items, [[5, 6, 7], [], [9], [1, 2], []]):
        seq = item.seq
        engine.block_manager.grow(seq.block_table, seq.num_tokens + len(drafts))
        item.num_new_tokens, item.draft_token_ids = 1 + len(drafts), drafts
        for pos in range(seq.num_tokens - 1):  # its cached context: written (zeros)
            unwritten[seq.block_table[pos // bs] * bs + pos % bs] = False
    pool = engine.kv_cache.data
    pool.view(*pool.shape[:2], 64 * bs, -1)[:, :, unwritten] = float("nan")
    with torch.inference_mode():
        runs = [(item.seq.token_ids[-1:] + item.draft_token_ids, item.seq.num_computed_tokens,
                 item.seq.block_table) for item in items]
        unpadded = engine.runner.builder.build(runs)
        assert unpadded.graph_shape is None
        want = engine.model.compute_logits(engine.model(unpadded, engine.kv_cache))
        written = pool.isnan().logical_not()
        batch = runner.prepare(items)
        assert batch.graph_shape == (8, 4) and batch.num_tokens == 32
        assert runner.steps_by_shape == {(8, 4): 1}
        starts = run_starts([item.num_new_tokens for item in items], 4)
        rows = [start + j for start, item in zip(starts, items)
                for j in range(item.num_new_tokens)]
        got = runner.logits(batch, torch.tensor(rows))
    assert want.isfinite().all()
    torch.testing.assert_close(got, want)
    if backend:  # the kernel named ran
        assert engine.model.kernels(engine.model.device).backends[
            "paged_prefill_attention"] == backend
    assert torch.equal(pool.isnan().logical_not(), written)  # no slot written by the padding
    # a row that cannot be padded (fewer cached positions than fillers) runs unpadded
    items[1].seq.num_computed_tokens = 1  # its one token would need 3 fillers
    assert runner.prepare(items[:2]).graph_shape is None


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


class _EagerGraph:
    """A CUDA graph's contract on the CPU: "captured" with a batch of padding only, whose
    tensors are views of the step buffers, ``replay()`` recomputes that batch's forward into
    the same output tensor.  It gives a step's logits only if the step was laid out at the
    captured addresses and shapes, as a real graph's replay does."""

    def __init__(self, runner, shape):
        size, query_len = shape
        self.runner, self.replays = runner, 0
        self.batch = runner.builder.build([], pad_to=size, full_width=True, query_len=query_len)
        self.logits = self.forward()

    def forward(self):
        return self.runner.model.compute_logits(self.runner.model(self.batch,
                                                                  self.runner.kv_cache))

    def replay(self):
        self.logits.copy_(self.forward())
        self.replays += 1


def _speculating(method):
    """Prompts that repeat a random unit (prompt lookup finds them), greedy params, and a
    speculative_config of ``method`` with k = 3 (the draft model: random:tiny itself)."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() * 3 for n in (2, 3, 5, 7)]
    spec = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
             "prompt_lookup_max": 3} if method == "ngram" else
            {"method": "draft_model", "model": "random:tiny", "num_speculative_tokens": 3})
    return prompts, SamplingParams(max_tokens=24, ignore_eos=True), spec


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_verify_steps_replay_graphs_captured_at_k_plus_1_tokens_a_row(monkeypatch, method):
    """With graphs that behave as CUDA graphs do (:class:`_EagerGraph`), verifying steps (and
    the draft model's first pass) replay the graph of k + 1 tokens a row of their bucket and
    take the logits of their sampled positions from it: the tokens are the eager engine's."""
    monkeypatch.setenv("CBATCH_GREEDY_SCREEN", "0")  # greedy steps read the logits
    prompts, params, spec = _speculating(method)
    plain = LLM("random:tiny", max_num_seqs=10).generate(prompts, params, use_tqdm=False)
    llm = LLM("random:tiny", max_num_seqs=10, cuda_graphs=True, speculative_config=spec)
    engine = llm.engine
    runners = [engine.runner] + ([engine.spec_decoder.proposer.runner] if method == "draft_model"
                                 else [])
    for runner in runners:
        monkeypatch.setattr(runner, "capture_graphs", lambda runner=runner: runner._graphs.update(
            (shape, (g, g.logits)) for shape in runner.graph_shapes()
            for g in [_EagerGraph(runner, shape)]))
        runner.setup_graphs()  # (it replays each graph once against the eager forward)
        assert sorted(runner._graphs) == sorted(runner.graph_shapes())
        for g, _ in runner._graphs.values():
            g.replays = 0
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert engine.stats().spec_decode_num_accepted_tokens > 0
    engine.block_manager.check_whole()
    for runner in runners:
        replays = {shape: g.replays for shape, (g, _) in runner._graphs.items() if g.replays}
        assert any(q == 4 for _, q in replays), replays
        assert replays == dict(runner.steps_by_shape)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_verify_steps_replay_cuda_graphs_of_k_plus_1_tokens_a_row(method):
    """Speculative decoding on CUDA with graphs against the eager engine: the same tokens,
    verify steps (and the draft model's first pass) replaying graphs of k + 1 tokens a row,
    and a replay computing what the eager forward of the same padded batch computes."""
    prompts, params, spec = _speculating(method)
    outs = {}
    for graphs in (False, True):
        llm = LLM("random:tiny", device="cuda", dtype="float32", cuda_graphs=graphs,
                  max_num_seqs=10, speculative_config=spec)
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.engine.block_manager.check_whole()
    engine = llm.engine
    assert outs[True] == outs[False]
    assert engine.stats().spec_decode_num_accepted_tokens > 0
    runners = [engine.runner] + ([engine.spec_decoder.proposer.runner] if method == "draft_model"
                                 else [])
    for runner in runners:
        assert sorted(runner._graphs) == sorted(runner.graph_shapes())
        assert any(q == 4 for _, q in runner.steps_by_shape), runner.steps_by_shape
    runner = engine.runner
    items = _decode_items(engine, 3)
    for item, drafts in zip(items, [[5, 6, 7], [], [9]]):
        engine.block_manager.grow(item.seq.block_table, item.seq.num_tokens + len(drafts))
        item.num_new_tokens, item.draft_token_ids = 1 + len(drafts), drafts
    batch = runner.prepare(items)
    assert batch.graph_shape == (4, 4)
    rows = torch.arange(16, device="cuda")
    with torch.inference_mode():
        replayed = runner.logits(batch, rows).clone()
        eager = engine.model.compute_logits(engine.model(batch, engine.kv_cache))
    torch.testing.assert_close(replayed, eager)


def test_graph_shapes_are_decode_buckets_and_with_drafts_those_at_k_plus_1_tokens():
    plain = Engine("random:tiny", max_num_seqs=10, cuda_graphs=True).runner
    assert plain.graph_shapes() == [(s, 1) for s in (10, 8, 4, 2, 1)]
    # 64 tokens a step: buckets of up to 16 rows hold 4 tokens a row
    spec = Engine("random:tiny", max_num_seqs=20, cuda_graphs=True, max_num_batched_tokens=64,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3}).runner
    assert spec.verify_buckets == [1, 2, 4, 8, 16]
    assert spec.graph_shapes()[:3] == [(16, 4), (8, 4), (20, 1)]
    assert Engine("random:tiny", cuda_graphs=False, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3}).runner.graph_shapes() == []
