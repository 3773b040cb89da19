"""``LLM.generate``: what a prompt may be, and all-or-nothing calls (tiny random model, CPU)."""

import pytest

from cbatch import LLM, SamplingParams

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM("random:tiny", max_num_seqs=4, num_blocks=64)


@pytest.fixture(scope="module")
def static_llm():
    return LLM("random:tiny", max_num_seqs=4, scheduling_policy="static")


def assert_empty(llm):
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    engine.block_manager.check_whole()
    assert not engine.scheduler.waiting and not engine.scheduler.running


@pytest.mark.parametrize("prompts,params,exc,match", [
    (["ok", ""], PARAMS, ValueError, "prompt is empty"),
    (["ok", [1, 2, 512]], PARAMS, ValueError, r"token ids must be ints in \[0, 512\)"),
    (["ok", [1] * 300], PARAMS, ValueError, "exceeds the model's n_positions"),
    (["ok", 123], PARAMS, TypeError, r"prompts\[1\] is int 123: prompts must be a string, "
     "a list of token ids, or a list of those"),
    (["ok", "fine"], [PARAMS], ValueError, "got 1 SamplingParams for 2 prompts"),
    (["ok", "fine"], [PARAMS, "greedy"], TypeError, "params must be SamplingParams"),
    (["ok", [1] * 40], [PARAMS, SamplingParams(max_tokens=250)], ValueError,
     r"prompt \(40 tokens\) \+ max_tokens \(250\)"),
])
def test_a_bad_prompt_or_parameter_queues_nothing(llm, prompts, params, exc, match):
    with pytest.raises(exc, match=match):
        llm.generate(prompts, params, use_tqdm=False)
    assert_empty(llm)
    outs = llm.generate(["next"], PARAMS, use_tqdm=False)
    assert len(outs) == 1 and outs[0].prompt_token_ids == list(b"next")


def test_the_static_baseline_is_all_or_nothing_too(static_llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        static_llm.generate(["ok", ""], PARAMS, use_tqdm=False)
    outs = static_llm.generate(["next"], PARAMS, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [list(b"next")]


def test_priorities_must_match_the_prompts(llm):
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        llm.generate(["a", "b"], PARAMS, use_tqdm=False, priorities=[0])
    assert_empty(llm)


@pytest.mark.parametrize("error", [RuntimeError("device lost"), KeyboardInterrupt()])
def test_an_error_in_a_step_aborts_the_calls_requests(llm, monkeypatch, error):
    """A failing forward pass on the third step (some requests running, some waiting)
    leaves the engine empty with every block free, and the next call is unaffected."""
    prompts = [[1, 2, 3], "hello", [7] * 20, "a longer prompt than the others", [9], "x"]
    expected = llm.generate(prompts, PARAMS, use_tqdm=False)
    model = llm.engine.model
    calls = []

    def failing_forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise error
        return type(model).forward(model, *args, **kwargs)

    monkeypatch.setattr(model, "forward", failing_forward)
    with pytest.raises(type(error)):
        llm.generate(prompts, PARAMS, use_tqdm=False)
    assert len(calls) == 3
    assert_empty(llm)
    monkeypatch.undo()
    again = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert [o.token_ids for o in again] == [o.token_ids for o in expected]
    assert_empty(llm)


def test_one_prompt_or_a_list_of_prompts(llm):
    """A string or a list of token ids is one prompt; a list of those is several."""
    [one] = llm.generate("hi", PARAMS, use_tqdm=False)
    assert one.prompt_token_ids == list(b"hi")
    [ids] = llm.generate([123], PARAMS, use_tqdm=False)
    assert ids.prompt_token_ids == [123]
    mixed = llm.generate(["hi", [104, 105], (5, 6)], PARAMS, use_tqdm=False)
    assert [o.prompt_token_ids for o in mixed] == [[104, 105], [104, 105], [5, 6]]
    assert mixed[0].token_ids == mixed[1].token_ids == one.token_ids
    assert llm.generate([], PARAMS, use_tqdm=False) == []
    for bad in (123, None, {"prompt": "hi"}):
        with pytest.raises(TypeError, match="prompts must be a string, a list of token ids, "
                                            "or a list of those"):
            llm.generate(bad, PARAMS, use_tqdm=False)
    assert_empty(llm)
