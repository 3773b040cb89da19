"""The continuous-batching engine end to end on a tiny GPT-2 (fp32, CPU)."""

import pytest
import torch

from cbatch import LLM, Engine, SamplingParams
from tests.helpers import STRESS_CONFIGS, triton_device, triton_skip_reason

PROMPT_LENS = [3, 17, 40, 1, 9, 25]
MAX_TOKENS = [12, 5, 9, 16, 1, 7]


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 511, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def hf_greedy(tiny_hf_model, prompts):
    """transformers' greedy continuation of each prompt, alone."""
    outs = []
    for prompt, m in zip(prompts, MAX_TOKENS):
        with torch.no_grad():
            ref = tiny_hf_model.generate(torch.tensor([prompt]), max_new_tokens=m,
                                         min_new_tokens=m, do_sample=False,
                                         pad_token_id=511, eos_token_id=None)
        outs.append(ref[0, len(prompt):].tolist())
    return outs


def _params():
    return [SamplingParams(max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]


CONFIGS = STRESS_CONFIGS


@pytest.mark.parametrize("policy", ["fcfs", "priority", "sjf"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_matches_transformers_and_solo(tiny_hf_dir, prompts, hf_greedy, policy, config):
    llm = LLM(str(tiny_hf_dir), scheduling_policy=policy, **CONFIGS[config])
    outs = llm.generate(prompts, _params(), use_tqdm=False, priorities=[3, 1, 2, 0, 5, 4])
    assert [o.token_ids for o in outs] == hf_greedy
    assert all(o.finished and o.finish_reason == "length" for o in outs)
    engine = llm.engine
    engine.block_manager.check_whole()
    if config == "preempting":
        assert engine.stats().num_preemptions > 0
    if config == "chunked-prefill":
        assert max(engine.occupancy_trace) >= 2  # prefill chunks shared steps with decodes
    solo = LLM(str(tiny_hf_dir), **CONFIGS["roomy"])
    for prompt, p, out in zip(prompts, _params(), outs):
        assert solo.generate([prompt], p, use_tqdm=False)[0].token_ids == out.token_ids


def test_static_baseline_matches_continuous(tiny_hf_dir, prompts, hf_greedy):
    static = LLM(str(tiny_hf_dir), scheduling_policy="static", max_num_seqs=4)
    outs = static.generate(prompts, _params(), use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_greedy
    # each fixed batch runs to its longest request: 16 steps for the first, 7 for the second
    assert len(static.occupancy_trace) == max(MAX_TOKENS[:4]) + max(MAX_TOKENS[4:])


def test_streaming_outputs_and_metrics():
    engine = Engine("random:tiny", max_num_seqs=4)
    a = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    b = engine.add_request("hi there", SamplingParams(max_tokens=2, ignore_eos=True))
    seen = {a: [], b: []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.token_ids[:len(seen[out.request_id])] == seen[out.request_id]
            assert len(out.token_ids) == len(seen[out.request_id]) + 1  # one token per step
            seen[out.request_id] = out.token_ids
            last = out
            if out.finished:
                m = out.metrics
                assert m.queue_time >= 0 and m.ttft >= m.queue_time and m.e2e >= m.ttft
                assert m.tpot >= 0 and m.num_preemptions == 0
    assert len(seen[a]) == 4 and len(seen[b]) == 2 and last.finished
    stats = engine.stats()
    assert stats.num_finished == 2 and stats.num_output_tokens == 6
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
    assert stats.output_tokens_per_s > 0
    assert set(stats.phase_s) == {"schedule", "prepare", "execute", "postprocess"}
    assert all(t >= 0 for t in stats.phase_s.values())
    assert sum(stats.phase_s.values()) == pytest.approx(stats.elapsed, rel=1e-6)
    assert 0 <= stats.host_overhead < 1


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_not_streamed_has_one_output_the_same(async_scheduling):
    engine = Engine("random:tiny", max_num_seqs=4, async_scheduling=async_scheduling)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    streamed = engine.add_request([1, 2, 3], params)
    quiet = engine.add_request([1, 2, 3], params, stream=False)
    outs = {streamed: [], quiet: []}
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outs[out.request_id].append(out)
    assert len(outs[streamed]) == 5 and len(outs[quiet]) == 1 and outs[quiet][0].finished
    assert outs[quiet][0].token_ids == outs[streamed][-1].token_ids


def test_outputs_are_snapshots_and_the_model_is_frozen_for_the_gc():
    import gc

    engine = Engine("random:tiny", max_num_seqs=2)
    assert gc.get_freeze_count() > 0  # the model and libraries are out of the collector's way
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    first = engine.step()[0]
    snapshot = list(first.token_ids)
    while engine.has_unfinished_requests():
        engine.step()
    assert first.token_ids == snapshot and len(snapshot) == 1  # later steps did not touch it


def test_a_dropped_engine_is_freed_without_the_collector():
    """Objects frozen by an engine start-up are never collected as cycles, so an engine (its
    model and KV cache) must not sit in a reference cycle: dropping it frees it at once."""
    import gc
    import weakref

    engine = Engine("random:tiny", max_num_seqs=2)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    refs = [weakref.ref(o) for o in (engine, engine.model, engine.kv_cache, engine.scheduler)]
    gc.disable()
    try:
        del engine
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


def test_abort_mid_run_keeps_serving_others():
    engine = Engine("random:tiny", max_num_seqs=4)
    p = SamplingParams(max_tokens=10, ignore_eos=True)
    ids = [engine.add_request([5, 6, 7 + i], p) for i in range(3)]
    engine.step()
    engine.step()
    engine.abort(ids[1])
    with pytest.raises(KeyError, match="no unfinished request"):
        engine.abort(ids[1])
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished[ids[1]].finish_reason == "abort" and len(finished[ids[1]].token_ids) == 2
    assert finished[ids[0]].finish_reason == finished[ids[2]].finish_reason == "length"
    engine.block_manager.check_whole()


def test_stop_tokens_and_eos():
    engine = Engine("random:tiny")
    probe = LLM("random:tiny").generate([[1, 2, 3]], SamplingParams(max_tokens=6,
                                                                    ignore_eos=True),
                                        use_tqdm=False)[0].token_ids
    rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=6, stop_token_ids=[probe[2]],
                                                       ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid and o.finished]
    first = probe.index(probe[2])
    assert outs[0].finish_reason == "stop" and outs[0].token_ids == probe[:first + 1]


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(prompt=[]), ValueError, "prompt is empty"),
    (dict(prompt=""), ValueError, "prompt is empty"),
    (dict(prompt=[1, 2, 512]), ValueError, r"prompt token ids must be ints in \[0, 512\)"),
    (dict(prompt=[1] * 250, params=SamplingParams(max_tokens=10)), ValueError,
     r"prompt \(250 tokens\) \+ max_tokens \(10\) = 260 exceeds the model's maximum "
     r"length \(256\)"),
    (dict(prompt=[1], params="greedy"), TypeError, "SamplingParams"),
])
def test_bad_requests_are_refused_and_the_engine_keeps_serving(kwargs, exc, match):
    engine = Engine("random:tiny", num_blocks=64)
    good = engine.add_request([1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
    with pytest.raises(exc, match=match):
        engine.add_request(**kwargs)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == [good]


def test_duplicate_id_and_oversized_request():
    engine = Engine("random:tiny", block_size=4, num_blocks=4)
    engine.add_request([1, 2], SamplingParams(max_tokens=3), request_id="x")
    with pytest.raises(ValueError, match="request_id 'x' is already in use"):
        engine.add_request([1, 2], SamplingParams(max_tokens=3), request_id="x")
    with pytest.raises(ValueError, match="needs 5 KV blocks but the pool has only 4"):
        engine.add_request([1] * 10, SamplingParams(max_tokens=10))


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), "max_tokens must be an int >= 1"),
    (dict(temperature=-0.1), "temperature must be a number in \\[0, 3.4e38\\]"),
    (dict(top_p=0.0), r"top_p must be a number in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be a number in \(0, 1\]"),
    (dict(top_k=-2), "top_k must be -1 or 0 \\(off\\)"),
])
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(scheduling_policy="lifo"), "scheduling_policy must be one of"),
    (dict(dtype="int8"), "dtype must be float32"),
    (dict(max_num_seqs=0), "max_num_seqs must be >= 1"),
    (dict(kv_cache_memory=1.5), "kv_cache_memory"),
])
def test_engine_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Engine("random:tiny", **kwargs)


