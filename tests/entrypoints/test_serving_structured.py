"""Structured outputs and tool calls through the server, asked the way clients ask: OpenAI's
``response_format`` and vLLM's ``structured_outputs`` on both endpoints, streamed and not, n
choices; ``tools`` with ``tool_choice`` required, a function, auto (Hermes calls, with
``--enable-auto-tool-choice --tool-call-parser hermes``) and none, through the openai SDK.  A
random-weight model's every output parses and validates; a bad constraint is a 400 naming
it."""

import json
import os
import re
import socket
import time

import httpx
import jsonschema
import pytest

from cbatch.entrypoints.openai.protocol import ChatCompletionRequest
from cbatch.entrypoints.openai.serving_chat import OpenAIServingChat
from cbatch.entrypoints.openai.tool_parsers import HermesToolParser
from tests.serving_utils import running_server
from tests.structured_utils import ADD, CONSTRAINTS, PERSON, WEATHER, assert_follows

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

# a compact ChatML with Hermes tool calls (random:tiny reads 256 bytes at most): the tools'
# names, the history's calls as <tool_call> JSON, tool answers as <tool_response>
TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ nl }}"
    "{% endif %}{% for m in messages %}"
    "{% if m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>{{ nl }}"
    "{% elif m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{\"name\": "
    "{{ c.function.name | tojson }}, \"arguments\": {{ c.function.arguments | tojson }}}"
    "</tool_call>{% endfor %}{{ nl }}"
    "{% else %}{{ m.role }}: {{ m.content }}{{ nl }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}").replace("{{ nl }}", "{{ '\\n' }}")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "a + b",
                                           "parameters": ADD}},
         {"type": "function", "function": {"name": "ping"}}]  # no parameters: {}
SCHEMAS = {"get_weather": WEATHER, "add": ADD, "ping": {"type": "object", "properties": {},
                                                         "additionalProperties": False}}
USER = [{"role": "user", "content": "weather in paris?"}]


@pytest.fixture(scope="module")
def server():
    with running_server("random:tiny", max_num_seqs=8, app_kwargs=dict(
            chat_template=TEMPLATE, tool_call_parser="hermes")) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="-", max_retries=0)


def _assert_call(call, name=None):
    """A tool call: one of TOOLS, its arguments a JSON object its schema validates."""
    assert call.type == "function" and call.id
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# -------------------------------------------------------------- structured outputs

@pytest.mark.parametrize("kind", list(CONSTRAINTS))
@pytest.mark.parametrize("stream", [False, True])
def test_structured_outputs_on_completions(client, kind, stream):
    """vLLM's ``structured_outputs``, n choices each its own seed, streamed or not."""
    got = client.completions.create(
        model="tiny", prompt="out:", max_tokens=150, temperature=1.0, seed=5, n=3,
        stream=stream, extra_body={"structured_outputs": CONSTRAINTS[kind]})
    texts, reasons = {}, {}
    for chunk in got if stream else [got]:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    assert sorted(texts) == [0, 1, 2]
    for i, text in texts.items():
        if kind == "json_object" and reasons[i] == "length":
            continue  # its strings are unbounded (the engine's tests bound how often)
        assert reasons[i] == "stop"
        assert_follows(kind, text)


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_on_chat(client, stream):
    got = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=150, temperature=1.0, seed=1, n=2,
        stream=stream, response_format={"type": "json_schema", "json_schema": {
            "name": "person", "schema": PERSON, "strict": True}})
    texts = {}
    for chunk in got if stream else [got]:
        for c in chunk.choices:
            part = c.delta.content if stream else c.message.content
            texts[c.index] = texts.get(c.index, "") + (part or "")
    assert len(texts) == 2
    for text in texts.values():
        assert_follows("json", text)


def test_response_format_json_object_and_text(client):
    got = client.completions.create(model="tiny", prompt="{", max_tokens=150,
                                    temperature=1.0, seed=0, n=4,
                                    extra_body={"response_format": {"type": "json_object"}})
    finished = [c.text for c in got.choices if c.finish_reason == "stop"]
    assert finished
    for text in finished:
        assert_follows("json_object", text)
    plain = client.completions.create(model="tiny", prompt="x", max_tokens=5, seed=0,
                                      extra_body={"response_format": {"type": "text"},
                                                  "ignore_eos": True})
    assert plain.choices[0].finish_reason == "length"


