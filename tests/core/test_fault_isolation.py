"""Fault isolation in the engine (issue 23): sampling parameters the step cannot run are
refused up front, an error of one request ends that request alone (the pool stays whole),
an error of the step kills the async engine loudly, aborts end streams, and CUDA graphs
that fail or disagree with the eager forward fall back to eager."""

import asyncio

import pytest

from cbatch import LLM, Engine, SamplingParams
from cbatch.core.async_engine import AsyncEngine, EngineDeadError
from cbatch.core.detokenizer import IncrementalDetokenizer
from tests.helpers import fail_forward_at

KW = dict(max_num_seqs=8, seed=0)


# ------------------------------------------------------------------ findings 1 and 2


@pytest.mark.parametrize("field, value", [
    ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", -0.5),
    ("temperature", "1"), ("top_p", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", 2**63), ("top_k", 2**31 + 1), ("top_k", -2), ("top_k", 1.5), ("top_k", True),
    ("seed", 1.5), ("seed", "abc"), ("seed", -1), ("seed", 2**64), ("max_tokens", 2.0),
    ("logprobs", -1), ("logprobs", 1.0), ("stop_token_ids", ["a"]), ("stop", 5),
])
def test_sampling_params_refuse_what_the_step_cannot_run_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.slow
def test_sampling_params_edges_that_run():
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's "off"
    assert SamplingParams(top_k=2**31, seed=2**64 - 1, temperature=1).top_k == 2**31
    llm = LLM("random:tiny", **KW)
    # a top_k beyond the vocabulary is every token (the sampler clamps it)
    big, off = (llm.generate([[1, 2, 3]], SamplingParams(max_tokens=6, temperature=1.0,
                                                         top_k=k, seed=2**64 - 1,
                                                         ignore_eos=True), use_tqdm=False)[0]
                for k in (2**31, 0))
    assert big.token_ids == off.token_ids and len(big.token_ids) == 6


def test_logprobs_above_max_logprobs_are_refused():
    engine = Engine("random:tiny", max_logprobs=3, **KW)
    with pytest.raises(ValueError, match="max_logprobs"):
        engine.add_request([1, 2], SamplingParams(logprobs=4))
    engine.add_request([1, 2], SamplingParams(logprobs=3, max_tokens=2))
    with pytest.raises(ValueError, match="max_logprobs"):  # 10**6 > the default 20 too
        Engine("random:tiny", **KW).add_request([1], SamplingParams(logprobs=10**6))
    with pytest.raises(ValueError, match="max_logprobs"):
        Engine("random:tiny", max_logprobs=-2, **KW)
    # -1: the whole vocabulary, as in vLLM
    Engine("random:tiny", max_logprobs=-1, **KW).add_request([1], SamplingParams(logprobs=512))
    with pytest.raises(ValueError, match="max_logprobs"):
        Engine("random:tiny", max_logprobs=-1, **KW).add_request([1], SamplingParams(
            logprobs=513))


def test_a_prompt_list_longer_than_the_model_is_refused_before_it_is_read():
    class Poison(int):  # any per-element range check of this list would raise here
        def __ge__(self, other):
            raise AssertionError("an element was read")

    engine = Engine("random:tiny", **KW)
    with pytest.raises(ValueError, match="maximum length"):
        engine.add_request([Poison(1)] * 10**6, SamplingParams())


def test_bad_params_through_the_async_engine_leave_it_serving():
    async def main():
        engine = AsyncEngine("random:tiny", **KW)
        for params in (dict(logprobs=10**6), dict(max_tokens=3)):
            if "logprobs" in params:
                with pytest.raises(ValueError, match="max_logprobs"):
                    await engine.add_request([1, 2], SamplingParams(**params))
            else:
                outs = [o async for o in engine.generate([1, 2], SamplingParams(**params))]
        assert engine.is_running and outs[-1].finish_reason == "length"
        await asyncio.to_thread(engine.shutdown)

    asyncio.run(main())


def test_a_slow_to_tokenise_prompt_stalls_no_other_request(monkeypatch):
    async def main():
        engine = AsyncEngine("random:tiny", **KW)
        encode = engine.tokenizer.encode
        release = asyncio.Event()
        loop = asyncio.get_running_loop()

        def slow(text):  # a huge prompt: the tokenizer works while others are served
            if text.startswith("huge"):
                asyncio.run_coroutine_threadsafe(release.wait(), loop).result(timeout=60)
            return encode(text)

        monkeypatch.setattr(engine.tokenizer, "encode", slow)
        huge = asyncio.create_task(engine.add_request("huge prompt", SamplingParams()))
        others = [o async for o in engine.generate([1, 2], SamplingParams(max_tokens=4))]
        assert others[-1].finish_reason == "length" and not huge.done()
        release.set()
        stream = await asyncio.wait_for(huge, 60)
        outs = [o async for o in stream]
        await asyncio.to_thread(engine.shutdown)
        return outs

    assert asyncio.run(main())[-1].finished


# ------------------------------------------------------------------ per-request faults


def _fail_detokenizing(monkeypatch, prompt: list[int], after: int) -> None:
    """Make the detokenizer of the request whose prompt is ``prompt`` raise once it has
    ``after`` output tokens to decode."""
    advance = IncrementalDetokenizer._advance

    def faulty(self, num_tokens):
        if (self.token_ids[:self.num_prompt_tokens] == prompt
                and num_tokens - self.num_prompt_tokens >= after):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected fault")
        return advance(self, num_tokens)

    monkeypatch.setattr(IncrementalDetokenizer, "_advance", faulty)


def _params(i):
    return SamplingParams(max_tokens=8 + 3 * i, temperature=0.8, seed=10 + i, ignore_eos=True)


BAD = [9, 9, 9]


@pytest.mark.slow
@pytest.mark.parametrize("stop", [[], ["zz"]])  # text read by the caller / by stop checks
def test_a_request_whose_detokenizer_raises_mid_stream_fails_alone(monkeypatch, stop):
    prompts = [[i + 1, 2, 3] for i in range(6)]
    reference = LLM("random:tiny", **KW).generate(prompts, [_params(i) for i in range(6)],
                                                  use_tqdm=False)
    _fail_detokenizing(monkeypatch, BAD, after=3)

    async def collect(engine, prompt, params):
        return [o async for o in engine.generate(prompt, params)]

    async def main():
        engine = AsyncEngine("random:tiny", **KW)
        bad = SamplingParams(max_tokens=40, temperature=0.8, seed=1, ignore_eos=True,
                             stop=stop)
        results = await asyncio.gather(collect(engine, BAD, bad),
                                       *[collect(engine, p, _params(i))
                                         for i, p in enumerate(prompts)])
        assert engine.is_running
        again = await collect(engine, prompts[0], _params(0))  # serving goes on
        stats = engine.stats
        await asyncio.to_thread(engine.shutdown)  # checks that every KV block is free
        return results, again, stats

    (failed, *others), again, stats = asyncio.run(main())
    last = failed[-1]
    assert last.finished and last.finish_reason == "error" and last.text == ""
    assert "injected fault" in last.error and len(last.token_ids) < 40
    assert all(not o.finished for o in failed[:-1])
    for outs, ref in zip(others, reference):
        assert outs[-1].token_ids == ref.token_ids and outs[-1].text == ref.text
    assert again[-1].token_ids == reference[0].token_ids
    assert stats.num_running == stats.num_waiting == 0


def test_a_failing_stop_string_check_ends_only_its_request_in_the_sync_engine(monkeypatch):
    _fail_detokenizing(monkeypatch, BAD, after=2)
    engine = Engine("random:tiny", **KW)
    bad = engine.add_request(BAD, SamplingParams(max_tokens=30, stop=["q"], ignore_eos=True))
    good = engine.add_request([1, 2], SamplingParams(max_tokens=30, ignore_eos=True))
    finals = {}
    for _ in range(200):
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert finals[bad].finish_reason == "error" and "injected fault" in finals[bad].error
    assert finals[good].finish_reason == "length" and len(finals[good].token_ids) == 30
    engine.block_manager.check_whole()


def test_a_failing_step_kills_the_async_engine_loudly(monkeypatch, caplog):
    dead = []

    async def main():
        engine = AsyncEngine("random:tiny", on_dead=dead.append, **KW)
        fail_forward_at(monkeypatch, engine.engine.model, 3, RuntimeError("boom"))
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate([1, 2], SamplingParams(max_tokens=20,
                                                                  ignore_eos=True)):
                pass
        assert not engine.is_running and "boom" in str(engine.error)
        with pytest.raises(EngineDeadError):
            await engine.add_request([1], SamplingParams())
        await asyncio.to_thread(engine.shutdown)

    asyncio.run(main())
    assert len(dead) == 1 and "boom" in str(dead[0])
    assert "engine loop failed" in caplog.text


# ------------------------------------------------------------------ finding 6


def test_abort_by_request_id_ends_the_stream_with_reason_abort():
    async def main():
        engine = AsyncEngine("random:tiny", **KW)
        stream = await engine.add_request([1, 2, 3], SamplingParams(max_tokens=200,
                                                                   ignore_eos=True))
        first = await asyncio.wait_for(anext(stream), 30)
        engine.abort(stream.request_id)
        rest = await asyncio.wait_for(_drain(stream), 30)
        await asyncio.to_thread(engine.shutdown)  # every block free again
        return first, rest

    first, rest = asyncio.run(main())
    assert not first.finished
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert len(rest[-1].token_ids) < 200


async def _drain(stream):
    return [o async for o in stream]


# ------------------------------------------------------------------ CUDA graphs


class _FakeGraph:
    """Stands in for a captured CUDA graph on the CPU: replays into ``logits``."""

    def __init__(self, logits, fail=False):
        self.logits, self.fail = logits, fail

    def replay(self):
        if self.fail:
            raise RuntimeError("replay failed")


def _greedy(llm, n=4):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    return [o.token_ids for o in llm.generate([[i + 1, 2] for i in range(n)], params,
                                              use_tqdm=False)]


@pytest.mark.slow
def test_graph_capture_failure_falls_back_to_eager(monkeypatch):
    eager = _greedy(LLM("random:tiny", cuda_graphs=False, **KW))
    llm = LLM("random:tiny", cuda_graphs=True, **KW)  # CPU: padded eager batches
    runner = llm.engine.runner

    def capture():
        raise RuntimeError("capture failed")

    monkeypatch.setattr(runner, "capture_graphs", capture)
    with pytest.warns(RuntimeWarning, match="capture failed.*eagerly"):
        runner.setup_graphs()
    assert runner.buckets == [] and runner._graphs == {}
    assert _greedy(llm) == eager


@pytest.mark.slow
def test_graphs_whose_replay_disagrees_with_eager_are_dropped_at_start_up(monkeypatch):
    engine = Engine("random:tiny", cuda_graphs=True, **KW)
    runner = engine.runner
    vocab = engine.model.config.vocab_size

    def capture():  # one graph per shape, the largest replaying garbage
        for size, q in runner.graph_shapes():
            batch = runner.builder.build([], pad_to=size, full_width=True, query_len=q)
            logits = engine.model.compute_logits(engine.model(batch, engine.kv_cache))
            if size == runner.buckets[-1]:
                logits = logits + 1.0
            runner._graphs[size, q] = (_FakeGraph(logits), logits)

    monkeypatch.setattr(runner, "capture_graphs", capture)
    with pytest.warns(RuntimeWarning, match="away from the eager forward"):
        runner.setup_graphs()
    assert runner._graphs == {} and runner.buckets == [] == runner.verify_buckets
    # graphs that agree are kept, those of steps verifying 2 drafts too
    engine2 = Engine("random:tiny", cuda_graphs=True, **KW, speculative_config={
        "method": "ngram", "num_speculative_tokens": 2})
    runner = engine2.runner
    monkeypatch.setattr(runner, "capture_graphs", lambda: [
        runner._graphs.__setitem__((s, q), (_FakeGraph(None), engine2.model.compute_logits(
            engine2.model(runner.builder.build([], pad_to=s, full_width=True, query_len=q),
                          engine2.kv_cache)))) for s, q in runner.graph_shapes()])
    runner.setup_graphs()
    assert sorted(runner._graphs) == sorted(runner.graph_shapes()) and vocab > 0
    assert {q for _, q in runner._graphs} == {1, 3}


@pytest.mark.slow
def test_a_graph_replay_that_raises_mid_serving_falls_back_to_eager(monkeypatch):
    # greedy steps on a CPU take the lm_head's screen, not the logits a graph replays
    monkeypatch.setenv("CBATCH_GREEDY_SCREEN", "0")
    eager = _greedy(LLM("random:tiny", cuda_graphs=False, **KW))
    llm = LLM("random:tiny", cuda_graphs=True, **KW)
    runner = llm.engine.runner
    for shape in runner.graph_shapes():
        runner._graphs[shape] = (_FakeGraph(None, fail=True), None)
    with pytest.warns(RuntimeWarning, match="replay failed.*eagerly"):
        got = _greedy(llm)
    assert got == eager and runner._graphs == {} and runner.buckets == []


# ------------------------------------------------------- issue 48: a row's own step error

POISON_SEED, POISON_TOKEN = 424242, 77


def _poison(monkeypatch, where: str, calls: list) -> None:
    """Make the sampler raise for the poisoned request's row alone: in its draw (its seed)
    or in its logits processing (its logit_bias names POISON_TOKEN).  ``calls`` gets the
    number of rows of every call."""
    from cbatch.core import sampler

    if where == "draw":
        draw = sampler._draw

        def faulty_draw(logits, rows, batch):
            calls.append(len(rows))
            if any(batch.seeds[r] == POISON_SEED for r in rows):
                raise RuntimeError("injected fault in the draw")
            return draw(logits, rows, batch)

        monkeypatch.setattr(sampler, "_draw", faulty_draw)
    else:
        apply = sampler.apply_rules

        def faulty_rules(logits, rules, bitmask):
            calls.append(logits.shape[0])
            if rules is not None and POISON_TOKEN in rules.bias[1]:
                raise RuntimeError("injected fault in the logits rules")
            return apply(logits, rules, bitmask)

        monkeypatch.setattr(sampler, "apply_rules", faulty_rules)


def _step_path(monkeypatch, path: str) -> dict:
    """Engine keywords and patches for the CPU's step path or the one CUDA uses: the torch
    rules and draw (no C++ sampler), async scheduling and the padded shapes of graphs."""
    if path == "cpu":
        return {}
    from types import SimpleNamespace

    from cbatch.ops import sampling

    monkeypatch.setattr(sampling, "compiled", SimpleNamespace(compiled_backends=lambda: ()))
    return dict(async_scheduling=True, cuda_graphs=True)


def _workload(poisoned: bool) -> list[tuple[list[int], SamplingParams]]:
    common = dict(max_tokens=12, ignore_eos=True)
    work = [([1, 2, 3], SamplingParams(temperature=0.9, seed=1, **common)),
            ([4, 5], SamplingParams(**common)),  # greedy
            ([6, 7, 8, 9], SamplingParams(temperature=0.7, top_p=0.9, seed=2,
                                          repetition_penalty=1.3, logit_bias={5: 2.0},
                                          **common))]
    if poisoned:
        work.insert(1, ([3, 3], SamplingParams(temperature=1.0, seed=POISON_SEED,
                                               logit_bias={POISON_TOKEN: 0.5}, **common)))
    return work


def _run(engine: Engine, work) -> dict[str, object]:
    ids = [engine.add_request(prompt, params) for prompt, params in work]
    finals = {}
    for _ in range(500):
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    return [finals[i] for i in ids]


@pytest.mark.parametrize("path", ["cpu", "cuda-path"])
@pytest.mark.parametrize("where", ["draw", "rules"])
def test_a_row_whose_sampling_raises_ends_its_request_alone(monkeypatch, path, where):
    from cbatch.ops import sampling

    kw = {**KW, **_step_path(monkeypatch, path)}
    reference = _run(Engine("random:tiny", **kw), _workload(poisoned=False))
    calls: list[int] = []
    _poison(monkeypatch, where, calls)
    drawn = []
    if path == "cuda-path":  # the draw that runs is the torch one, not the C++ kernel
        ref = sampling.reference_draw
        monkeypatch.setattr(sampling, "reference_draw",
                            lambda *a: drawn.append(1) or ref(*a))
    engine = Engine("random:tiny", **kw)
    outs = _run(engine, _workload(poisoned=True))
    bad = outs.pop(1)
    assert bad.finish_reason == "error" and "injected fault" in bad.error
    assert len(bad.token_ids) == 0
    for out, want in zip(outs, reference):  # the others: the tokens they would have had
        assert out.finish_reason == "length" and out.token_ids == want.token_ids
    assert max(calls) > 1 and 1 in calls  # a batch raised, then rows were sampled apart
    assert (path == "cuda-path") == bool(drawn)
    again = _run(engine, _workload(poisoned=False)[:1])  # and it serves on
    assert again[0].token_ids == reference[0].token_ids
    engine.block_manager.check_whole()


def test_a_row_whose_rules_cannot_be_built_ends_its_request_alone(monkeypatch):
    from cbatch.core.sampler import TokenCounts

    slot = TokenCounts.slot

    def faulty_slot(self, seq):
        if seq.params.seed == POISON_SEED:
            raise RuntimeError("injected fault in the token counts")
        return slot(self, seq)

    monkeypatch.setattr(TokenCounts, "slot", faulty_slot)
    work = _workload(poisoned=True)
    work[1][1].repetition_penalty = 1.2  # the poisoned request asks for a penalty too
    reference = _run(Engine("random:tiny", **KW), _workload(poisoned=False))
    outs = _run(Engine("random:tiny", **KW), work)
    bad = outs.pop(1)
    assert bad.finish_reason == "error" and "token counts" in bad.error
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]


