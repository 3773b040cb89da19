"""The rest of what clients send (issue 51), through the openai SDK and plain HTTP, streamed and
not, against ``random:qwen3-tiny`` served with the chat template it carries (Qwen3's: no
``--chat-template``), the Hermes tool parser and the qwen3 reasoning parser: chat's default
length, ``parallel_tool_calls``, vLLM's ``guided_*`` fields, ``continuous_usage_stats``,
``best_of``, reasoning output, lm-evaluation-harness's and LangChain's requests.  The
Responses API's are in test_responses.py.  Every constrained output is checked against its
grammar.

random:qwen3-tiny's tokenizer is byte-level: token b < 256 is byte b."""

import json
import time

import httpx
import jsonschema
import pytest

from cbatch.entrypoints.openai.protocol import ChatCompletionRequest
from cbatch.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from cbatch.entrypoints.openai.serving_chat import _ChoiceStream
from cbatch.outputs import RequestMetrics, RequestOutput
from tests.serving_utils import running_server
from tests.structured_utils import (ADD, CONSTRAINTS, PERSON, WEATHER, assert_follows,
                                    script_outputs)

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
USER = [{"role": "user", "content": "weather in paris?"}]
SERVER = dict(max_num_seqs=8, seed=0)
# the server's reasoning parser would let a constrained reply think first (its grammar after
# </think>, which a random model never writes: test_reasoning_outputs.py scripts it); Qwen3's
# template closes the block in the prompt instead, so the grammar applies from the start
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server():
    with running_server("random:qwen3-tiny", "qwen3", app_kwargs=dict(
            tool_call_parser="hermes", reasoning_parser="qwen3"), **SERVER) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="-", max_retries=0)


def _post(server, route, body):
    return httpx.post(f"{server[0]}{route}", json={"model": "qwen3", **body}, timeout=120)


def _chunks(server, route, body) -> list[dict]:
    with httpx.stream("POST", f"{server[0]}{route}", json={"model": "qwen3", **body},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _assert_call(call):
    assert call.type == "function" and call.id
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# ------------------------------------------------------------ the model's own template


def test_the_random_model_brings_qwen3s_template(server):
    """No --chat-template: random:qwen3-tiny renders Qwen3's ChatML, and
    ``chat_template_kwargs`` reach it (``enable_thinking: false`` closes an empty block)."""
    def rendered(**kw) -> str:
        r = _post(server, "/tokenize", {"messages": USER, **kw})
        assert r.status_code == 200, r.text
        return bytes(r.json()["tokens"]).decode()

    assert rendered() == "<|im_start|>user\nweather in paris?<|im_end|>\n<|im_start|>assistant\n"
    assert rendered(chat_template_kwargs={"enable_thinking": False}).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    with_tools = rendered(tools=TOOLS)
    assert "<tools>\n" + json.dumps(TOOLS[0]) in with_tools and "<tool_call>" in with_tools


# ------------------------------------------------------------ chat's default length


@pytest.mark.slow
def test_chat_without_max_tokens_finishes_its_structured_output(client):
    """The README's example: no max_tokens, and the JSON is whole (it used to stop at 16)."""
    got = client.chat.completions.create(
        model="qwen3", messages=USER, temperature=1.0, seed=3, n=2,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON}},
        extra_body=NO_THINKING)
    for choice in got.choices:
        assert choice.finish_reason == "stop"
        assert_follows("json", choice.message.content)