def test_policies_order_admission():
    """With one sequence slot, the policy alone decides who runs first."""
    for policy, expected in [("fcfs", ["a", "b", "c"]), ("priority", ["c", "a", "b"]),
                             ("sjf", ["b", "c", "a"])]:
        engine = Engine("random:tiny", max_num_seqs=1, scheduling_policy=policy)
        for rid, prio, n in [("a", 1, 5), ("b", 2, 2), ("c", 0, 3)]:
            engine.add_request([1, 2, 3], SamplingParams(max_tokens=n, ignore_eos=True), prio, rid)
        order = []
        while engine.has_unfinished_requests():
            order += [o.request_id for o in engine.step() if o.finished]
        assert order == expected, policy


@pytest.mark.parametrize("backend", ["torch", "cpu",
                                     pytest.param("triton", marks=pytest.mark.slow)])
def test_every_attention_backend_serves_the_engine(tiny_hf_dir, prompts, hf_greedy, backend):
    """Chunked prefill mixed with decodes, preemption, through each backend's kernels
    (Triton in its interpreter without a GPU)."""
    from cbatch import ops

    if not ops.available_backends()[backend].available:
        pytest.skip(ops.available_backends()[backend].detail)
    device = "cpu"
    if backend == "triton":  # on the GPU, or on CPU tensors in Triton's interpreter
        device = triton_device()
        if device is None:
            pytest.skip(triton_skip_reason())
    llm = LLM(str(tiny_hf_dir), device=device, attention_backend=backend, max_num_seqs=6,
              max_num_batched_tokens=9, block_size=4, num_blocks=20)
    outs = llm.generate(prompts, _params(), use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_greedy
    llm.engine.block_manager.check_whole()


def test_checkpoint_tokenizer_round_trip(tiny_hf_dir, tmp_path):
    """A checkpoint with a tokenizer.json gets it: strings in, text out."""
    import shutil

    from tokenizers import ByteLevelBPETokenizer

    path = tmp_path / "with-tokenizer"
    shutil.copytree(tiny_hf_dir, path)
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50,
                            vocab_size=300, min_frequency=1)
    tok.save(str(path / "tokenizer.json"))
    llm = LLM(str(path))
    assert type(llm.tokenizer).__name__ == "HFTokenizer"
    ids = llm.tokenizer.encode("the quick fox")
    assert llm.tokenizer.decode(ids) == "the quick fox"
    out = llm.generate(["the quick fox"], SamplingParams(max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == ids and out.text == llm.tokenizer.decode(out.token_ids)
