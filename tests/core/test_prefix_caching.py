"""Prefix caching: the block manager's cache on its own (no torch), then the engine with
caching on against caching off."""

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbatch import Engine
from cbatch.core.block_manager import BlockManager
from cbatch.core.scheduler import Scheduler
from cbatch.core.sequence import Sequence
from cbatch.sampling_params import SamplingParams
from tests.helpers import Arrival, run_arrivals

BS = 4


def _cached_table(bm: BlockManager, tokens: list[int]) -> list[int]:
    """A table holding ``tokens`` with all of them computed and cached."""
    table: list[int] = []
    bm.take_prefix(table, bm.match_prefix(tokens), len(tokens))
    bm.cache_computed(table, [], tokens, len(tokens))
    return table


def _check_references(bm: BlockManager, tables: list[list[int]]) -> None:
    """Every block some table holds is referenced once per holder and is not free."""
    held = Counter(b for t in tables for b in t)
    free = set(bm._free) | set(bm._evictable)
    for block in range(bm.num_blocks):
        assert bm._ref_counts[block] == held[block], f"block {block}"
        assert (block in free) == (held[block] == 0), f"block {block}"


def test_full_blocks_are_shared_and_the_last_token_is_always_computed():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    a = _cached_table(bm, list(range(10)))  # blocks: 0-3, 4-7 full, 8-9 partial
    match = bm.match_prefix(list(range(8)) + [50, 51])
    assert match.blocks == a[:2] and match.copy_from is None
    match = bm.match_prefix(list(range(8)))  # whole prompt cached: token 7 is recomputed,
    assert match.blocks == a[:1]  # the 3 tokens before it are copied
    assert (match.copy_from, match.num_copied_tokens) == (a[1], 3)
    assert bm.match_prefix(list(range(1, 9))).blocks == []  # chained: position matters
    b: list[int] = []
    copy = bm.take_prefix(b, match, 8)
    assert b[0] == a[0] and b[1] not in a and copy == (a[1], b[1])
    _check_references(bm, [a, b])
    bm.free(a)
    bm.free(b)
    _check_references(bm, [])
    bm.check_whole()


def test_cache_off_matches_nothing():
    bm = BlockManager(8, BS)
    table = _cached_table(bm, list(range(9)))
    assert bm.match_prefix(list(range(9))).blocks == [] and bm.num_cached_blocks == 0
    bm.free(table)
    bm.check_whole()


def test_idle_cached_blocks_are_evicted_lru_and_only_when_needed():
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    prompts = [[p] * 8 for p in (1, 2, 3)]  # 2 full blocks each: the pool is full
    queries = [p + [99] for p in prompts]  # ask for both blocks (the 99 is computed)
    for table in [_cached_table(bm, p) for p in prompts]:
        bm.free(table)  # released in the order 1, 2, 3
    assert bm.num_cached_blocks == 6 and bm.num_free_blocks == 6
    hit: list[int] = []
    bm.take_prefix(hit, bm.match_prefix(queries[0]), 8)  # prompt 1 used again: now the MRU
    bm.free(hit)
    grown: list[int] = []
    bm.grow(grown, 4)  # evicts the LRU block: prompt 2's tail (tails go first)
    assert len(bm.match_prefix(queries[1]).blocks) == 1
    assert len(bm.match_prefix(queries[0]).blocks) == 2
    bm.grow(grown, 8)
    assert len(bm.match_prefix(queries[1]).blocks) == 0  # then prompt 2's head
    assert len(bm.match_prefix(queries[2]).blocks) == 2
    assert len(bm.match_prefix(queries[0]).blocks) == 2
    bm.free(grown)
    bm.check_whole()


def test_no_block_is_freed_or_evicted_while_referenced():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    a = _cached_table(bm, list(range(8)))
    b: list[int] = []
    bm.take_prefix(b, bm.match_prefix(list(range(8)) + [9]), 9)  # shares both of a's blocks
    first = a[0]
    bm.free(a)
    other: list[int] = []
    bm.grow(other, 4)  # one block left: taken from the free list, not from b
    _check_references(bm, [b, other])
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.grow(other, 5)
    bm.free(b)
    bm.free(other)
    bm.check_whole()
    with pytest.raises(RuntimeError, match="freed more often"):
        bm.free([first])