@pytest.mark.slow
def test_chat_without_max_tokens_may_use_the_rest_of_the_context(server):
    long = [{"role": "user", "content": "x" * (server[1].max_model_len - 60)}]
    r = _post(server, "/v1/chat/completions", {"messages": long, "ignore_eos": True})
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] > server[1].max_model_len - 60
    assert usage["completion_tokens"] == server[1].max_model_len - usage["prompt_tokens"]
    r = _post(server, "/v1/completions", {"prompt": "hi", "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 16  # completions keep OpenAI's


# ------------------------------------------------------------ parallel_tool_calls


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_is_exactly_one_call(client, stream):
    kw = dict(model="qwen3", messages=USER, tools=TOOLS, tool_choice="required",
              parallel_tool_calls=False, temperature=1.0, seed=11, n=4, max_tokens=300,
              extra_body=NO_THINKING)
    if not stream:
        got = client.chat.completions.create(**kw)
        calls = {c.index: c.message.tool_calls for c in got.choices}
        reasons = {c.index: c.finish_reason for c in got.choices}
    else:
        calls, reasons = {}, {}
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                calls.setdefault(c.index, []).extend(c.delta.tool_calls or [])
                reasons[c.index] = c.finish_reason or reasons.get(c.index)
    assert len(calls) == 4
    for i, made in calls.items():
        assert reasons[i] == "tool_calls" and len(made) == 1
        _assert_call(made[0])


def test_langchains_bind_tools_request(server):
    """LangChain's ``ChatOpenAI(...).bind_tools(tools)``: tools, no tool_choice ("auto",
    found by the server's Hermes parser)."""
    for stream in (False, True):
        body = {"messages": USER, "tools": TOOLS, "temperature": 0.7, "n": 1,
                "stream": stream, "max_tokens": 40}
        if stream:
            chunks = _chunks(server, "/v1/chat/completions", body)
            assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        else:
            r = _post(server, "/v1/chat/completions", body)
            assert r.status_code == 200, r.text
            message = r.json()["choices"][0]["message"]
            assert message["content"] and not message["tool_calls"]


# ------------------------------------------------------------ vLLM's guided_* fields


@pytest.mark.parametrize("field, kind", [("guided_json", "json"), ("guided_regex", "regex"),
                                         ("guided_choice", "choice"),
                                         ("guided_grammar", "grammar")])
def test_guided_fields_are_structured_outputs(client, field, kind):
    value = CONSTRAINTS[kind][kind]
    got = client.completions.create(model="qwen3", prompt="out:", max_tokens=150, seed=2,
                                    temperature=1.0, n=2, extra_body={field: value})
    for choice in got.choices:
        assert choice.finish_reason == "stop"
        assert_follows(kind, choice.text)
    got = client.chat.completions.create(model="qwen3", messages=USER, seed=2, max_tokens=150,
                                         extra_body={field: value, **NO_THINKING})
    assert_follows(kind, got.choices[0].message.content)


@pytest.mark.parametrize("extra", [
    {"guided_regex": "a+", "structured_outputs": {"regex": "b+"}},
    {"guided_choice": ["x"], "response_format": {"type": "json_object"}},
    {"guided_choice": ["x"], "guided_regex": "a+"},
])
def test_guided_fields_with_another_constraint_are_refused(server, extra):
    for route, body in (("/v1/completions", {"prompt": "hi"}),
                        ("/v1/chat/completions", {"messages": USER})):
        r = _post(server, route, {**body, **extra, "max_tokens": 4})
        assert r.status_code == 400, r.text
        assert "structured_outputs" in r.json()["error"]["message"]


# ------------------------------------------------------------ continuous_usage_stats


def test_continuous_usage_stats_in_every_chunk(server):
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"prompt": "hello", "max_tokens": 5, "n": 2, "ignore_eos": True, "stream": True,
            "stream_options": options}
    chunks = _chunks(server, "/v1/completions", body)
    assert all(c["usage"] for c in chunks)
    seen = {0: 0, 1: 0}
    for c in chunks[:-1]:  # each choice's own tokens so far (vLLM's)
        i = c["choices"][0]["index"]
        assert c["usage"]["prompt_tokens"] == 5
        assert c["usage"]["completion_tokens"] > seen[i]
        seen[i] = c["usage"]["completion_tokens"]
    assert seen == {0: 5, 1: 5} and chunks[-1]["usage"]["completion_tokens"] == 10
    body = {"messages": USER, "max_tokens": 5, "ignore_eos": True, "stream": True,
            "stream_options": options}
    chunks = _chunks(server, "/v1/chat/completions", body)
    assert all(c["usage"] for c in chunks)
    assert chunks[0]["usage"]["completion_tokens"] == 0  # the role's chunk
    assert chunks[-2]["usage"]["completion_tokens"] == 5
    assert chunks[-1]["usage"]["total_tokens"] == chunks[-2]["usage"]["total_tokens"]


# ------------------------------------------------------------ best_of


def test_best_of_returns_the_most_likely_candidates(client):
    """best_of=3, n=2: the two of the three candidates (seeds 7, 8, 9: the same as n=3's
    choices) with the highest cumulative logprob; usage counts the two returned."""
    kw = dict(model="qwen3", prompt="abc", max_tokens=6, seed=7, temperature=1.0)
    every = client.completions.create(n=3, logprobs=0, **kw)
    ranked = sorted(every.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    best = client.completions.create(n=2, best_of=3, **kw)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in ranked[:2])
    assert best.usage.prompt_tokens == 3


@pytest.mark.parametrize("body, match", [
    ({"best_of": 1, "n": 2}, "best_of must be >= n"),
    ({"best_of": 2, "stream": True}, "cannot be streamed"),
    ({"best_of": 33}, "best_of: Input should be less than or equal to 32"),
    ({"best_of": 0}, "best_of: Input should be greater than or equal to 1"),
])
def test_best_of_refusals(server, body, match):
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **body})
    assert r.status_code == 400 and match in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "best_of"


