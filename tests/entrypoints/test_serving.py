"""The OpenAI-compatible server against real HTTP clients on 127.0.0.1: the official openai
client (streaming and not), every error status, metrics, chat templates, `cbatch serve`."""

import json
import signal
import subprocess
import sys

import httpx
import pytest

from cbatch import LLM, SamplingParams
from tests.serving_utils import free_port, running_server, wait_healthy

openai = pytest.importorskip("openai")

KW = dict(max_num_seqs=8, seed=0)


@pytest.fixture(scope="module")
def server():
    with running_server("random:tiny", "tiny", max_waiting=64, **KW) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline():
    return LLM("random:tiny", **KW)


def _offline(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0]


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{server[0]}/health").json() == {"status": "ok"}


def test_completion_equals_offline_generate(client, offline):
    got = client.completions.create(model="tiny", prompt="Hello there", max_tokens=12,
                                    temperature=0.9, top_p=0.95, seed=5,
                                    extra_body={"top_k": 50})
    ref = _offline(offline, "Hello there", max_tokens=12, temperature=0.9, top_p=0.95,
                   top_k=50, seed=5)
    choice = got.choices[0]
    assert choice.text == ref.text and choice.finish_reason == ref.finish_reason
    assert got.usage.prompt_tokens == len("Hello there".encode())
    assert got.usage.completion_tokens == len(ref.token_ids)


def test_streaming_joins_to_the_same_text_and_ends_with_usage(client, offline):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    chunks = list(client.completions.create(
        model="tiny", prompt=prompt, max_tokens=20, temperature=1.0, seed=7, stream=True,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True}))
    ref = _offline(offline, prompt, max_tokens=20, temperature=1.0, seed=7, ignore_eos=True)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == len(prompt)


def test_batch_of_prompts_n_choices_stop_and_echo(client, offline):
    prompts = [[97, 98], [10, 20, 30]]
    got = client.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=8,
                                    temperature=1.0, seed=11, echo=True,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    tok = offline.tokenizer
    for c in got.choices:
        prompt = prompts[c.index // 2]
        ref = _offline(offline, prompt, max_tokens=8, temperature=1.0, seed=11 + c.index % 2,
                       ignore_eos=True)
        echoed = prompt if isinstance(prompt, str) else tok.decode(prompt)
        assert c.text == echoed + ref.text
    assert got.usage.prompt_tokens == 5 and got.usage.completion_tokens == 32
    # a stop string taken from a free-running completion cuts the text before it
    free = _offline(offline, "xyz", max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
    stop = next(free.text[i:i + 2] for i in range(5, len(free.text) - 2)
                if "\ufffd" not in free.text[i:i + 2])
    got = client.completions.create(model="tiny", prompt="xyz", max_tokens=40, temperature=1.0,
                                    seed=3, stop=[stop], extra_body={"ignore_eos": True})
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].text == free.text[:free.text.find(stop)]


def test_logprobs_of_the_sampled_tokens(client, offline):
    got = client.completions.create(model="tiny", prompt="hi", max_tokens=3, logprobs=2,
                                    temperature=1.0, seed=4, extra_body={"ignore_eos": True})
    ref = _offline(offline, "hi", max_tokens=3, temperature=1.0, seed=4, ignore_eos=True,
                   logprobs=2)
    lp = got.choices[0].logprobs
    assert lp.token_logprobs == [e[t] for e, t in zip(ref.logprobs, ref.token_ids)]
    # the 2 most likely and the sampled token (up to k + 1, as OpenAI), each under its own
    # name even where ids share a text (parts of a character are "bytes:\\x..")
    assert [sorted(top.values()) for top in lp.top_logprobs] == [
        sorted(e.values()) for e in ref.logprobs]
    assert all(max(top.values()) >= v for top, v in zip(lp.top_logprobs, lp.token_logprobs))


@pytest.mark.parametrize("body, status, match", [
    ({"model": "gpt-9", "prompt": "hi"}, 404, "does not exist"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": ""}, 400, "empty"),
    ({"prompt": [600]}, 400, "token ids"),
    ({"prompt": "hi", "presence_penalty": 5}, 400, "presence_penalty must be"),
    ({"prompt": "x" * 250, "max_tokens": 10}, 400, "maximum length"),
    ({"max_tokens": 5}, 400, "prompt"),
])
def test_bad_requests_get_openai_errors_and_serving_goes_on(server, client, body, status, match):
    r = httpx.post(f"{server[0]}/v1/completions", json={"model": "tiny", **body})
    assert r.status_code == status
    error = r.json()["error"]
    assert match in error["message"] and error["type"]
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=2).choices


def test_invalid_json_is_a_400(server):
    r = httpx.post(f"{server[0]}/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_chat_on_plain_gpt2_is_a_clear_400(client):
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])