def _seq(i, tokens, max_tokens=4):
    return Sequence(str(i), list(tokens), SamplingParams(max_tokens=max_tokens), i)


def test_admission_counts_only_uncached_blocks_and_starts_at_the_first_uncached_token():
    bm = BlockManager(7, BS, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8)
    prefix = list(range(16))
    a = _seq(0, prefix + [100, 101])
    sched.add(a)
    for _ in range(3):  # 18 tokens in chunks of 8: 8, 8, 2
        for item in sched.schedule().scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
    assert a.num_computed_tokens == 18 and len(a.block_table) == 5
    # 2 blocks left; b needs 6 blocks for its 22 tokens, 4 of them cached
    b = _seq(1, prefix + [200] * 6)
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(b, 6)]
    assert b.num_computed_tokens == 16 and b.block_table[:4] == a.block_table[:4]
    assert sched.num_cache_hit_tokens == 16 and sched.num_cache_queried_tokens == 18 + 22
    sched.remove(a)
    sched.remove(b)
    bm.check_whole()


@pytest.mark.parametrize("prompt_len", [BS - 1, BS, BS + 1, 3 * BS - 2, 3 * BS])
def test_identical_prompt_copies_the_cached_tail_and_computes_one_token(prompt_len):
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a = _seq(0, range(prompt_len), max_tokens=6)
    sched.add(a)
    while a.num_output_tokens < 6:  # prompt, then 5 decodes
        for item in sched.schedule().scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            item.seq.token_ids.append(7)
    a_blocks = list(a.block_table)
    sched.remove(a)
    b = _seq(1, range(prompt_len))
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(b, 1)]
    full = (prompt_len - 1) // BS
    assert len(out.block_copies) == (1 if (prompt_len - 1) % BS else 0)
    for src, dst in out.block_copies:
        assert src == a_blocks[full] and dst == b.block_table[full] and dst not in a_blocks
    sched.remove(b)
    bm.check_whole()


def _step(sched):
    """One schedule, then every scheduled sequence computes its tokens (and samples 7)."""
    out = sched.schedule()
    for item in out.scheduled:
        samples = item.samples
        item.seq.num_computed_tokens += item.num_new_tokens
        if samples:
            item.seq.token_ids.append(7)
    return [(item.seq, item.num_new_tokens) for item in out.scheduled]


@pytest.mark.parametrize("caching", [True, False])
def test_a_prompt_shared_in_one_step_is_prefilled_once(caching):
    """Requests that arrive together with one prompt: the first prefills it and the others
    wait one step, then start from its full blocks (only the tokens past them computed);
    a request behind them waits too (admission in order).  With the cache off, or a prompt
    that shares no full block, all start at once."""
    bm = BlockManager(32, BS, enable_prefix_caching=caching)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    prompt = list(range(2 * BS + 3))
    seqs = [_seq(i, prompt) for i in range(3)]
    other = _seq(3, prompt[:BS - 1] + [99] * 5)  # shares 3 tokens: less than a block
    for seq in seqs + [other]:
        sched.add(seq)
    n = len(prompt)
    if not caching:
        assert _step(sched) == [(s, n) for s in seqs] + [(other, 8)]
        return
    assert _step(sched) == [(seqs[0], n)]
    # other: its 3 shared tokens copied from the first block, its 5 others computed
    assert _step(sched) == [(seqs[0], 1)] + [(s, n - 2 * BS) for s in seqs[1:]] + [(other, 5)]
    assert seqs[1].block_table[:2] == seqs[2].block_table[:2] == seqs[0].block_table[:2]
    assert sched.num_cache_hit_tokens == 2 * 2 * BS + 3
    for seq in seqs + [other]:
        sched.remove(seq)
    bm.check_whole()


def test_preempted_sequence_comes_back_from_its_cached_blocks():
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, policy="priority")
    hi = Sequence("hi", list(range(8)), SamplingParams(max_tokens=8), 0, priority=0)
    lo = Sequence("lo", list(range(50, 58)), SamplingParams(max_tokens=8), 1, priority=1)
    sched.add(hi)
    sched.add(lo)
    preempted = []
    for _ in range(4):
        out = sched.schedule()
        preempted += out.preempted
        for item in out.scheduled:
            samples = item.samples
            item.seq.num_computed_tokens += item.num_new_tokens
            if samples:
                item.seq.token_ids.append(1)
    assert preempted == [lo]
    sched.remove(hi)
    out = sched.schedule()  # lo's 2 full blocks were cached when it was preempted; hi's
    # growth evicted the tail one, the head one is still there
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(lo, lo.num_tokens - BS)]
    assert lo.num_computed_tokens == BS
    sched.remove(lo)
    bm.check_whole()


