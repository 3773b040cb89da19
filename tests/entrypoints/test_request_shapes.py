"""What real clients send, end to end against a server on 127.0.0.1: the openai SDK's
parameters, vLLM's (the SDK's ``extra_body``), chat and completion logprobs streamed and not,
/tokenize, /detokenize, /version, and fields cbatch does not know (accepted, and logged).
Each parameter is checked to do what its name says where the server's answer shows it.

random:tiny's tokenizer is byte-level: token b < 256 is byte b, so a text's characters are
its tokens."""

import json
import logging

import httpx
import pytest

from cbatch import LLM, SamplingParams
from cbatch.tokenizer import ByteTokenizer
from tests.serving_utils import running_server

openai = pytest.importorskip("openai")

KW = dict(max_num_seqs=8, seed=0)
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    with running_server("random:tiny", "tiny", max_waiting=64,
                        app_kwargs={"chat_template": TEMPLATE}, **KW) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline():
    return LLM("random:tiny", **KW)


def _offline(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0]


def _post(server, route, body):
    return httpx.post(f"{server[0]}{route}", json={"model": "tiny", **body}, timeout=60)


# ------------------------------------------------------------------ accepted as sent


# the openai SDK's own parameters, and vLLM's in extra_body: each accepted on both endpoints
OPENAI = dict(presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"97": 5}, seed=3,
              stop=["zz"], n=2, user="someone", top_p=0.9, temperature=0.7)
VLLM = [dict(top_k=5), dict(min_p=0.1), dict(repetition_penalty=1.2), dict(min_tokens=2),
        dict(allowed_token_ids=[97, 98, 99]), dict(bad_words=["ab"]),
        dict(include_stop_str_in_output=True, stop=["a"]), dict(skip_special_tokens=False),
        dict(spaces_between_special_tokens=False), dict(truncate_prompt_tokens=4),
        dict(prompt_logprobs=1), dict(best_of=2), dict(stop_token_ids=[10]),
        dict(ignore_eos=True), dict(return_tokens_as_token_ids=True)]


@pytest.mark.parametrize("extra", VLLM, ids=lambda e: next(iter(e)))
def test_openai_and_vllm_parameters_are_accepted_on_both_endpoints(client, extra):
    got = client.completions.create(model="tiny", prompt="hello", max_tokens=4,
                                    extra_body=extra, **OPENAI)
    assert len(got.choices) == 2 and all(c.finish_reason for c in got.choices)
    got = client.chat.completions.create(model="tiny", messages=HI, max_completion_tokens=4,
                                         parallel_tool_calls=False, extra_body=extra, **OPENAI)
    assert len(got.choices) == 2 and all(c.finish_reason for c in got.choices)


def test_unknown_fields_are_accepted_and_named_in_one_warning(server, caplog):
    with caplog.at_level(logging.WARNING, logger="cbatch.server"):
        r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                               "frobnicate": 1, "length_penalty": 1.0})
    assert r.status_code == 200, r.text
    lines = [rec.getMessage() for rec in caplog.records if "frobnicate" in rec.getMessage()]
    assert lines == ["/v1/completions: ignoring fields cbatch does not know: frobnicate, "
                     "length_penalty"]
    r = _post(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 2,
                                                "frobnicate": 1})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "hello", "logprobs": None}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hello"}]}]}),
])
def test_what_vllms_benchmark_client_sends(server, route, body):
    """``vllm bench serve --backend openai`` / ``openai-chat``'s requests: streamed, with
    repetition_penalty, usage in the last chunk, and vLLM's fields from its extra_body."""
    tokens = "max_tokens" if "chat" not in route else "max_completion_tokens"
    body = {**body, tokens: 5, "temperature": 0.0, "repetition_penalty": 1.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "top_p": 1.0}
    with httpx.stream("POST", f"{server[0]}{route}", json={"model": "tiny", **body},
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 5


def test_nulls_take_the_defaults(server):
    r = _post(server, "/v1/completions", {
        "prompt": "hi", "max_tokens": None, "temperature": None, "top_p": None, "seed": None,
        "stop": None, "presence_penalty": None, "logit_bias": None, "stop_token_ids": None,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16  # OpenAI's default max_tokens


def test_chat_messages_as_clients_write_them(server, client):
    # content as a list of text parts is the same prompt as the parts joined by newlines
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                          {"type": "text", "text": "there"}]}]
    got = client.chat.completions.create(model="tiny", messages=parts, max_tokens=6, seed=1,
                                         extra_body={"ignore_eos": True})
    ref = client.chat.completions.create(model="tiny", max_tokens=6, seed=1,
                                         messages=[{"role": "user", "content": "hi\nthere"}],
                                         extra_body={"ignore_eos": True})
    assert got.choices[0].message.content == ref.choices[0].message.content
    # an assistant turn that called a tool, the tool's answer, a named user
    history = [{"role": "user", "content": "weather?", "name": "ann"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "weather", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    got = client.chat.completions.create(model="tiny", messages=history, max_tokens=3)
    assert got.choices[0].finish_reason
    # a part that is not text is refused by name
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]})
    assert r.status_code == 400 and "image_url" in r.json()["error"]["message"]


