"""Property test: random arrivals, lengths and aborts against the engine's invariants."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbatch import Engine, SamplingParams
from cbatch.models.gpt2 import GPT2LMHeadModel


@pytest.fixture(scope="module")
def solo_model():
    return GPT2LMHeadModel.from_pretrained("random:tiny")


request = st.tuples(
    st.integers(1, 30),  # prompt length
    st.integers(1, 12),  # max_tokens
    st.integers(0, 3),  # arrival step
    st.integers(0, 2),  # priority
    st.one_of(st.none(), st.integers(0, 6)),  # abort after this many steps (None: never)
)


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
    ids, aborts, finished = {}, {}, {}
    step = 0
    while step < 400:
        for i, (n, m, arrival, prio, abort_after) in enumerate(requests):
            if arrival == step:
                rid = engine.add_request(prompts[i], SamplingParams(max_tokens=m, ignore_eos=True),
                                         priority=prio)
                ids[rid] = i
                if abort_after is not None:
                    aborts[rid] = step + abort_after
        for rid, when in list(aborts.items()):
            if when == step and rid not in finished:
                engine.abort(rid)
                del aborts[rid]
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finished, "finished twice"
                finished[out.request_id] = out
        step += 1
        if step > 3 and not engine.has_unfinished_requests():
            break
    assert set(finished) == set(ids), "every request finishes exactly once"
    engine.block_manager.check_whole()
    for rid, out in finished.items():
        i = ids[rid]
        m = requests[i][1]
        expected = solo_model.generate([prompts[i]], max_new_tokens=m)[0]
        if out.finish_reason == "abort":
            assert out.token_ids == expected[:len(out.token_ids)]
        else:
            assert out.finish_reason == "length" and out.token_ids == expected