# ---------------------------------------------------------------- the engine


def _engine(**kw):
    return Engine("random:tiny", block_size=BS, max_num_seqs=4, **kw)


@pytest.mark.parametrize("prompt_len", [9, 12, 14])
def test_engine_request_identical_to_a_finished_one_computes_one_token(prompt_len):
    engine = _engine(num_blocks=32)
    prompt = [(5 * j + 3) % 500 for j in range(prompt_len)]
    outs = []
    for _ in range(2):
        before = engine.stats().num_prefill_tokens
        engine.add_request(prompt, SamplingParams(max_tokens=5, ignore_eos=True))
        while engine.has_unfinished_requests():
            outs += [o.token_ids for o in engine.step() if o.finished]
        computed = engine.stats().num_prefill_tokens - before
    assert computed == 1 and outs[0] == outs[1]
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens == prompt_len - 1
    assert stats.prefix_cache_hit_rate == (prompt_len - 1) / (2 * prompt_len)
    engine.block_manager.check_whole()


def _run(engine, requests, prompts, temperature):
    """The scripted run of ``requests``, checking block references after every step."""
    arrivals = [Arrival(prompts[i], SamplingParams(max_tokens=m, ignore_eos=True,
                                                   temperature=temperature), step, prio, abort)
                for i, (_, _, m, step, prio, abort) in enumerate(requests)]
    return run_arrivals(engine, arrivals, max_steps=400, after_step=lambda e: _check_references(
        e.block_manager, [s.block_table for s in e.scheduler.running]))


request = st.tuples(
    st.integers(0, 2),  # which shared prefix
    st.integers(0, 2),  # which of 3 suffixes (equal ones make identical prompts)
    st.integers(1, 12),  # max_tokens
    st.integers(0, 4),  # arrival step
    st.integers(0, 2),  # priority
    st.one_of(st.none(), st.integers(0, 6)),  # abort after this many steps
)


@pytest.mark.slow
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(request, min_size=2, max_size=8),
       prefix_lens=st.lists(st.integers(0, 20), min_size=3, max_size=3),
       suffix_lens=st.lists(st.integers(1, 8), min_size=3, max_size=3),
       policy=st.sampled_from(["fcfs", "priority", "sjf"]),
       budget=st.integers(4, 64), num_blocks=st.integers(10, 20),
       temperature=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 1000))
def test_outputs_identical_with_caching_on_and_off(requests, prefix_lens, suffix_lens, policy,
                                                   budget, num_blocks, temperature, seed):
    prefixes = [[(seed + 11 * p + j) % 500 for j in range(n)] for p, n in enumerate(prefix_lens)]
    suffixes = [[(seed * 3 + 13 * s + j) % 500 for j in range(n)]
                for s, n in enumerate(suffix_lens)]
    prompts = [prefixes[p] + suffixes[s] for p, s, *_ in requests]
    runs = {}
    for caching in (False, True):
        engine = _engine(num_blocks=num_blocks, max_num_batched_tokens=budget,
                         scheduling_policy=policy, enable_prefix_caching=caching, seed=seed)
        runs[caching] = _run(engine, requests, prompts, temperature)
    for i in range(len(requests)):
        off, on = runs[False][i], runs[True][i]
        if "abort" in (off.finish_reason, on.finish_reason):  # aborted at another token
            n = min(len(off.token_ids), len(on.token_ids))
            assert on.token_ids[:n] == off.token_ids[:n]
        else:
            assert on.token_ids == off.token_ids


def test_reset_prefix_cache_forgets_idle_blocks_and_refuses_while_held():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    table = _cached_table(bm, list(range(9)))
    with pytest.raises(RuntimeError, match="every block returned"):
        bm.reset_prefix_cache()
    bm.free(table)
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and bm.match_prefix(list(range(9))).blocks == []
    bm.check_whole()
