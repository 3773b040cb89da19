"""A bounded load test: 200 concurrent streaming requests of mixed lengths against a real
server, 20% of the clients hanging up mid-stream.  Every completed stream must equal offline
``LLM.generate`` for the same seed, no request may be lost or duplicated, and the KV-block
pool must be whole afterwards."""

import asyncio
import json
import random
import time

import httpx
import pytest

from cbatch import LLM, SamplingParams
from tests.serving_utils import running_server

NUM_REQUESTS = 200
TIME_LIMIT_S = 120  # generous for a loaded 2-core CI machine; typically far less
KW = dict(max_num_seqs=64, seed=0)


def _workload():
    rng = random.Random(0)
    reqs = []
    for i in range(NUM_REQUESTS):
        hang_up = i % 5 == 0  # 20% of clients
        reqs.append(dict(
            prompt=[rng.randrange(500) for _ in range(rng.randint(1, 40))],
            max_tokens=60 if hang_up else rng.randint(1, 40),
            temperature=rng.choice([0.0, 0.7, 1.0]), seed=1000 + i, hang_up=hang_up))
    return reqs


async def _stream(client, url, req):
    body = {k: req[k] for k in ("prompt", "max_tokens", "temperature", "seed")}
    body |= {"model": "tiny", "stream": True, "ignore_eos": True}
    text, reasons, done = "", [], False
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        num_chunks = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            if choice["finish_reason"] is not None:
                reasons.append(choice["finish_reason"])
            num_chunks += 1
            if req["hang_up"] and num_chunks == 2:
                return None  # leaving the block closes the connection mid-stream
    return text, reasons, done


@pytest.mark.slow
def test_200_concurrent_streams_with_disconnects():
    reqs = _workload()
    offline = LLM("random:tiny", **KW).generate(
        [r["prompt"] for r in reqs],
        [SamplingParams(max_tokens=r["max_tokens"], temperature=r["temperature"], seed=r["seed"],
                        ignore_eos=True) for r in reqs], use_tqdm=False)
    with running_server("random:tiny", "tiny", **KW) as (url, engine):
        async def main():
            limits = httpx.Limits(max_connections=NUM_REQUESTS + 10)
            async with httpx.AsyncClient(timeout=TIME_LIMIT_S, limits=limits) as client:
                return await asyncio.wait_for(
                    asyncio.gather(*[_stream(client, url, r) for r in reqs]), TIME_LIMIT_S)

        start = time.monotonic()
        results = asyncio.run(main())
        elapsed = time.monotonic() - start
        deadline = time.monotonic() + 30  # aborts of hung-up streams reach the engine
        while engine.stats.num_finished < NUM_REQUESTS and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = engine.stats
        assert stats.num_finished == NUM_REQUESTS  # each request finished exactly once
        assert stats.num_running == stats.num_waiting == 0
        # hung-up requests were aborted, not run to their max_tokens
        assert stats.num_output_tokens < sum(r["max_tokens"] for r in reqs)
        engine.engine.block_manager.check_whole()
    num_compared = 0
    for req, res, ref in zip(reqs, results, offline):
        if req["hang_up"]:
            assert res is None
            continue
        text, reasons, done = res
        assert done and reasons == ["length"]  # one final chunk, then [DONE]
        assert text == ref.text
        num_compared += 1
    assert num_compared == NUM_REQUESTS - NUM_REQUESTS // 5
    assert elapsed < TIME_LIMIT_S
