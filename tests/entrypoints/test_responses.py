"""OpenAI's Responses API (``POST /v1/responses``) through the openai SDK's
``client.responses.create`` / ``client.responses.stream`` and plain HTTP, streamed and not,
against random:qwen3-tiny with its own Qwen3 template: string and item inputs (messages,
function_call, function_call_output), instructions, max_output_tokens, tools with each
tool_choice, text.format's JSON schema (enforced: every output validates), the event
sequence, usage, and the stateless server's refusal of previous_response_id."""

import json

import httpx
import jsonschema
import pytest

from cbatch.entrypoints.openai.protocol_responses import ResponsesRequest
from tests.serving_utils import running_server
from tests.structured_utils import PERSON, assert_follows

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

ADD = {"type": "object",
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                      "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "add", "description": "a + b", "parameters": ADD}]
JSON_FORMAT = {"format": {"type": "json_schema", "name": "person", "schema": PERSON}}
# a function whose parameters schema xgrammar cannot read
BROKEN = {"type": "function", "name": "broken",
          "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}


@pytest.fixture(scope="module")
def server():
    with running_server("random:qwen3-tiny", "qwen3", max_num_seqs=8, seed=0,
                        app_kwargs=dict(tool_call_parser="hermes")) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="-", max_retries=0)


def _post(server, body):
    return httpx.post(f"{server[0]}/v1/responses", json={"model": "qwen3", **body},
                      timeout=120)


def _events(server, body) -> list[dict]:
    with httpx.stream("POST", f"{server[0]}/v1/responses",
                      json={"model": "qwen3", "stream": True, **body}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = list(r.iter_lines())
    names = [line[7:] for line in lines if line.startswith("event: ")]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert names == [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_a_string_input(client, server):
    got = client.responses.create(model="qwen3", input="hi", max_output_tokens=6,
                                  instructions="be brief", extra_body={"seed": 1})
    assert got.status == "incomplete" and got.incomplete_details.reason == "max_output_tokens"
    assert got.usage.output_tokens == 6 and got.output_text
    assert got.usage.total_tokens == got.usage.input_tokens + 6
    assert got.output[0].type == "message" and got.output[0].role == "assistant"
    # the same prompt as chat's, through the same template (instructions: a system message)
    chat = httpx.post(f"{server[0]}/v1/chat/completions", json={
        "model": "qwen3", "max_tokens": 6, "seed": 1, "messages": [
            {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]})
    assert chat.json()["choices"][0]["message"]["content"] == got.output_text
    assert chat.json()["usage"]["prompt_tokens"] == got.usage.input_tokens


@pytest.mark.slow
def test_json_schema_without_max_output_tokens(client):
    """text.format is structured output (the same grammar as chat's response_format), and
    without max_output_tokens the reply may use the rest of the context: it completes."""
    got = client.responses.create(model="qwen3", input="a person", text=JSON_FORMAT,
                                  temperature=1.0, extra_body={"seed": 2})
    assert got.status == "completed"
    assert_follows("json", got.output_text)
    with client.responses.stream(model="qwen3", input="a person", text=JSON_FORMAT,
                                 temperature=1.0, extra_body={"seed": 2}) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == got.output_text
    assert final.status == "completed" and final.usage.output_tokens == got.usage.output_tokens


def test_the_event_sequence(server):
    events = _events(server, {"input": "hi", "max_output_tokens": 5, "seed": 3})
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == (["response.created", "response.in_progress",
                      "response.output_item.added", "response.content_part.added"]
                     + ["response.output_text.delta"] * deltas
                     + ["response.output_text.done", "response.content_part.done",
                        "response.output_item.done", "response.incomplete"])
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert events[-4]["text"] == text and events[-1]["response"]["output"][0]["content"][0][
        "text"] == text
    assert events[-1]["response"]["usage"]["output_tokens"] == 5
    assert events[0]["response"]["status"] == "in_progress"


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_call(client, stream):
    kw = dict(model="qwen3", input="add 2 and 3", tools=TOOLS, tool_choice="required",
              parallel_tool_calls=False, temperature=1.0, max_output_tokens=200,
              extra_body={"seed": 4})
    if stream:
        with client.responses.stream(**kw) as s:
            got = s.get_final_response()
    else:
        got = client.responses.create(**kw)
    calls = [item for item in got.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "add" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), ADD)
    named = client.responses.create(**{**kw, "tool_choice": {"type": "function",
                                                             "name": "add"}})
    assert [item.name for item in named.output] == ["add"]
    jsonschema.validate(json.loads(named.output[0].arguments), ADD)


def test_function_call_items_in_the_input(client, server):
    """A conversation with the model's call and the tool's answer: the template renders them
    as chat's tool calls and tool messages."""
    items = [{"role": "user", "content": [{"type": "input_text", "text": "add 2 and 3"}]},
             {"type": "function_call", "call_id": "call_1", "name": "add",
              "arguments": '{"a": 2, "b": 3}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "5"}]
    got = client.responses.create(model="qwen3", input=items, tools=TOOLS,
                                  max_output_tokens=4, extra_body={"seed": 5})
    assert got.usage.output_tokens == 4
    prompt = httpx.post(f"{server[0]}/tokenize", json={"messages": ResponsesRequest(
        input=items).to_chat().model_dump()["messages"]}).json()["tokens"]
    text = bytes(prompt).decode()
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in text
    assert "<tool_response>\n5\n</tool_response>" in text
    assert got.usage.input_tokens > len(prompt)  # and the tools' system turn


@pytest.mark.parametrize("body, param, match", [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stateless"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]", "tools[0]: only function tools"),
    ({"input": [{"type": "image", "url": "x"}]}, "input.0", "not supported"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type", "json_schema"),
    # issue 74, finding 4: text.format not an object is a 400, not a 500
    ({"text": {"format": "json"}}, "text.format", "text.format must be an object"),
    ({"text": {"format": 5}}, "text.format", "text.format must be an object"),
    ({"text": {"format": []}}, "text.format", "text.format must be an object"),
    # finding 6: the Responses request's own fields, never chat's, and never param null
    ({"text": {"format": {"type": "json_schema"}}}, "text.format.schema",
     "text.format.schema must be a JSON schema"),
    ({"text": {"format": {"type": "json_schema", "schema": 5}}}, "text.format.schema",
     "text.format.schema must be a JSON schema"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be an int >= 1"),
    ({"input": [{"role": "user", "content": "x"}] * 3000}, "input", "input has 3000 items"),
    ({"input": "x" * 20000}, "input", "input: the rendered messages"),
    ({"tools": [{"type": "function", "name": "f", "parameters": 5}]}, "tools[0].parameters",
     "tools[0].parameters: Input should be a valid dictionary"),
    ({"tool_choice": 7}, "tool_choice", "tool_choice: Input should be a valid string"),
    # a constraint the grammar refuses is named as this API spells it (not chat's name)
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     "text.format.schema", "text.format.schema is not a valid JSON schema"),
    ({"tools": TOOLS + [BROKEN], "tool_choice": "required"}, "tools[1].parameters",
     "tools[1].parameters is not a valid JSON schema"),
    ({"tools": TOOLS + [BROKEN], "tool_choice": {"type": "function", "name": "broken"}},
     "tools[1].parameters", "tools[1].parameters is not a valid JSON schema"),
])
def test_refusals(server, body, param, match):
    r = _post(server, {"input": "hi", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert match in error["message"] and error["param"] == param, error
    for chat_name in ("max_tokens", "max_completion_tokens", "response_format", "messages:",
                      ".function."):
        assert chat_name not in error["message"], error


@pytest.mark.slow
def test_a_reasoning_item_with_deepseek_r1():
    """--reasoning-parser: the thinking is a reasoning item before the message (a reply
    without </think> is all reasoning, DeepSeek-R1's rule), streamed as reasoning_text."""
    with running_server("random:qwen3-tiny", "qwen3", max_num_seqs=2, seed=0, app_kwargs=dict(
            reasoning_parser="deepseek_r1")) as (url, _):
        body = {"model": "qwen3", "input": "hi", "max_output_tokens": 5, "seed": 6}
        got = httpx.post(f"{url}/v1/responses", json=body, timeout=60).json()
        kinds = [item["type"] for item in got["output"]]
        assert kinds == ["reasoning", "message"]
        thought = got["output"][0]["content"][0]["text"]
        assert thought and got["output"][1]["content"][0]["text"] == ""
        events = _events((url,), body)
        assert "".join(e["delta"] for e in events
                       if e["type"] == "response.reasoning_text.delta") == thought


def test_an_output_that_could_not_follow_text_format_names_it():
    """The engine names a constraint structured_outputs.<kind>; a Responses error names the
    request's own field, as its param too."""
    from cbatch.entrypoints.openai.serving_engine import OpenAIError
    from cbatch.entrypoints.openai.serving_responses import responses_error

    error = responses_error(OpenAIError(400, "choice 0: structured_outputs.json cannot be "
                                             "followed together with the request's other "
                                             "rules"), "text.format.schema")
    assert error.message.startswith("choice 0: text.format.schema cannot be followed")
    assert error.param == "text.format.schema"
    error = responses_error(OpenAIError(400, "max_tokens must be an int >= 1, got 0",
                                        param="max_tokens"))
    assert (error.message, error.param) == ("max_output_tokens must be an int >= 1, got 0",
                                            "max_output_tokens")
