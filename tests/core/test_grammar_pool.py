"""The grammar workers' pool (issue 74, finding 2): its workers are kept warm (started ahead
of the first constraint, a killed one replaced at once, forked from a template process in
milliseconds); a small constraint does not wait behind heavy ones; a job's budget counts its
wait for a worker.  Every wait is bounded."""

import os
import re
import signal
import time

import pytest

from cbatch import Engine, SamplingParams
from cbatch.core.structured_output import WorkersBusy
from cbatch.core.structured_output import pool as pool_module
from cbatch.sampling_params import StructuredOutputsParams

pytest.importorskip("xgrammar")


def heavy(k: int) -> dict:
    """A choice of 100,000 strings: its compile takes minutes (the tests stop it long
    before); ``k`` makes each one a constraint of its own (no shared compile)."""
    return {"choice": [f"option {k} number {i} of a long list" for i in range(100_000)]}


def _wait_for(condition, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _warm_engine(**kwargs) -> Engine:
    engine = Engine("random:tiny", grammar_compile_workers=2, **kwargs)
    engine.structured.warm_up()
    assert engine.structured.pool.wait_warm(120)
    return engine


def _step_until(engine: Engine, request_ids, timeout_s: float) -> dict:
    done, deadline = {}, time.monotonic() + timeout_s
    while not set(request_ids) <= set(done):
        assert time.monotonic() < deadline, f"not finished within {timeout_s} s: {done}"
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done


def test_warm_workers_take_the_first_constraint_and_a_killed_one_is_replaced_at_once():
    engine = _warm_engine()
    pool = engine.structured.pool
    pids = pool.worker_pids()
    assert len(pids) >= 2
    forked = pool.num_forked
    started = time.monotonic()
    rid = engine.add_request([1, 2], SamplingParams(
        max_tokens=8, structured_outputs={"regex": "[ab]{3}x"}))
    out = _step_until(engine, [rid], 60)[rid]
    assert re.fullmatch("[ab]{3}x", out.text)
    assert pool.num_forked == forked  # no process was started for it
    first = time.monotonic() - started
    os.kill(pids[0], signal.SIGKILL)  # as a crash or an operator would
    _wait_for(lambda: pids[0] not in pool.worker_pids()
              and len(pool.worker_pids()) == len(pids), timeout_s=10)
    assert pool.num_forked == forked + 1
    # a fork, not a cold start (xgrammar's import): ready long before a worker's start timeout
    assert time.monotonic() - started < first + 10


@pytest.mark.slow  # compiles that take minutes, stopped after seconds
def test_a_small_constraint_does_not_wait_behind_heavy_ones():
    """Four heavy constraints take both workers and queue behind them; a 3-character regex
    sent after them compiles within about QUICK_COMPILE_S (a heavy compile is stopped for it
    and queued again), and its request finishes while the heavy ones still compile."""
    engine = _warm_engine(grammar_compile_timeout=600)
    pool = engine.structured.pool
    heavies = [engine.add_request([1], SamplingParams(max_tokens=4, structured_outputs=heavy(k)))
               for k in range(4)]
    _wait_for(lambda: len(pool.busy_pids()) == 2)
    started = time.monotonic()
    quick = engine.add_request([1, 2], SamplingParams(max_tokens=8,
                                                      structured_outputs={"regex": "[ab]{3}"}))
    done = _step_until(engine, [quick], 30)
    assert re.fullmatch("[ab]{3}", done[quick].text)
    assert time.monotonic() - started < pool_module.QUICK_COMPILE_S + 15
    assert not set(heavies) & set(done) and pool.num_stopped >= 1
    for rid in heavies:  # their compiles are stopped: nobody waits for them
        engine.abort(rid)
    engine.step()
    _wait_for(lambda: not pool.busy_pids())


@pytest.mark.slow  # three compiles that would take minutes, each stopped at its budget
def test_a_jobs_budget_counts_its_wait_for_a_worker():
    """Three heavy constraints, two workers, a 2 s budget: all three are answered within
    about 2 s of their submission, the one that waited included (a 503's WorkersBusy, or
    refused as too slow), not 2 s after a worker came free."""
    structured = _warm_engine(grammar_compile_timeout=2.0).structured
    answered = {}
    tickets = []
    for k in range(3):
        ticket = structured.compile(StructuredOutputsParams(**heavy(k)))
        submitted = time.monotonic()
        ticket.future.add_done_callback(
            lambda f, k=k, t=submitted: answered.setdefault(k, (f, time.monotonic() - t)))
        tickets.append(ticket)
    _wait_for(lambda: len(answered) == 3, timeout_s=60)
    for future, waited in answered.values():
        assert waited < 2.0 + 1.5
        assert re.search(r"takes longer than this engine's limit of 2 s to compile|no grammar "
                         r"compile worker was free within this engine's limit of 2 s",
                         str(future.exception())), future.exception()
    for ticket in tickets:
        structured.release(ticket)


def test_a_job_that_never_got_a_worker_fails_as_workers_busy():
    job = pool_module.CompileJob("parse", ([("regex", "a")],), None, timeout=0.0)
    p = pool_module.CompilePool(1)
    p._expire(time.monotonic())  # not queued: nothing happens
    p._queue.append(job)
    p._expire(time.monotonic())
    with pytest.raises(WorkersBusy, match="no grammar compile worker was free within"):
        job.future.result(timeout=1)
