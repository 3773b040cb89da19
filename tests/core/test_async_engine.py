"""AsyncEngine: concurrent callers, aborts, the waiting-queue bound, graceful shutdown."""

import asyncio

import pytest

from cbatch import LLM, SamplingParams
from cbatch.core.async_engine import AsyncEngine, EngineDeadError, QueueFullError

KW = dict(max_num_seqs=8, seed=0)


def _params(i):
    return SamplingParams(max_tokens=3 + 5 * (i % 4), temperature=0.8, seed=100 + i,
                          ignore_eos=True)


def _prompt(i):
    return [(7 * i + j) % 500 for j in range(1 + 3 * (i % 5))]


async def _collect(engine, i):
    outs = []
    async for out in engine.generate(_prompt(i), _params(i)):
        outs.append(out)
    return outs


@pytest.mark.slow
def test_concurrent_streams_equal_offline_generate():
    n = 12
    reference = LLM("random:tiny", **KW).generate([_prompt(i) for i in range(n)],
                                                   [_params(i) for i in range(n)], use_tqdm=False)

    async def main():
        engine = AsyncEngine("random:tiny", **KW)
        results = await asyncio.gather(*[_collect(engine, i) for i in range(n)])
        await asyncio.to_thread(engine.shutdown)
        return results

    for outs, ref in zip(asyncio.run(main()), reference):
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        for a, b in zip(outs, outs[1:]):  # one token per output, each a longer snapshot
            assert b.token_ids[:len(a.token_ids)] == a.token_ids and b.text.startswith(a.text)
        assert outs[-1].token_ids == ref.token_ids and outs[-1].text == ref.text
        assert outs[-1].finish_reason == "length"


@pytest.mark.slow
def test_a_stream_of_the_final_output_only():
    async def main():
        engine = AsyncEngine("random:tiny", **KW)
        stream = await engine.add_request(_prompt(3), _params(3), stream=False)
        outs = [out async for out in stream]
        await asyncio.to_thread(engine.shutdown)
        return outs

    (final,) = asyncio.run(main())
    reference = LLM("random:tiny", **KW).generate([_prompt(3)], [_params(3)], use_tqdm=False)
    assert final.finished and final.token_ids == reference[0].token_ids


def test_leaving_a_stream_aborts_its_request():
    finished = {}

    async def main():
        engine = AsyncEngine("random:tiny", on_finished=lambda o: finished.update({
            o.request_id: o}), **KW)
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        stream = await engine.add_request([1, 2, 3], long)
        async for out in stream:
            break  # the client goes away after one token ...
        del stream  # ... and drops the stream
        task = asyncio.create_task(_drain(engine.generate([4, 5], long)))
        await asyncio.sleep(0.05)
        task.cancel()  # a cancelled caller aborts too
        with pytest.raises(asyncio.CancelledError):
            await task
        others = await asyncio.gather(*[_collect(engine, i) for i in range(4)])
        await asyncio.to_thread(engine.shutdown, 60.0)  # checks every block is free
        return others

    assert all(outs[-1].finish_reason == "length" for outs in asyncio.run(main()))
    long_ones = [o for o in finished.values() if o.prompt_token_ids in ([1, 2, 3], [4, 5])]
    assert [o.finish_reason for o in long_ones] == ["abort", "abort"]
    assert all(len(o.token_ids) < 200 for o in long_ones)


async def _drain(stream):
    async for _ in stream:
        pass


def test_bad_requests_and_a_full_queue_are_refused_and_serving_goes_on():
    async def main():
        engine = AsyncEngine("random:tiny", max_num_seqs=1, max_waiting=2)
        with pytest.raises(ValueError, match="prompt is empty"):
            await engine.add_request([], SamplingParams())
        with pytest.raises(ValueError, match="maximum length"):
            await engine.add_request([1] * 250, SamplingParams(max_tokens=10))
        long = SamplingParams(max_tokens=50, ignore_eos=True)
        results = await asyncio.gather(*[engine.add_request([i + 1], long) for i in range(6)],
                                       return_exceptions=True)
        refused = [r for r in results if isinstance(r, QueueFullError)]
        streams = [r for r in results if not isinstance(r, BaseException)]
        # one request may already run when the rest arrive; never more than 2 wait
        assert len(streams) <= 3 and len(refused) == 6 - len(streams)
        assert "waiting queue is full" in str(refused[0])
        finals = [await _last(s) for s in streams]
        assert all(o.finish_reason == "length" and len(o.token_ids) == 50 for o in finals)
        assert (await _collect(engine, 1))[-1].finish_reason == "length"
        await asyncio.to_thread(engine.shutdown)

    asyncio.run(main())


async def _last(stream):
    """The final output of a stream (read to its end)."""
    return [o async for o in stream][-1]


def test_shutdown_aborts_in_flight_requests_and_frees_every_block():
    async def main():
        engine = AsyncEngine("random:tiny", **KW)
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        streams = [await engine.add_request([i + 1, 2], long) for i in range(5)]
        await anext(streams[0])
        await asyncio.to_thread(engine.shutdown, 0.0)  # checks the block pool is whole
        finals = [await _last(s) for s in streams]
        assert all(o.finished and o.finish_reason == "abort" for o in finals)
        assert all(len(o.token_ids) < 200 for o in finals)
        with pytest.raises(EngineDeadError):
            await engine.add_request([1], long)

    asyncio.run(main())


def test_shutdown_with_time_lets_running_requests_finish():
    async def main():
        engine = AsyncEngine("random:tiny", **KW)
        stream = await engine.add_request([1, 2], SamplingParams(max_tokens=20, ignore_eos=True))
        await asyncio.to_thread(engine.shutdown, 60.0)
        return [o async for o in stream][-1]

    out = asyncio.run(main())
    assert out.finish_reason == "length" and len(out.token_ids) == 20


def test_the_engine_is_built_and_stepped_on_its_own_thread(monkeypatch):
    """Every torch call of a served engine runs on the engine thread, construction included
    (OpenMP would give a second thread a team of its own; NOTES, "Thread policy on a busy
    CPU"), and an
    engine that cannot be built raises from AsyncEngine() itself."""
    import threading

    from cbatch.core import async_engine

    seen = {}

    class Recording(async_engine.Engine):
        def __init__(self, *args, **kwargs):
            seen.setdefault("built", set()).add(threading.get_ident())
            super().__init__(*args, **kwargs)

        def step(self):
            seen.setdefault("stepped", set()).add(threading.get_ident())
            return super().step()

    monkeypatch.setattr(async_engine, "Engine", Recording)
    engine = AsyncEngine("random:tiny", **KW)

    async def main():
        async for out in engine.generate([1, 2, 3], SamplingParams(max_tokens=2)):
            pass
        return out

    assert asyncio.run(main()).finished
    engine.shutdown()
    assert seen["built"] == seen["stepped"] == {engine._thread.ident}
    # what a server reads of it, without reaching into the engine
    assert (engine.config.model, engine.max_model_len, engine.vocab_size) == ("random:tiny",
                                                                              256, 512)
    assert engine.architecture == "GPT2LMHeadModel" and engine.error is None
    assert engine.memory_report().startswith("KV cache: ") and "max_model_len 256" in (
        engine.memory_report())
    assert engine.describe() == engine.engine.runner.describe()
    assert engine._thread.ident != threading.get_ident()
    with pytest.raises(ValueError, match="unknown model size"):
        AsyncEngine("random:nope", **KW)
