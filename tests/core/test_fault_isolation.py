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
        assert not engine.is_running
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