def test_chat_template_kwargs_reach_the_template(tmp_path):
    template = "{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}"
    with running_server("random:tiny", "tiny", app_kwargs={"chat_template": template},
                        **KW) as (url, _):
        r = httpx.post(f"{url}/tokenize", json={"messages": HI,
                                                "chat_template_kwargs": {"greeting": "yo "}})
        assert r.json()["tokens"] == list(b"yo hi")


def test_max_completion_tokens_wins_over_max_tokens(client):
    got = client.chat.completions.create(model="tiny", messages=HI, max_tokens=9,
                                         max_completion_tokens=3,
                                         extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == 3 and got.choices[0].finish_reason == "length"


def test_a_seed_at_the_top_of_its_range_with_n_choices(client, offline):
    """Choice i samples with seed + i, wrapping past 2**64 - 1 to 0 (issue 41 item 16)."""
    got = client.completions.create(model="tiny", prompt="abc", max_tokens=6, n=2,
                                    seed=2**64 - 1, extra_body={"ignore_eos": True})
    for choice, seed in zip(got.choices, [2**64 - 1, 0]):
        ref = _offline(offline, "abc", max_tokens=6, temperature=1.0, seed=seed,
                       ignore_eos=True)
        assert choice.text == ref.text


@pytest.mark.parametrize("route, body, param, match", [
    ("/v1/completions", {"logit_bias": {"a": 1}}, "logit_bias", "token ids"),
    ("/v1/completions", {"logit_bias": {"97": 101}}, "logit_bias", "[-100, 100]"),
    ("/v1/completions", {"min_tokens": 20, "max_tokens": 10}, "min_tokens", "max_tokens=10"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty", "[1e-30, 1e+30]"),
    ("/v1/completions", {"min_p": 2}, "min_p", "[0, 1]"),
    ("/v1/completions", {"best_of": 1, "n": 2}, "best_of", "best_of must be >= n"),
    ("/v1/chat/completions", {"best_of": 3}, "best_of", "best_of == n"),
    ("/v1/completions", {"allowed_token_ids": []}, "allowed_token_ids", "empty"),
    ("/v1/completions", {"seed": 2**64}, "seed", "2**64"),
    ("/v1/completions", {"logit_bias": {"600": 1}}, "logit_bias",
     "logit_bias has token ids outside"),
    ("/v1/chat/completions", {"allowed_token_ids": [1, 512]}, "allowed_token_ids",
     "allowed_token_ids has token ids outside the vocabulary [0, 512): [512]"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "", "logprobs=true"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
    ("/v1/chat/completions", {"presence_penalty": -3}, "presence_penalty", "[-2, 2]"),
])
def test_refusals_are_400s_naming_the_field(server, route, body, param, match):
    body = {("prompt" if "chat" not in route else "messages"): "hi" if "chat" not in route
            else HI, **body}
    r = _post(server, route, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert match in error["message"] and (error["param"] or "").endswith(param)


# ------------------------------------------------------------------ doing what they say


def _bias_free_text(offline, prompt, **kw):
    return _offline(offline, prompt, temperature=1.0, seed=5, ignore_eos=True, **kw)


def test_include_stop_str_in_output_keeps_the_stop_string(client, offline):
    free = _bias_free_text(offline, "xyz", max_tokens=40)
    stop = next(free.text[i:i + 2] for i in range(5, len(free.text) - 2)
                if "\ufffd" not in free.text[i:i + 2] and "\ufffd" not in free.text[:i + 2])
    cut = free.text.find(stop)
    kw = dict(model="tiny", prompt="xyz", max_tokens=40, temperature=1.0, seed=5, stop=[stop])
    got = client.completions.create(extra_body={"ignore_eos": True}, **kw)
    assert got.choices[0].text == free.text[:cut]
    body = {"ignore_eos": True, "include_stop_str_in_output": True}
    got = client.completions.create(extra_body=body, **kw)
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].text == free.text[:cut + len(stop)]
    chunks = list(client.completions.create(extra_body=body, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == free.text[:cut + len(stop)]


def test_the_stop_token_that_finished_a_request_is_left_out_of_its_text(client, offline):
    """As vLLM: a stop token's text (stop_token_ids, EOS) is not in the output's text unless
    include_stop_str_in_output; the token is in the output's tokens either way."""
    stop = _offline(offline, "hello", max_tokens=1).token_ids[0]  # greedy's first token
    kw = dict(model="tiny", prompt="hello", max_tokens=10, temperature=0.0, logprobs=0)
    got = client.completions.create(extra_body={"stop_token_ids": [stop]}, **kw)
    assert got.usage.completion_tokens == 1 and got.choices[0].finish_reason == "stop"
    assert got.choices[0].text == "" and got.choices[0].logprobs.token_logprobs[0] <= 0
    got = client.completions.create(extra_body={"stop_token_ids": [stop],
                                                "include_stop_str_in_output": True}, **kw)
    assert got.choices[0].text == offline.tokenizer.decode([stop])


# The rules below are the sampler's (cbatch/core/sampler.py); these tests check that the
# server hands them over and that their effect shows in what a client gets.

def test_logit_bias_of_100_makes_every_token_that_token(client):
    got = client.completions.create(model="tiny", prompt="hello", max_tokens=8,
                                    temperature=1.0, seed=2, logit_bias={"65": 100},
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == "A" * 8
    got = client.chat.completions.create(model="tiny", messages=HI, max_tokens=8, seed=2,
                                         logit_bias={"66": 100},
                                         extra_body={"ignore_eos": True})
    assert got.choices[0].message.content == "B" * 8


def test_allowed_token_ids_restrict_the_output(client):
    got = client.completions.create(model="tiny", prompt="hello", max_tokens=24,
                                    temperature=1.0, seed=2, extra_body={
                                        "ignore_eos": True, "allowed_token_ids": [97, 98, 99]})
    text = got.choices[0].text
    assert len(text) == 24 and set(text) <= set("abc")


def test_min_tokens_keeps_going_past_a_stop_token(client, offline):
    first = _offline(offline, "hello", max_tokens=1).token_ids[0]  # greedy's first token
    kw = dict(model="tiny", prompt="hello", max_tokens=10, temperature=0.0)
    got = client.completions.create(extra_body={"stop_token_ids": [first]}, **kw)
    assert got.usage.completion_tokens == 1 and got.choices[0].finish_reason == "stop"
    got = client.completions.create(extra_body={"stop_token_ids": [first], "min_tokens": 5},
                                    **kw)
    assert got.usage.completion_tokens >= 5


def test_min_p_of_one_is_greedy(client, offline):
    greedy = _offline(offline, "hello", max_tokens=12, ignore_eos=True)
    got = client.completions.create(model="tiny", prompt="hello", max_tokens=12,
                                    temperature=1.0, seed=9,
                                    extra_body={"ignore_eos": True, "min_p": 1.0})
    assert got.choices[0].text == greedy.text


def test_bad_words_are_never_generated(client, offline):
    greedy = _offline(offline, "hello", max_tokens=1)
    word = chr(greedy.token_ids[0])  # greedy's first character (a byte below 0x80)
    assert greedy.token_ids[0] < 0x80
    got = client.completions.create(model="tiny", prompt="hello", max_tokens=12,
                                    temperature=0.0, extra_body={"bad_words": [word],
                                                                 "ignore_eos": True})
    assert word not in got.choices[0].text


def test_prompt_logprobs_in_vllms_shape(client):
    got = client.completions.create(model="tiny", prompt="hello", max_tokens=2,
                                    extra_body={"prompt_logprobs": 2})
    entries = got.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == 5 and entries[0] is None
    for token, entry in zip(b"hello"[1:], entries[1:]):
        assert str(token) in entry and 2 <= len(entry) <= 3
        ranks = [e["rank"] for e in entry.values()]
        assert ranks[:2] == [1, 2] and all(e["logprob"] <= 0 for e in entry.values())


def test_truncate_prompt_tokens_keeps_the_last_ones(client):
    got = client.completions.create(model="tiny", prompt="x" * 250, max_tokens=4,
                                    extra_body={"truncate_prompt_tokens": 20})
    assert got.usage.prompt_tokens == 20


# ------------------------------------------------------------------ logprobs


def test_chat_logprobs_in_openais_shape_streamed_and_not(client, offline):
    kw = dict(model="tiny", messages=HI, max_tokens=12, seed=4, logprobs=True,
              top_logprobs=3, extra_body={"ignore_eos": True})
    got = client.chat.completions.create(**kw)
    content = got.choices[0].logprobs.content
    ref = _offline(offline, "<user>hi\n<assistant>", max_tokens=12, temperature=1.0, seed=4,
                   ignore_eos=True, logprobs=3)
    assert [e.logprob for e in content] == [d[t] for d, t in zip(ref.logprobs, ref.token_ids)]
    for entry, token, alternatives in zip(content, ref.token_ids, ref.logprobs):
        assert bytes(entry.bytes) == ByteTokenizer(511).token_bytes(token)
        assert len(entry.top_logprobs) == 3  # k entries, whatever their texts
        assert [t.logprob for t in entry.top_logprobs] == sorted(alternatives.values(),
                                                                 reverse=True)[:3]
    # streamed: each chunk carries the logprobs of the tokens it covers; together the same
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == got.choices[0].message.content
    # logprobs without top_logprobs: the sampled tokens' alone
    got = client.chat.completions.create(model="tiny", messages=HI, max_tokens=3,
                                         logprobs=True)
    assert all(e.top_logprobs == [] for e in got.choices[0].logprobs.content)
    assert client.chat.completions.create(model="tiny", messages=HI,
                                          max_tokens=3).choices[0].logprobs is None


def test_colliding_texts_still_give_k_alternatives(client):
    """Bytes >= 0x80 all decode to U+FFFD alone: each is named bytes:\\x.. (issue 41 item 17)."""
    got = client.completions.create(model="tiny", prompt="hello", max_tokens=10, logprobs=20,
                                    temperature=1.0, seed=1, extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    assert all(len(top) in (20, 21) for top in lp.top_logprobs)
    names = [name for top in lp.top_logprobs for name in top]
    assert any(name.startswith("bytes:\\x") for name in names)
    got = client.chat.completions.create(model="tiny", messages=HI, max_tokens=10, seed=1,
                                         logprobs=True, top_logprobs=20,
                                         extra_body={"ignore_eos": True})
    assert all(len(e.top_logprobs) == 20 for e in got.choices[0].logprobs.content)
    got = client.completions.create(model="tiny", prompt="hello", max_tokens=3, logprobs=2,
                                    extra_body={"return_tokens_as_token_ids": True})
    assert all(name.startswith("token_id:") for top in got.choices[0].logprobs.top_logprobs
               for name in top)


def test_completion_logprobs_come_in_streamed_chunks(client):
    kw = dict(model="tiny", prompt="hello", max_tokens=12, logprobs=2, temperature=1.0,
              seed=6, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].logprobs
    chunks = list(client.completions.create(stream=True, **kw))
    parts = [c.choices[0].logprobs for c in chunks]
    assert all(p is not None for p in parts)
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for p in parts for x in getattr(p, field)] == getattr(full, field)


def test_echo_with_logprobs_scores_the_prompt_too(client, offline):
    """The echoed prompt's tokens come first, the first with null logprobs (nothing predicts
    it), then the output's, with text offsets running through both; streamed the same."""
    kw = dict(model="tiny", prompt="hello", max_tokens=4, logprobs=1, echo=True, seed=5,
              extra_body={"ignore_eos": True})
    got = client.completions.create(**kw).choices[0]
    lp = got.logprobs
    assert got.text.startswith("hello") and lp.tokens[:5] == list("hello")
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[:6] == [0, 1, 2, 3, 4, 5] and len(lp.tokens) == 9
    want = _offline(offline, "hello", max_tokens=1, prompt_logprobs=1).prompt_logprobs
    for token, value, entry in zip(b"hello"[1:], lp.token_logprobs[1:5], want[1:]):
        assert value == pytest.approx(entry[token], abs=1e-5)
    chunks = list(client.completions.create(stream=True, **kw))
    assert [x for c in chunks for x in c.choices[0].logprobs.tokens] == lp.tokens


# ------------------------------------------------------------------ utility routes


def test_tokenize_detokenize_and_version(server):
    import cbatch

    r = _post(server, "/tokenize", {"prompt": "héllo"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == list("héllo".encode()) and body["count"] == 6
    assert body["max_model_len"] == server[1].engine.max_model_len
    r = _post(server, "/tokenize", {"prompt": "hé", "return_token_strs": True})
    assert r.json()["token_strs"] == ["h", "bytes:\\xc3", "bytes:\\xa9"]
    r = _post(server, "/tokenize", {"messages": HI, "add_generation_prompt": False})
    assert r.json()["tokens"] == list(b"<user>hi\n")
    r = _post(server, "/tokenize", {"messages": HI})
    assert r.json()["tokens"] == list(b"<user>hi\n<assistant>")
    r = _post(server, "/detokenize", {"tokens": list("héllo".encode())})
    assert r.status_code == 200 and r.json() == {"prompt": "héllo"}
    r = _post(server, "/detokenize", {"tokens": [1, 100000]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert _post(server, "/tokenize", {"model": "gpt-9", "prompt": "x"}).status_code == 404
    r = httpx.get(f"{server[0]}/version")
    assert r.status_code == 200 and r.json() == {"version": cbatch.__version__}


def test_utility_routes_are_behind_the_guard():
    """/tokenize and /detokenize need the API key (they run the tokenizer); /version, as
    /health, does not; all of them pass the host allow-list."""
    guard = {"api_key": "sesame", "allowed_hosts": ["127.0.0.1"]}
    with running_server("random:tiny", "tiny", app_kwargs=guard, **KW) as (url, _):
        key = {"Authorization": "Bearer sesame"}
        for route, body in [("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})]:
            r = httpx.post(f"{url}{route}", json=body)
            assert r.status_code == 401, (route, r.text)
            r = httpx.post(f"{url}{route}", json=body, headers=key)
            assert r.status_code == 200, (route, r.text)
            r = httpx.post(f"{url}{route}", json=body,
                           headers={**key, "Host": "attacker.example"})
            assert r.status_code == 400, (route, r.text)
        assert httpx.get(f"{url}/version").status_code == 200
        assert httpx.get(f"{url}/version", headers={"Host": "attacker.example"}
                         ).status_code == 400
