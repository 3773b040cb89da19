"""Ray Serve: two CPU replicas of a tiny model behind one route; requests spread over both and
the outputs equal one engine's for the same seeds.  Ray runs on 127.0.0.1 with 2 CPUs and is
shut down at the end."""

import asyncio

import httpx
import pytest

from cbatch import LLM, SamplingParams
from tests.serving_utils import free_port, wait_healthy

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")

KW = dict(max_num_seqs=8, seed=0, dtype="float32")  # the replicas' "auto" is the real one


@pytest.mark.slow
def test_two_replicas_spread_requests_and_match_one_engine():
    from ray import serve

    from cbatch.entrypoints.ray_serve import build_ray_app

    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_ray_app("random:tiny", num_replicas=2, served_model_name="tiny",
                                num_cpus_per_replica=0.5, threads=1, **KW),
                  name="cbatch", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, timeout=120)
        prompts = [[i + 1, 2 * i + 3, 7] for i in range(24)]

        async def send_all():
            async with httpx.AsyncClient(timeout=60) as client:
                calls = [client.post(f"{url}/v1/completions", json={
                    "model": "tiny", "prompt": p, "max_tokens": 8, "temperature": 1.0,
                    "seed": 50 + i, "ignore_eos": True}) for i, p in enumerate(prompts)]
                return await asyncio.gather(*calls)

        replicas, texts = set(), []
        for _ in range(5):  # the router picks replicas at random: a few bursts see both
            responses = asyncio.run(send_all())
            assert all(r.status_code == 200 for r in responses)
            replicas |= {r.headers["x-cbatch-replica"] for r in responses}
            texts = [r.json()["choices"][0]["text"] for r in responses]
            if len(replicas) == 2:
                break
        assert len(replicas) == 2, f"5 bursts of {len(prompts)} requests all reached {replicas}"
        ref = LLM("random:tiny", **KW).generate(prompts, [
            SamplingParams(max_tokens=8, temperature=1.0, seed=50 + i, ignore_eos=True)
            for i in range(len(prompts))], use_tqdm=False)
        assert texts == [o.text for o in ref], "a replica's text differs from one engine's"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.mark.slow
def test_serve_refuses_gpus_the_cluster_lacks():
    """cbatch.serve on a cluster without the GPUs it asks for raises at once; Ray Serve would
    wait for them forever."""
    import cbatch

    ray.init(num_cpus=1, num_gpus=0, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    try:
        with pytest.raises(ValueError, match="the Ray cluster has no GPU"):
            cbatch.serve("random:tiny", port=free_port(), blocking=False, device="cuda",
                         num_gpus_per_replica=1)
        with pytest.raises(ValueError, match="need 2 GPU"):
            cbatch.serve("random:tiny", num_replicas=2, port=free_port(), blocking=False,
                         num_gpus_per_replica=1)
        assert ray.is_initialized()  # a cluster it did not start is left alone
    finally:
        ray.shutdown()