@pytest.mark.parametrize("extra, match", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "not a valid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "json_schema.schema"),
    ({"structured_outputs": {"regex": "a(b"}}, "regex is not a valid regular expression"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "undefined_rule"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs takes"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "either response_format or structured_outputs"),
])
@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_an_invalid_constraint_is_a_400_naming_it(server, client, route, extra, match):
    body = {"prompt": "x"} if route == "completions" else {"messages": USER}
    r = httpx.post(f"{server[0]}/v1/{route}", json={"model": "tiny", **body, **extra},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert match in r.json()["error"]["message"]
    assert not server[1].engine.structured.held  # nothing was admitted
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=2).choices


# a choice of 100,000 strings: its compile takes many seconds on any machine
SLOW = {"choice": [f"option number {i} of a long list" for i in range(100_000)]}
# a $ref cycle: the schema of a value that must hold itself; xgrammar up to 0.2.8 compiles
# it into a grammar with no output, 0.2.9 refuses the schema ("Circular $ref chain"): either
# message is a right refusal
CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
CYCLE_REFUSED = ("matches no output at all", "is not a valid JSON schema")


def _wait_for(condition, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.parametrize("extra, param, match", [
    ({"structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs.grammar",
     "structured_outputs.grammar matches no output at all"),
    ({"structured_outputs": {"json": {"$ref": "#"}}}, "structured_outputs.json",
     tuple(f"structured_outputs.json {m}" for m in CYCLE_REFUSED)),
    ({"structured_outputs": {"json": CYCLE}}, "structured_outputs.json",
     tuple(f"structured_outputs.json {m}" for m in CYCLE_REFUSED)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": CYCLE}}},
     "response_format.json_schema.schema",
     tuple(f"response_format.json_schema.schema {m}" for m in CYCLE_REFUSED)),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format.json_schema.schema",
     "response_format.json_schema.schema is not a valid JSON schema"),
    ({"guided_grammar": "root ::= root"}, "guided_grammar",
     "guided_grammar matches no output at all"),
    ({"structured_outputs": {"regex": "[a-z]{3}"}, "allowed_token_ids": [48, 49]},
     "allowed_token_ids", "allowed_token_ids allows no token that can begin an output"),
    # only generation tells: a later token of the constraint's is forbidden
    ({"structured_outputs": {"regex": "abc"}, "allowed_token_ids": [97, 98]}, None,
     "choice 0: structured_outputs.regex cannot be followed together with the request's "
     "other rules"),
    ({"structured_outputs": {"choice": ["yes", "no"]}, "bad_words": ["yes", "no"]}, None,
     "choice 0: structured_outputs.choice cannot be followed together with the request's "
     "other rules"),
])
@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_a_constraint_nothing_can_follow_is_a_400(server, client, route, extra, param, match):
    body = {"prompt": "x"} if route == "completions" else {"messages": USER}
    r = httpx.post(f"{server[0]}/v1/{route}", timeout=60,
                   json={"model": "tiny", **body, "max_tokens": 8, "seed": 0, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    matches = match if isinstance(match, tuple) else (match,)  # one of them
    assert any(m in error["message"] for m in matches), error["message"]
    assert error["param"] == param
    assert "Traceback" not in error["message"]
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=2).choices


def test_a_streamed_constraint_nothing_can_follow_ends_with_an_error_chunk(server):
    with httpx.stream("POST", f"{server[0]}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "x", "max_tokens": 8, "stream": True,
            "structured_outputs": {"choice": ["yes", "no"]}, "bad_words": ["yes", "no"]}) as r:
        assert r.status_code == 200
        chunks = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    error = json.loads(chunks[-2])["error"]
    assert error["type"] == "invalid_request_error"
    assert "structured_outputs.choice cannot be followed together" in error["message"]


def test_the_servers_process_parses_no_constraint(server, monkeypatch):
    """Schemas and grammars are parsed in the compile workers' processes: neither on the event
    loop nor on the thread pool that tokenizes prompts."""
    from cbatch.core.structured_output import grammar, manager

    def refuse(*args, **kwargs):
        raise AssertionError("a constraint was parsed in the server's process")

    monkeypatch.setattr(grammar, "parse_grammar", refuse)
    monkeypatch.setattr(manager, "parse_grammar", refuse)
    schema = {"type": "object", "properties": {"parsed_elsewhere": {"type": "boolean"}},
              "required": ["parsed_elsewhere"], "additionalProperties": False}
    r = httpx.post(f"{server[0]}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "x", "max_tokens": 40, "structured_outputs": {"json": schema}})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), schema)


@pytest.mark.slow  # a server, and a 100,000-entry choice's compile
def test_a_compile_past_its_time_budget_is_a_400():
    with running_server("random:tiny", grammar_compile_timeout=0.5) as (url, engine):
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": "x", "max_tokens": 8, "structured_outputs": SLOW})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "structured_outputs.choice"
        assert ("takes longer than this engine's limit of 0.5 s to compile "
                "(grammar_compile_timeout)") in error["message"]
        _wait_for(lambda: not engine.engine.structured.pool.busy_pids())
        assert not engine.engine.structured.held


@pytest.mark.slow  # a server, two compile workers, and a 100,000-entry choice's compile
def test_a_heavy_compile_holds_up_no_other_and_stops_when_its_client_leaves():
    """While a 100,000-entry choice compiles, /health answers within 1 s each time and a
    3-character regex compiles and its request finishes; when its client leaves, the heavy
    compile is stopped (its worker killed)."""
    with running_server("random:tiny", max_num_seqs=4, grammar_compile_workers=2,
                        grammar_compile_timeout=600) as (url, engine):
        pool = engine.engine.structured.pool
        killed = pool.num_killed
        body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 8,
                           "structured_outputs": SLOW}).encode()
        port = int(url.rsplit(":", 1)[1])
        heavy = socket.create_connection(("127.0.0.1", port))
        heavy.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                      % len(body) + body)
        _wait_for(lambda: pool.busy_pids(), timeout_s=120)
        [pid] = pool.busy_pids()
        for _ in range(5):  # (each within 1 s, or httpx raises)
            assert httpx.get(f"{url}/health", timeout=1.0).status_code == 200
            time.sleep(0.1)
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": "x", "max_tokens": 8, "temperature": 1.0,
            "structured_outputs": {"regex": "[ab]{3}"}})
        assert r.status_code == 200 and re.fullmatch("[ab]{3}", r.json()["choices"][0]["text"])
        assert pool.busy_pids() == [pid]  # the heavy compile runs on
        heavy.close()  # its client leaves: nobody waits for it, so it is stopped
        _wait_for(lambda: not pool.busy_pids() and not os.path.exists(f"/proc/{pid}"))
        assert pool.num_killed == killed + 1
        assert httpx.get(f"{url}/health", timeout=1.0).status_code == 200


