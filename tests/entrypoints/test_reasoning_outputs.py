"""Structured output and forced tool calls after the reasoning (issue 51): with
``--reasoning-parser``, a constrained reply thinks first and its grammar applies once
``</think>`` is written (vLLM's rule), through the openai SDK and plain HTTP, streamed and
not, against random:qwen3-tiny (its byte-level tokenizer: ``</think>`` is eight tokens).

The model's thinking is scripted (:func:`tests.structured_utils.script_outputs`): the
script's ``<`` can begin no JSON, so it appears only if no grammar applied while the reply
reasoned, and the content after it is the model's own under the grammar.  The prompt
decides as vLLM's does: where it closes the block (Qwen3's ``enable_thinking: false``) the
grammar applies from the first token, and the script cannot land."""

import json

import httpx
import jsonschema
import pytest

from tests.serving_utils import running_server
from tests.structured_utils import ADD, PERSON, WEATHER, assert_follows, script_outputs

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")

THOUGHT = "\nhm, who?\n"  # the reasoning_content of the script below
SCRIPT = f"<think>{THOUGHT}</think>".encode()
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
USER = [{"role": "user", "content": "who is it?"}]
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


@pytest.fixture(scope="module")
def server():
    with running_server("random:qwen3-tiny", "qwen3", max_num_seqs=8, seed=0, app_kwargs=dict(
            tool_call_parser="hermes", reasoning_parser="qwen3")) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="-", max_retries=0)


@pytest.fixture
def thinking(monkeypatch):
    script_outputs(monkeypatch, SCRIPT)


def _chat(client, stream: bool, **kw) -> list[dict]:
    """Each choice as {reasoning, content, calls, finish}: the message's, or the stream's
    deltas added up."""
    kw = {"model": "qwen3", "messages": USER, "max_tokens": 200, "seed": 3,
          "temperature": 1.0, **kw}
    if not stream:
        return [{"reasoning": getattr(c.message, "reasoning_content", None),
                 "content": c.message.content, "calls": c.message.tool_calls or [],
                 "finish": c.finish_reason}
                for c in client.chat.completions.create(**kw).choices]
    got: dict[int, dict] = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            one = got.setdefault(c.index, {"reasoning": None, "content": None, "calls": [],
                                           "finish": None})
            for key, piece in (("reasoning", getattr(c.delta, "reasoning_content", None)),
                               ("content", c.delta.content)):
                if piece:
                    one[key] = (one[key] or "") + piece
            for call in c.delta.tool_calls or []:
                if call.id is not None:
                    one["calls"].append(call)
                else:
                    one["calls"][call.index].function.arguments += call.function.arguments
            one["finish"] = c.finish_reason or one["finish"]
    return [got[i] for i in sorted(got)]


def _assert_calls(calls, count=None):
    assert calls and (count is None or len(calls) == count)
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_follows_the_reasoning(client, thinking, stream):
    for choice in _chat(client, stream, n=2, response_format=PERSON_FORMAT):
        assert choice["finish"] == "stop" and choice["reasoning"] == THOUGHT
        assert_follows("json", choice["content"])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "add"}}])
def test_a_forced_tool_call_follows_the_reasoning(client, thinking, stream, tool_choice):
    for choice in _chat(client, stream, n=2, tools=TOOLS, tool_choice=tool_choice,
                        parallel_tool_calls=False):
        assert choice["finish"] == "tool_calls" and choice["reasoning"] == THOUGHT
        assert not choice["content"]
        _assert_calls(choice["calls"], count=1)
        if isinstance(tool_choice, dict):
            assert choice["calls"][0].function.name == "add"


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_that_closed_the_block_is_constrained_from_the_first_token(
        client, thinking, stream):
    """enable_thinking false: the template wrote ``<think>\\n\\n</think>\\n\\n``, so the reply
    is all answer: the grammar forbids the script's ``<``, and nothing is reasoning."""
    for choice in _chat(client, stream, response_format=PERSON_FORMAT,
                        extra_body={"chat_template_kwargs": {"enable_thinking": False}}):
        assert choice["reasoning"] is None and choice["finish"] == "stop"
        assert_follows("json", choice["content"])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("constraint", [
    {"response_format": PERSON_FORMAT}, {"tools": TOOLS, "tool_choice": "required"}])
