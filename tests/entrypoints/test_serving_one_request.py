"""No single request stops the server (issue 48): what a step relies on is checked at
admission (a 400 naming the field), an error of one request's rows in a step ends that
request alone while /health answers, and what a request may cost is bounded (prompt
logprobs, bad words, /tokenize, /metrics).  Every server runs on 127.0.0.1; every wait is
bounded."""

import asyncio
import json
import threading
import time

import httpx
import pytest

from cbatch.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from cbatch.entrypoints.openai.limits import MAX_BAD_WORDS_CHARS
from tests.serving_utils import running_server

KW = dict(max_num_seqs=8, seed=0)
VOCAB = 512  # random:tiny's


@pytest.fixture(scope="module")
def server():
    with running_server("random:tiny", "tiny", **KW) as (url, engine):
        yield url, engine


def _error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert not error["message"].startswith("Value error"), error
    return error


def _post(url: str, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    # json.dumps, so that a lone surrogate goes out as its \ud800 escape
    return httpx.post(f"{url}{path}", content=json.dumps(body), timeout=timeout,
                      headers={"content-type": "application/json"})


@pytest.mark.parametrize("value", [VOCAB + 1, 10**6, 21])  # 21: past max_prompt_logprobs
def test_prompt_logprobs_past_the_vocabulary_or_the_bound_are_400s(server, value):
    url, engine = server
    r = _post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                       "prompt_logprobs": value})
    assert "max_prompt_logprobs" in _error(r, 400, "prompt_logprobs")["message"]
    assert engine.is_running
    assert httpx.get(f"{url}/health", timeout=1).status_code == 200


def test_prompt_logprobs_of_all_choices_together_are_bounded(server):
    url, _ = server
    body = {"prompt": [[1] * 250] * 4, "max_tokens": 1, "prompt_logprobs": 20, "n": 16}
    r = _post(url, "/v1/completions", body)  # 21 x 250 x 64 = 336,000 entries
    assert "prompt-logprob entries" in _error(r, 400, "prompt_logprobs")["message"]
    ok = _post(url, "/v1/completions", {**body, "prompt": [1] * 250, "n": 2})
    assert ok.status_code == 200
    assert len(ok.json()["choices"][1]["prompt_logprobs"]) == 250


def test_a_temperature_that_rounds_to_zero_in_float32_is_served_greedy(server):
    url, engine = server
    tokens = []
    for temperature in (1e-300, 1e-46, 0):
        r = _post(url, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 6,
                                           "temperature": temperature, "ignore_eos": True,
                                           "logprobs": 0})
        assert r.status_code == 200, r.text
        tokens.append(r.json()["choices"][0]["logprobs"]["tokens"])
    assert tokens[0] == tokens[1] == tokens[2]
    assert engine.is_running