@pytest.mark.parametrize("field, value, match", [
    ("logprobs", 513, "max_logprobs"), ("prompt_logprobs", 21, "max_prompt_logprobs"),
    ("prompt_logprobs", 10**6, "max_prompt_logprobs")])
def test_logprobs_and_prompt_logprobs_are_bounded_by_the_engine(field, value, match):
    engine = Engine("random:tiny", max_logprobs=-1, **KW)
    with pytest.raises(ValueError, match=match):
        engine.add_request([1, 2], SamplingParams(**{field: value}))
    # -1: the whole vocabulary (512), never more
    Engine("random:tiny", max_prompt_logprobs=-1, **KW).add_request(
        [1, 2], SamplingParams(prompt_logprobs=512, max_tokens=1))
    with pytest.raises(ValueError, match="max_prompt_logprobs"):
        Engine("random:tiny", max_prompt_logprobs=-1, **KW).add_request(
            [1, 2], SamplingParams(prompt_logprobs=513))


def test_prompt_logprob_entries_of_a_request_are_bounded(monkeypatch):
    from cbatch import sampling_params

    monkeypatch.setattr(sampling_params, "MAX_PROMPT_LOGPROB_ENTRIES", 1000)  # tiny's scale
    engine = Engine("random:tiny", **KW)
    with pytest.raises(ValueError, match="1010 prompt-logprob entries"):
        engine.add_request([1] * 101, SamplingParams(prompt_logprobs=9, max_tokens=1))
    engine.add_request([1] * 100, SamplingParams(prompt_logprobs=9, max_tokens=1))

    async def main():  # all the prompts and choices of a request together
        engine = AsyncEngine("random:tiny", **KW)
        params = SamplingParams(prompt_logprobs=9, max_tokens=1)
        try:
            with pytest.raises(ValueError, match="1200 prompt-logprob entries"):
                await engine.add_requests([[1] * 40] * 3, [params] * 3)
            # truncated prompts count the tokens they keep
            short = SamplingParams(prompt_logprobs=9, max_tokens=1, truncate_prompt_tokens=30)
            streams = await engine.add_requests([[1] * 40] * 3, [short] * 3)
            finals = []
            for stream in streams:
                finals.append([o async for o in stream][-1])
            return finals
        finally:
            await asyncio.to_thread(engine.shutdown)

    outs = asyncio.run(main())
    assert [len(o.prompt_logprobs) for o in outs] == [30] * 3


