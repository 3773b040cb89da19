"""The CPU thread policy: fixed counts, the caller's count restored, and the choice from the
load that other processes put on the allowed cores (a fake /proc/stat clock)."""

import pytest
import torch

from cbatch import LLM, SamplingParams
from cbatch.core.cpu import threads as cpu_threads
from cbatch.core.cpu.threads import ThreadPolicy


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


class FakeClock:
    """Monotonic time, busy CPU seconds on the allowed cores, and this process's CPU time,
    advanced by hand."""

    def __init__(self, monkeypatch, cpus=2):
        self.now = self.busy = self.mine = 0.0
        monkeypatch.setattr(cpu_threads, "allowed_cpus", lambda: list(range(cpus)))
        monkeypatch.setattr(cpu_threads, "busy_seconds", lambda cpus: self.busy)
        monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(cpu_threads.time, "process_time", lambda: self.mine)

    def advance(self, seconds, others_cores, my_cores):
        self.now += seconds
        self.mine += seconds * my_cores
        self.busy += seconds * (others_cores + my_cores)


@pytest.mark.usefixtures("two_threads")
def test_threads_follow_the_cores_others_leave_free(monkeypatch):
    clock = FakeClock(monkeypatch)
    policy = ThreadPolicy()
    assert policy.adaptive
    # (each step's count is chosen at its start, from the load measured before it)
    for threads, seconds, others, why in [
            (2, 0.5, 1.0, "nothing measured yet: every core; a busy loop holds one core"),
            (1, 0.1, 0.0, "it stopped, but too soon to sample again"),
            (1, 0.5, 0.1, "it stopped"),
            (2, 0.5, 0.3, "a light client beside"),
            (2, 0.5, 0.5, "half a core taken"),
            (1, 0.5, 3.0, "oversubscribed"),
            (1, 2.0, 1.0, "a step of 2 s beside a busy loop"),
            (1, 0.1, 1.0, "is not a pause: still measured")]:
        with policy.step() as n:
            assert n == threads, why
            clock.advance(seconds, others_cores=others, my_cores=threads)
    # the engine idles 5 s while a client prepares its next burst on one core: that says
    # little of the load beside the burst, so every core again, then measured afresh
    clock.advance(5.0, others_cores=1.0, my_cores=0.0)
    with policy.step() as n:
        assert n == 2
        clock.advance(0.3, others_cores=1.0, my_cores=1.0)
    with policy.step() as n:
        assert n == 1


@pytest.mark.usefixtures("two_threads")
def test_fixed_threads_and_the_ceiling(monkeypatch):
    clock = FakeClock(monkeypatch)
    assert ThreadPolicy(threads=1).choose() == 1
    assert not ThreadPolicy(adaptive=False).adaptive
    torch.set_num_threads(1)  # the caller's count (--threads) is the ceiling
    policy = ThreadPolicy()
    clock.advance(1.0, others_cores=0.0, my_cores=1.0)
    assert policy.choose() == 1


@pytest.mark.usefixtures("two_threads")
def test_engine_steps_run_with_the_chosen_count_and_restore_the_callers():
    llm = LLM("random:tiny", threads=1)
    seen = []
    model = llm.engine.model
    forward = model.forward

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return forward(*args, **kwargs)

    model.forward = spy
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == 2
    assert llm.engine.runner.threads.steps_by_threads[1] == len(seen)


def test_threads_must_be_positive():
    with pytest.raises(ValueError, match="threads must be >= 1"):
        LLM("random:tiny", threads=0)
