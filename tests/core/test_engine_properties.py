"""Property test: random arrivals, lengths and aborts against the engine's invariants."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbatch import LLM, Engine, SamplingParams, load_model
from tests.helpers import Arrival, run_arrivals


@pytest.fixture(scope="module")
def solo_model():
    return load_model("random:tiny")


request = st.tuples(
    st.integers(1, 30),  # prompt length
    st.integers(1, 12),  # max_tokens
    st.integers(0, 3),  # arrival step
    st.integers(0, 2),  # priority
    st.one_of(st.none(), st.integers(0, 6)),  # abort after this many steps (None: never)
)


@pytest.mark.slow
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(request, min_size=1, max_size=8),
       policy=st.sampled_from(["fcfs", "priority", "sjf"]),
       budget=st.integers(4, 64), num_blocks=st.integers(12, 40), seed=st.integers(0, 1000))
def test_every_request_finishes_once_and_matches_solo(solo_model, requests, policy, budget,
                                                      num_blocks, seed):
    engine = Engine("random:tiny", block_size=4, num_blocks=num_blocks, max_num_seqs=4,
                    max_num_batched_tokens=budget, scheduling_policy=policy)
    prompts = [[(seed + 7 * i + j) % 500 for j in range(n)] for i, (n, *_) in enumerate(requests)]
    arrivals = [Arrival(prompts[i], SamplingParams(max_tokens=m, ignore_eos=True), step,
                        prio, abort_after)
                for i, (n, m, step, prio, abort_after) in enumerate(requests)]
    finished = run_arrivals(engine, arrivals, max_steps=400)
    solo = LLM(solo_model)
    for i, out in finished.items():
        m = requests[i][1]
        expected = solo.generate([prompts[i]], SamplingParams(max_tokens=m, ignore_eos=True),
                                 use_tqdm=False)[0].token_ids
        if out.finish_reason == "abort":
            assert out.token_ids == expected[:len(out.token_ids)]
        else:
            assert out.finish_reason == "length" and out.token_ids == expected