def test_reasoning_cut_off_by_max_tokens_returns_no_content(
        client, monkeypatch, stream, constraint):
    """The grammar never applied: the reply is all reasoning, finish "length", and nothing
    unconstrained comes back as content or as a call."""
    script_outputs(monkeypatch, b"<think>" + b"a" * 100)
    for choice in _chat(client, stream, n=2, **{**constraint, "max_tokens": 20}):
        assert choice["finish"] == "length" and choice["reasoning"] == "a" * 13
        assert not choice["content"] and not choice["calls"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("constraint", [
    {"response_format": PERSON_FORMAT}, {"tools": TOOLS, "tool_choice": "required"}])
def test_a_reply_cannot_end_inside_its_reasoning_as_if_it_answered(
        client, monkeypatch, stream, constraint):
    """Issue 74, part 4: the model would end its reply (EOS, 511, pushed far up) before
    ``</think>``; its constraint has not begun, so the end token is masked while it reasons:
    the reply goes on to max_tokens ("length", as vLLM says of a cut-off reply), never
    "stop" with no JSON and no call.  (15 tokens after the script cannot hold ``</think>``
    and an answer.)"""
    script_outputs(monkeypatch, b"<think>hm")
    for choice in _chat(client, stream, n=2, logit_bias={"511": 100}, max_tokens=24,
                        **constraint):
        assert choice["finish"] == "length", choice
        assert choice["reasoning"].startswith("hm") and not choice["content"]
        assert not choice["calls"]


def test_responses_text_format_follows_the_reasoning_and_counts_it(server, client, thinking):
    """The Responses API: a reasoning item, then the message of JSON; usage's
    reasoning_tokens are the thought's own tokens (its tags not counted), streamed too."""
    text = {"format": {"type": "json_schema", "name": "person", "schema": PERSON}}
    got = client.responses.create(model="qwen3", input="who?", text=text, max_output_tokens=200,
                                  extra_body={"seed": 2})
    assert [item.type for item in got.output] == ["reasoning", "message"]
    assert got.output[0].content[0].text == THOUGHT
    assert_follows("json", got.output_text)
    reasoning_tokens = len(THOUGHT.encode())  # (a token a byte)
    assert got.usage.output_tokens_details.reasoning_tokens == reasoning_tokens
    assert got.usage.output_tokens > len(SCRIPT)
    with client.responses.stream(model="qwen3", input="who?", text=text, max_output_tokens=200,
                                 extra_body={"seed": 2}) as stream:
        final = stream.get_final_response()
    assert final.usage.output_tokens_details.reasoning_tokens == reasoning_tokens
    assert final.output_text == got.output_text
    # an unconstrained reply that thinks counts its thinking too; one that does not, none
    body = {"model": "qwen3", "input": "hi", "max_output_tokens": 30, "seed": 2}
    usage = httpx.post(f"{server[0]}/v1/responses", json=body, timeout=60).json()["usage"]
    assert usage["output_tokens_details"]["reasoning_tokens"] == reasoning_tokens


def test_chat_without_a_reasoning_parser_is_constrained_from_the_first_token(
        monkeypatch):
    """No parser: the grammar does not wait (the script's ``<`` cannot land)."""
    script_outputs(monkeypatch, SCRIPT)
    with running_server("random:qwen3-tiny", "qwen3", max_num_seqs=2, seed=0) as (url, _):
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": "qwen3", "messages": USER, "max_tokens": 200, "seed": 1,
            "response_format": PERSON_FORMAT}).json()
        assert_follows("json", r["choices"][0]["message"]["content"])


# ------------------------------------------------------------ the parsers' token rules


@pytest.mark.parametrize("name, text, count", [
    ("qwen3", "<think>ab</think>cd", 2), ("qwen3", " <think>ab", 2), ("qwen3", "plain", 0),
    ("qwen3", "x<think>ab</think>", 0), ("deepseek_r1", "ab</think>cd", 2),
    ("deepseek_r1", "abc", 3), ("deepseek_r1", "<think>ab</think>", 2),
])
def test_reasoning_tokens_are_the_split_reasonings_tokens(name, text, count):
    """The oracle: :meth:`split`'s reasoning text, a token a byte (a byte-level tokenizer)."""
    from cbatch.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
    from cbatch.tokenizer import ByteTokenizer

    parser = REASONING_PARSERS[name](ByteTokenizer(511))
    assert parser.num_reasoning_tokens(list(text.encode())) == count
    assert len((parser.split(text)[0] or "").encode()) == count


@pytest.mark.parametrize("prompt, ended", [
    ("<|im_start|>assistant\n", False), ("<|im_start|>assistant\n<think>\n\n</think>\n\n", True),
    ("<think>a</think> then <|im_start|>assistant\n<think>\n", False),
])
def test_the_prompts_last_think_tag_decides(prompt, ended):
    from cbatch.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
    from cbatch.tokenizer import ByteTokenizer

    for name in REASONING_PARSERS:
        parser = REASONING_PARSERS[name](ByteTokenizer(511))
        assert parser.prompt_ends_reasoning(list(prompt.encode())) is ended
        # a gated reply is reasoning up to </think>, with or without its own <think>
        assert parser.gated().split("hm</think>{}") == ("hm", "{}")