def test_a_huge_best_of_is_refused_before_anything_is_built(server):
    """Issue 74, finding 1: best_of is bounded as n is, when the request is read: ten million
    candidates are a 400 at once, and the server answers /health meanwhile."""
    started = time.monotonic()
    r = _post(server, "/v1/completions", {"prompt": "hi", "best_of": 10_000_000,
                                          "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text
    assert time.monotonic() - started < 5
    assert httpx.get(f"{server[0]}/health", timeout=5).status_code == 200


# ------------------------------------------------------------ lm-evaluation-harness


def test_lm_eval_loglikelihood_request(server):
    """lm-evaluation-harness's ``local-completions`` loglikelihood: token-id prompts, echo,
    logprobs 1, max_tokens 1, greedy: every prompt token's logprob, the first null."""
    prompts = [[104, 105, 32, 116, 104, 101, 114, 101], [97, 98, 99]]
    r = _post(server, "/v1/completions", {"prompt": prompts, "echo": True, "logprobs": 1,
                                          "max_tokens": 1, "temperature": 0.0, "seed": 1234})
    assert r.status_code == 200, r.text
    for choice, prompt in zip(r.json()["choices"], prompts):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None
        assert all(x <= 0 for x in lp["token_logprobs"][1:])
        assert choice["text"].startswith(bytes(prompt).decode())
        # lm-eval reads "is greedy" from top_logprobs: the sampled token is the top one
        assert max(lp["top_logprobs"][-1].values()) == lp["token_logprobs"][-1]


# ------------------------------------------------------------ reasoning


def _output(text: str, finished: bool = True) -> RequestOutput:
    """A reply of ``text`` (a token per character), finished or still growing."""
    metrics = RequestMetrics(0.0, None, None, None, len(text), 0)
    return RequestOutput("r", [1], list(range(len(text))), finished,
                         "stop" if finished else None, metrics, text_of=lambda n, f: text[:n])


@pytest.mark.parametrize("name, text, reasoning, content", [
    ("qwen3", "<think>\nhm\n</think>\n\nyes", "\nhm\n", "\n\nyes"),
    ("qwen3", "plain answer", None, "plain answer"),  # enable_thinking false
    ("qwen3", "<think>cut off", "cut off", ""),
    ("deepseek_r1", "hm</think>yes", "hm", "yes"),
    ("deepseek_r1", "<think>hm</think>yes", "hm", "yes"),
    ("deepseek_r1", "still thinking", "still thinking", ""),
])
def test_reasoning_parsers_split_the_think_block(name, text, reasoning, content):
    parser = REASONING_PARSERS[name]()
    assert parser.split(text) == (reasoning, content)
    # streamed character by character, the deltas add up to the same split
    req = ChatCompletionRequest(messages=USER)
    stream, sent = _ChoiceStream(req, None, parser), {"reasoning_content": "", "content": ""}
    for end in range(1, len(text) + 1):
        out = _output(text[:end], finished=end == len(text))
        for delta in stream.deltas(out):
            for key in sent:
                sent[key] += getattr(delta, key) or ""
    assert sent == {"reasoning_content": reasoning or "", "content": content}


def test_reasoning_with_hermes_calls_after_it():
    """Tool calls are looked for after the reasoning ends (a call inside it is thought)."""
    from cbatch.entrypoints.openai.serving_chat import OpenAIServingChat

    chat = OpenAIServingChat(None, "m", None, tool_call_parser="hermes",
                             reasoning_parser="qwen3")
    req = ChatCompletionRequest(messages=USER, tools=TOOLS)
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    text = f"<think>maybe {call}</think>\n{call}"
    message, reason = chat.reply(req, _output(text), chat.reasoning_parser)
    assert message.reasoning_content == f"maybe {call}" and reason == "tool_calls"
    assert [c.function.name for c in message.tool_calls] == ["add"]


def test_qwen3_reasoning_parser_leaves_a_plain_reply_as_content(client):
    got = client.chat.completions.create(model="qwen3", messages=USER, max_tokens=8, seed=1,
                                         extra_body={"ignore_eos": True})
    message = got.choices[0].message
    assert message.content and getattr(message, "reasoning_content", None) is None


@pytest.mark.slow
def test_deepseek_r1_reasoning_in_messages_and_deltas(monkeypatch):
    """DeepSeek-R1's rule (the prompt opened the block): a reply without ``</think>`` is all
    reasoning, in the message and in the stream's deltas alike; a constrained reply thinks
    first too (no ``<think>`` of its own), its grammar applying after ``</think>``."""
    with running_server("random:qwen3-tiny", "qwen3", app_kwargs=dict(
            reasoning_parser="deepseek_r1"), **SERVER) as (url, _):
        body = {"model": "qwen3", "messages": USER, "max_tokens": 12, "seed": 4,
                "ignore_eos": True, "temperature": 1.0}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
        message = r["choices"][0]["message"]
        assert message["reasoning_content"] and message["content"] is None
        chunks = _chunks((url,), "/v1/chat/completions", {**body, "stream": True})
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == (
            message["reasoning_content"])
        assert "".join(d.get("content") or "" for d in deltas) == ""
        script_outputs(monkeypatch, b"hm</think>")
        body["response_format"] = {"type": "json_object"}
        body["max_tokens"] = 200
        del body["ignore_eos"]
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
        assert r["choices"][0]["message"]["reasoning_content"] == "hm"
        assert_follows("json_object", r["choices"][0]["message"]["content"])