@pytest.mark.parametrize("temperature", [1e-46, 1e-300, 5e-324])
def test_a_temperature_that_float32_rounds_to_zero_is_greedy(temperature):
    params = SamplingParams(temperature=temperature, max_tokens=6, ignore_eos=True, seed=3)
    assert params.temperature == 0.0 and params.greedy
    llm = LLM("random:tiny", **KW)
    got, want = (llm.generate([[1, 2, 3]], p, use_tqdm=False)[0].token_ids
                 for p in (params, SamplingParams(max_tokens=6, ignore_eos=True)))
    assert got == want


def test_the_smallest_float32_temperature_still_samples():
    assert SamplingParams(temperature=1e-45).temperature == 1e-45  # a float32 denormal


@pytest.mark.parametrize("field, value", [
    ("temperature", 1e39), ("repetition_penalty", 1e-300), ("repetition_penalty", 1e-31),
    ("repetition_penalty", 1e31)])
def test_values_float32_cannot_carry_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("rule", [dict(top_k=1), dict(top_p=1e-9), dict(top_p=1 / 512)])
def test_a_rule_that_keeps_one_token_is_greedy_at_any_temperature(rule):
    """At a huge temperature float32 weights tie; top_k=1, or a top_p of at most 1 / V (the
    most likely token holds at least that), still keeps the argmax alone."""
    llm = LLM("random:tiny", **KW)  # V = 512
    hottest, hot, greedy = (llm.generate([[1, 2, 3]], SamplingParams(
        temperature=t, max_tokens=8, ignore_eos=True, seed=5, **r), use_tqdm=False)[0]
        for t, r in ((1e30, rule), (1e7, rule), (0.0, {})))
    assert hottest.token_ids == hot.token_ids == greedy.token_ids