# -------------------------------------------------------------- tool calls

@pytest.mark.parametrize("name", ["get_weather", "add", "ping"])
def test_a_named_tool_choice_returns_a_valid_call(client, name):
    got = client.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, max_tokens=120, temperature=1.0, seed=2,
        tool_choice={"type": "function", "function": {"name": name}})
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    _assert_call(call, name)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_returns_valid_calls(client, parallel):
    num_calls = []
    for seed in range(4):  # (with parallel calls allowed, some seed calls several at once)
        got = client.chat.completions.create(
            model="tiny", messages=USER, tools=TOOLS, tool_choice="required", max_tokens=190,
            temperature=1.0, seed=seed, n=3, parallel_tool_calls=parallel)
        for choice in got.choices:
            assert choice.finish_reason == "tool_calls", choice
            calls = choice.message.tool_calls
            assert len(calls) >= 1 and (parallel or len(calls) == 1)
            num_calls.append(len(calls))
            for call in calls:
                _assert_call(call)
            assert len({c.id for c in calls}) == len(calls)
    assert max(num_calls) > 1 if parallel else True


def _streamed_calls(stream):
    """{index: [name, arguments]} and the finish reason, from the chunks of one choice."""
    calls, reason, content = {}, None, ""
    for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, ["", ""])
            if piece.function.name:
                assert piece.id and piece.type == "function" and not call[0]
                call[0] = piece.function.name
            call[1] += piece.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return calls, reason, content


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_parse_with_the_sdk(client, tool_choice):
    stream = client.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, tool_choice=tool_choice, max_tokens=190,
        temperature=1.0, seed=6, stream=True)
    calls, reason, content = _streamed_calls(stream)
    assert reason == "tool_calls" and calls and not content
    for name, arguments in calls.values():
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    if tool_choice != "required":
        assert [c[0] for c in calls.values()] == ["get_weather"]