@pytest.mark.parametrize("body, param", [
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    ({"temperature": 1e39}, "temperature"),
    ({"bad_words": ["x" * (MAX_BAD_WORDS_CHARS // 2 + 1)] * 2}, "bad_words"),
])
def test_values_the_kernels_cannot_carry_are_400s_naming_the_field(server, body, param):
    url, _ = server
    _error(_post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **body}), 400,
           param)


def test_tokenize_is_bounded_like_a_prompt(server):
    url, engine = server
    max_len = engine.engine.max_model_len
    start = time.monotonic()
    huge = _post(url, "/tokenize", {"prompt": "a" * (8 << 20)})  # 8 MiB, under the body limit
    _error(huge, 400, "prompt")
    assert "characters" in huge.json()["error"]["message"]
    assert time.monotonic() - start < 10  # refused by its length, not tokenised
    over = _post(url, "/tokenize", {"prompt": "a" * (max_len + 1)})
    _error(over, 400, "prompt")
    ok = _post(url, "/tokenize", {"prompt": "a" * max_len})
    assert ok.status_code == 200 and ok.json()["count"] == max_len
    _error(_post(url, "/tokenize", {"prompt": "a\ud800b"}), 400, "prompt")  # lone surrogate
    # a completion's prompt is refused by its length too, before it is tokenised
    _error(_post(url, "/v1/completions", {"prompt": "a" * (8 << 20), "max_tokens": 1}), 400,
           "prompt")


def test_health_answers_while_a_row_of_one_request_fails_in_its_step(server, monkeypatch):
    """Fault injection: one request's draw raises inside the shared step.  It alone ends (a
    500 for its client); the others get the tokens they would have had; /health answers
    within a second all along; the server serves on."""
    from cbatch.core import sampler

    url, engine = server
    good = {"prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True, "temperature": 0.8,
            "seed": 11}
    want = _post(url, "/v1/completions", good).json()["choices"][0]["text"]
    draw = sampler._draw

    def faulty_draw(logits, rows, batch):
        if any(batch.seeds[r] == 424242 for r in rows):
            raise RuntimeError("injected fault: secret internals")
        return draw(logits, rows, batch)

    monkeypatch.setattr(sampler, "_draw", faulty_draw)
    results: dict[str, httpx.Response] = {}

    def send(name, body):
        results[name] = _post(url, "/v1/completions", body)

    threads = [threading.Thread(target=send, args=("good", good)),
               threading.Thread(target=send, args=("bad", {**good, "seed": 424242}))]
    for t in threads:
        t.start()
    health = []
    while any(t.is_alive() for t in threads) and len(health) < 600:
        start = time.monotonic()
        r = httpx.get(f"{url}/health", timeout=1.0)
        health.append((r.status_code, time.monotonic() - start))
        time.sleep(0.05)
    for t in threads:
        t.join(timeout=60)
    assert health and all(code == 200 and s < 1.0 for code, s in health), health
    bad = _error(results["bad"], 500, None)
    assert "secret" not in results["bad"].text and bad["type"] == "server_error"
    assert results["good"].status_code == 200
    assert results["good"].json()["choices"][0]["text"] == want
    assert engine.is_running
    assert _post(url, "/v1/completions", good).json()["choices"][0]["text"] == want


@pytest.mark.slow
def test_a_template_that_concatenates_null_content_is_a_400(tiny_hf_dir, tmp_path):
    import shutil

    path = tmp_path / "concat-chat"
    shutil.copytree(tiny_hf_dir, path)
    template = "{% for m in messages %}{{ '<' + m.role + '>' + m.content }}{% endfor %}"
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    with running_server(str(path), "chat", **KW) as (url, engine):
        r = _post(url, "/v1/chat/completions", {"max_tokens": 2, "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]})
        error = _error(r, 400, "messages")
        assert "TypeError" in error["message"]
        r = _post(url, "/v1/chat/completions", {"max_tokens": 2, "prompt_logprobs": 10**6,
                                                "messages": [{"role": "user", "content": "hi"}]})
        _error(r, 400, "prompt_logprobs")
        ok = _post(url, "/v1/chat/completions", {"max_tokens": 2, "messages": [
            {"role": "user", "content": "hi"}]})
        assert ok.status_code == 200 and engine.is_running


def test_a_client_that_leaves_during_admission_gets_none_and_nothing_raises():
    from cbatch.entrypoints.openai.serving_engine import unless_disconnected

    cleaned = []

    class Gone:  # a client that has left
        async def receive(self):
            return {"type": "http.disconnect"}

    async def admission():
        try:
            await asyncio.sleep(30)
        finally:
            cleaned.append(True)

    async def main():
        assert await unless_disconnected(Gone(), admission()) is None
        for _ in range(100):  # its clean-up runs on the loop's next turns
            if cleaned:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert cleaned == [True]


def test_speculative_config_is_bounded_at_start_up():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=10**6)
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=10**6)
    SpeculativeConfig(num_speculative_tokens=MAX_SPECULATIVE_TOKENS)


@pytest.mark.slow
def test_metrics_stay_small_at_the_most_draft_positions():
    spec = {"method": "ngram", "num_speculative_tokens": MAX_SPECULATIVE_TOKENS}
    with running_server("random:tiny", "tiny", speculative_config=spec, **KW) as (url, _):
        r = _post(url, "/v1/completions", {"prompt": [1, 2, 1, 2, 1, 2], "max_tokens": 8})
        assert r.status_code == 200
        metrics = httpx.get(f"{url}/metrics", timeout=10)
        assert metrics.status_code == 200 and len(metrics.content) < 64 << 10
        assert "cbatch_spec_decode_num_accepted_tokens_per_pos" in metrics.text
