"""Scheduler and block manager on their own: plain Python, no torch, no model."""

import subprocess
import sys

import pytest

from cbatch.core.block_manager import BlockManager
from cbatch.core.scheduler import Scheduler
from cbatch.core.sequence import Sequence, SequenceStatus
from cbatch.sampling_params import SamplingParams

TORCH_FREE = ["cbatch.core.scheduler", "cbatch.core.block_manager", "cbatch.core.sequence",
              "cbatch.core.static", "cbatch.sampling_params", "cbatch.config"]


def test_the_scheduling_core_imports_no_torch():
    """The scheduler and what it stands on are plain Python over integers and lists."""
    code = (f"import sys; import {', '.join(TORCH_FREE)}; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def _seq(i, prompt_len, max_tokens=4, priority=0):
    return Sequence(str(i), list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), i,
                    priority)


def _advance(sched_out):
    """What the engine does after the model ran: count computed tokens, sample one token."""
    for item in sched_out.scheduled:
        samples = item.samples
        item.seq.num_computed_tokens += item.num_new_tokens
        if samples:
            item.seq.token_ids.append(0)


def test_block_manager_grow_share_free():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    table: list[int] = []
    tokens = list(range(13))
    bm.grow(table, 9)
    assert len(table) == 3 and bm.num_free_blocks == 3 and bm.usage == 0.5
    bm.grow(table, 12)  # still fits in 3 blocks
    assert len(table) == 3
    bm.cache_computed(table, [], tokens, 12)
    match = bm.match_prefix(tokens)  # all 3 full blocks (the 13th token is computed)
    shared: list[int] = []
    bm.take_prefix(shared, match, 13)
    assert shared[:3] == table and bm.num_free_blocks == 2
    bm.free(table)
    assert table == [] and bm.num_free_blocks == 2  # still held by `shared`
    bm.free(shared)
    bm.check_whole()
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.grow([], 25)


def test_check_whole_reports_leaks():
    bm = BlockManager(4, 4)
    bm.grow([], 5)
    with pytest.raises(AssertionError, match="2 blocks not returned"):
        bm.check_whole()


def test_decodes_first_then_chunks_then_new_within_budget():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10)
    a, b = _seq(0, 3), _seq(1, 25)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()  # a: whole prompt (3), b: first chunk (7)
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("0", 3), ("1", 7)]
    assert out.scheduled[0].samples and not out.scheduled[1].samples
    _advance(out)
    c = _seq(2, 5)
    sched.add(c)
    out = sched.schedule()  # a decodes (1), b continues (9), c waits: budget spent
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("0", 1), ("1", 9)]
    _advance(out)
    out = sched.schedule()  # a (1), b's last 9, then c gets nothing: budget 10 = 1 + 9
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("0", 1), ("1", 9)]
    _advance(out)
    out = sched.schedule()
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("0", 1), ("1", 1), ("2", 5)]


def test_max_num_seqs_caps_admission():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        sched.add(_seq(i, 2))
    out = sched.schedule()
    assert len(out.scheduled) == 2 and len(sched.waiting) == 1


def test_preempts_lowest_priority_never_the_grown_one_and_no_thrash():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, policy="priority")
    hi, lo = _seq(0, 4, max_tokens=8, priority=0), _seq(1, 4, max_tokens=8, priority=1)
    sched.add(hi)
    sched.add(lo)
    _advance(sched.schedule())  # both prefilled: 1 block each, and each sampled a token
    _advance(sched.schedule())  # both grow to a 2nd block: 4 of 4 used
    assert bm.num_free_blocks == 0
    for _ in range(3):
        _advance(sched.schedule())
    out = sched.schedule()  # hi needs a 3rd block: lo must go
    assert out.preempted == [lo] and lo.status is SequenceStatus.WAITING
    assert lo.num_computed_tokens == 0 and lo.block_table == [] and lo.num_preemptions == 1
    assert [s.seq for s in out.scheduled] == [hi]
    _advance(out)
    out = sched.schedule()  # lo (6 tokens: 2 blocks) cannot come back while hi holds 3
    assert [s.seq for s in out.scheduled] == [hi] and not out.preempted
    sched.remove(hi)
    out = sched.schedule()  # now it fits: recomputed as one prefill of prompt + outputs
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(lo, lo.num_tokens)]
    sched.remove(lo)
    bm.check_whole()


def test_unknown_policy():
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        Scheduler(BlockManager(4, 4), 1, 1, policy="random")