# the model's reply in Hermes' format, forced by a grammar (a random model would not write it)
HERMES_REPLY = ('root ::= "Let me look.\\n<tool_call>\\n{\\"name\\": \\"get_weather\\", '
                '\\"arguments\\": {\\"city\\": \\"" [a-z]{1,6} "\\", \\"unit\\": \\"c\\"}}\\n'
                '</tool_call>"')


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_hermes_calls(client, stream):
    got = client.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, max_tokens=120, temperature=1.0, seed=5,
        stream=stream, extra_body={"structured_outputs": {"grammar": HERMES_REPLY}})
    if stream:
        calls, reason, content = _streamed_calls(got)
        assert reason == "tool_calls" and content.strip() == "Let me look."
        [(name, arguments)] = calls.values()
    else:
        choice = got.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me look."
        [call] = choice.message.tool_calls
        name, arguments = call.function.name, call.function.arguments
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER)


def test_tool_choice_none_and_a_reply_without_calls_are_plain_text(client):
    for tool_choice in ("none", "auto"):
        got = client.chat.completions.create(
            model="tiny", messages=USER, tools=TOOLS, tool_choice=tool_choice, max_tokens=8,
            temperature=1.0, seed=0, extra_body={"structured_outputs": {"choice": ["sunny"]}})
        assert got.choices[0].message.content == "sunny"
        assert got.choices[0].message.tool_calls is None
        assert got.choices[0].finish_reason == "stop"


def test_a_tool_call_history_renders_through_the_template(client):
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    chat = OpenAIServingChat(None, "tiny", TEMPLATE)
    req = ChatCompletionRequest(messages=history, tools=TOOLS, tool_choice="none")
    assert chat.render(req) == (
        "tools: get_weather add ping\nuser: weather in paris?\n"
        '<tool_call>{"name": "get_weather", "arguments": {"city": "paris"}}</tool_call>\n'
        "<tool_response>sunny</tool_response>\nassistant: ")
    got = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                         tool_choice="none", max_tokens=3)
    assert got.usage.prompt_tokens == len(chat.render(req).encode())


@pytest.mark.parametrize("extra, match", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "'nope', which is not among the tools"),
    ({"tool_choice": "required"}, 'tool_choice "required" needs tools'),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "structured output already"),
])
def test_bad_tool_requests_are_400s(server, extra, match):
    r = httpx.post(f"{server[0]}/v1/chat/completions",
                   json={"model": "tiny", "messages": USER, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    assert match in r.json()["error"]["message"]


# a function whose parameters schema xgrammar cannot read
BROKEN = {"type": "function", "function": {"name": "broken", "parameters": {
    "type": "object", "properties": {"x": {"type": "nonsense"}}}}}


@pytest.mark.parametrize("tools, tool_choice, param", [
    (TOOLS + [BROKEN], {"type": "function", "function": {"name": "broken"}},
     "tools[3].function.parameters"),
    ([BROKEN], "required", "tools[0].function.parameters"),
    (TOOLS[:2] + [BROKEN, TOOLS[2]], "required", "tools[2].function.parameters"),
])
def test_a_bad_tool_parameters_schema_is_a_400_naming_it(server, tools, tool_choice, param):
    r = httpx.post(f"{server[0]}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": USER, "tools": tools, "tool_choice": tool_choice})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert error["message"].startswith(f"{param} is not a valid JSON schema: ")
    assert "nonsense" in error["message"]


def test_auto_tool_choice_without_the_flags_is_a_400():
    """vLLM's rule: tools without tool_choice mean "auto", which needs a parser."""
    with running_server("random:tiny", app_kwargs=dict(chat_template=TEMPLATE)) as (url, _):
        for extra in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
            r = httpx.post(f"{url}/v1/chat/completions",
                           json={"model": "tiny", "messages": USER, **extra}, timeout=60)
            assert r.status_code == 400
            assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": USER, "tools": TOOLS, "tool_choice": "required",
            "max_tokens": 180, "temperature": 1.0, "seed": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"]


# -------------------------------------------------------------- the Hermes parser

@pytest.mark.parametrize("text, content, calls", [
    ("no calls here", "no calls here", []),
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', None,
     [("f", '{"x": 1}')]),
    ('Sure.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n'
     '<tool_call>{"name": "g", "arguments": {"s": "é"}}</tool_call>', "Sure.",
     [("f", "{}"), ("g", '{"s": "é"}')]),
    ('<tool_call>{"name": "f", "arguments": {"x": 1}}', None, [("f", '{"x": 1}')]),  # unclosed
    ('<tool_call>{"name": "f", "arguments": {"x": </tool_call>', None, None),  # bad JSON
    ('<tool_call>{"arguments": {}}</tool_call>', None, None),  # no name
])
def test_hermes_parser_extracts_calls(text, content, calls):
    got = HermesToolParser().extract(text)
    if calls is None:  # not a call: the whole reply is content
        assert got.content == text and not got.tool_calls
        return
    assert got.content == content
    assert [(c.name, c.arguments) for c in got.tool_calls] == calls