def test_full_queue_is_a_503(server):
    url, engine = server
    saved = engine.max_waiting
    engine.max_waiting = 1  # at most one waits: a burst larger than max_num_seqs + 1 overflows
    try:
        async_client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)

        async def burst():
            import asyncio

            calls = [async_client.completions.create(model="tiny", prompt=[i + 1], max_tokens=30,
                                                     extra_body={"ignore_eos": True})
                     for i in range(24)]
            return await asyncio.gather(*calls, return_exceptions=True)

        import asyncio

        results = asyncio.run(burst())
    finally:
        engine.max_waiting = saved
    refused = [r for r in results if isinstance(r, openai.APIStatusError)]
    assert refused and all(r.status_code == 503 for r in refused)
    assert "waiting queue is full" in refused[0].message
    assert all(r.choices[0].finish_reason == "length" for r in results
               if not isinstance(r, Exception))


def test_metrics_report_engine_and_latencies(server, client):
    client.completions.create(model="tiny", prompt="metrics", max_tokens=4)
    text = httpx.get(f"{server[0]}/metrics").text
    for name in ("cbatch_num_requests_running", "cbatch_num_requests_waiting",
                 "cbatch_kv_cache_usage_perc", "cbatch_num_preemptions_total",
                 "cbatch_generation_tokens_total", "cbatch_time_to_first_token_seconds_bucket",
                 "cbatch_time_per_output_token_seconds_count",
                 "cbatch_e2e_request_latency_seconds_sum", "cbatch_request_finished_total"):
        assert name in text
    count = next(line for line in text.splitlines()
                 if line.startswith("cbatch_e2e_request_latency_seconds_count"))
    assert float(count.split()[-1]) >= 1


def test_metrics_count_prefix_cache_hits(server, client):
    def metric(name):
        text = httpx.get(f"{server[0]}/metrics").text
        return float(next(line for line in text.splitlines() if line.startswith(name)).split()[-1])

    prompt = "a system prompt that many requests share, " * 3  # 126 tokens (byte tokenizer)
    client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    before = metric("cbatch_prefix_cache_hits_total"), metric("cbatch_prefix_cache_queries_total")
    client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    hits = metric("cbatch_prefix_cache_hits_total") - before[0]
    queries = metric("cbatch_prefix_cache_queries_total") - before[1]
    # the same prompt again: every full block but the one holding its last token is a hit
    assert queries == 126 and hits >= 16 * 7


def test_chat_template_of_a_checkpoint(tiny_hf_dir, tmp_path):
    import shutil

    path = tmp_path / "chat"
    shutil.copytree(tiny_hf_dir, path)
    template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    with running_server(str(path), "chat", **KW) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        got = client.chat.completions.create(model="chat", messages=messages, max_tokens=6,
                                             seed=1, extra_body={"ignore_eos": True})
        ref = LLM(str(path), **KW).generate(["<user>hi\n<assistant>"], SamplingParams(
            max_tokens=6, temperature=1.0, seed=1, ignore_eos=True), use_tqdm=False)[0]
        assert got.choices[0].message.content == ref.text
        assert got.choices[0].message.role == "assistant"
        chunks = list(client.chat.completions.create(model="chat", messages=messages,
                                                     max_tokens=6, seed=1, stream=True,
                                                     extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
        assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.slow
def test_cbatch_serve_command(tmp_path):
    """As the README runs it offline: the model as the argument, served under another name,
    with a chat template from a file and a shorter max_model_len."""
    port = free_port()
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}\n{% endfor %}")
    proc = subprocess.Popen([sys.executable, "-m", "cbatch.entrypoints.cli.main", "serve",
                             "random:tiny", "--served-model-name", "tiny", "--port", str(port),
                             "--threads", "1", "--batch-invariant", "--chat-template",
                             str(template), "--max-model-len", "64"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, timeout=120)
        models = httpx.get(f"{url}/v1/models").json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [("tiny", 64)]
        r = httpx.post(f"{url}/v1/completions",
                       json={"model": "tiny", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"]
        r = httpx.post(f"{url}/v1/completions",
                       json={"model": "tiny", "prompt": "x" * 60, "max_tokens": 8})
        assert r.status_code == 400 and "maximum length (64)" in r.text
        r = httpx.post(f"{url}/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["role"] == "assistant"
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    # uvicorn shuts down gracefully, then re-raises SIGTERM as its exit status
    assert proc.returncode in (0, -signal.SIGTERM), out.decode()[-2000:]
    assert "Application shutdown complete" in out.decode()


@pytest.mark.slow
def test_ops_and_hf_import_no_engine_or_server():
    probe = ("import sys, cbatch.ops, cbatch.hf\n"
             "bad = [m for m in sys.modules if m.startswith(('cbatch.core', 'cbatch.entrypoints',"
             " 'fastapi', 'uvicorn', 'ray'))]\n"
             "assert not bad, bad\n"
             "print('ok')\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