@pytest.mark.parametrize("text, end", [
    ("hello", 5), ("hello <tool", 6), ("hello <tool_call>{", 6), ("a<", 1), ("a <b", 4),
    ("", 0),
])
def test_hermes_parser_streams_content_up_to_a_call(text, end):
    assert HermesToolParser().content_end(text) == end


def test_enable_auto_tool_choice_needs_a_parser():
    from cbatch.entrypoints.cli.main import build_parser
    from cbatch.entrypoints.openai.cli_args import check_serve_args, tool_settings

    args = build_parser().parse_args(["serve", "random:tiny", "--enable-auto-tool-choice"])
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        check_serve_args(args)
    args = build_parser().parse_args(["serve", "random:tiny", "--enable-auto-tool-choice",
                                      "--tool-call-parser", "hermes"])
    check_serve_args(args)
    assert tool_settings(args) == {"tool_call_parser": "hermes", "reasoning_parser": None}
    args = build_parser().parse_args(["serve", "random:tiny", "--tool-call-parser", "hermes",
                                      "--reasoning-parser", "qwen3"])
    assert tool_settings(args) == {"tool_call_parser": None, "reasoning_parser": "qwen3"}


# ------------------------------------------ issue 74, finding 2: warm grammar workers


def test_a_fresh_servers_first_constraint_starts_no_grammar_worker():
    """The server starts its grammar workers before it serves, with its vocabulary loaded in
    them: its first constraint forks and loads nothing."""
    with running_server("random:tiny") as (url, engine):
        pool = engine.engine.structured.pool
        assert pool.is_warm()
        forked = pool.num_forked
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "x", "max_tokens": 8,
            "structured_outputs": {"regex": "[xy]{3}z"}})
        assert r.status_code == 200, r.text
        assert re.fullmatch("[xy]{3}z", r.json()["choices"][0]["text"])
        assert pool.num_forked == forked


def test_a_constraint_that_got_no_worker_within_its_budget_is_a_503():
    import asyncio

    from cbatch.core.structured_output import WorkersBusy
    from cbatch.entrypoints.openai.serving_engine import OpenAIError, open_streams
    from cbatch.sampling_params import SamplingParams

    class Busy:
        async def add_requests(self, *args, **kwargs):
            raise WorkersBusy("no grammar compile worker was free within this engine's limit")

    with pytest.raises(OpenAIError) as caught:
        asyncio.run(open_streams(Busy(), ["x"], [SamplingParams()], stream=False))
    assert caught.value.status == 503 and caught.value.type == "server_overloaded"
    assert "no grammar compile worker was free" in caught.value.message


# ---------------------------------------------- issue 74, finding 5: deeply nested schemas


def _nested(levels: int) -> dict:
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize("body, field", [
    ({"structured_outputs": {"json": _nested(300)}}, "structured_outputs.json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "deep",
                                                                 "schema": _nested(300)}}},
     "response_format.json_schema.schema"),
])
def test_a_schema_nested_300_deep_is_a_400_naming_it(server, body, field):
    """A schema nests 601 lists and objects here, past MAX_CONSTRAINT_DEPTH (512): refused
    before anything walks it recursively (pickling it for a worker was a 500); 200 levels
    (401) are served."""
    r = httpx.post(f"{server[0]}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "x", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field
    assert error["message"] == (f"{field} nests lists and objects 601 deep; this server takes "
                                "at most 512")
    r = httpx.post(f"{server[0]}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": "x", "max_tokens": 4,
        "structured_outputs": {"json": _nested(200)}})
    assert r.status_code == 200, r.text


def test_nesting_depth_walks_without_recursion():
    from cbatch.core.structured_output.manager import nesting_depth

    assert nesting_depth("x") == 0 and nesting_depth({}) == 1 and nesting_depth([[], {}]) == 2
    deep: list = []
    for _ in range(100_000):  # (recursion would stop near a thousand)
        deep = [deep]
    assert nesting_depth(deep) == 100_001
