"""vLLM's tool-call parsers beside hermes (issue 74, part 3): ``llama3_json``, ``mistral`` and
``pythonic``, each reading back the calls its model family's chat template writes (the
template's own lines for an assistant's calls, rendered with the server's Jinja environment),
and through a server: a reply in the family's format, forced by a grammar (a random model
would not write one), comes back as ``tool_calls``, streamed and not."""

import json
import re

import httpx
import pytest

from cbatch.entrypoints.openai.chat_utils import compile_chat_template
from cbatch.entrypoints.openai.protocol import ChatMessage
from cbatch.entrypoints.openai.tool_parsers import (TOOL_PARSERS, Llama3JsonToolParser,
                                                    MistralToolParser, PythonicToolParser)
from tests.serving_utils import running_server

CALLS = [("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 2, "b": 40})]

# How each family's chat template writes an assistant's calls (those lines of the template;
# the turn's end is its stop token, which is no part of the reply)
LLAMA_3_1 = (  # Llama-3.1-Instruct: one call a turn, {"name", "parameters"}
    "{%- for message in messages %}{%- if message.tool_calls %}"
    "{%- set tool_call = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}' }}{{- '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}")
MISTRAL_V3 = (  # Mistral-7B-Instruct-v0.3: a JSON list, each call with its 9-character id
    "{%- for message in messages %}{%- if message.tool_calls %}{{- '[TOOL_CALLS] [' }}"
    "{%- for tool_call in message.tool_calls %}{%- set out = tool_call.function|tojson %}"
    "{{- out[:-1] }}"
    "{%- if not tool_call.id is defined or tool_call.id|length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{%- endif %}{{- ', \"id\": \"' + tool_call.id + '\"}' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- else %}{{- ']' + eos_token }}{%- endif %}"
    "{%- endfor %}{%- endif %}{%- endfor %}")
MISTRAL_V11 = (  # tokenizer v11 and later (Mistral Small 3.x): a marker per call
    "{%- for message in messages %}{%- if message.tool_calls %}"
    "{%- for tool_call in message.tool_calls %}"
    "{{- '[TOOL_CALLS]' + tool_call.function.name + '[ARGS]' }}"
    "{{- tool_call.function.arguments|tojson }}{%- endfor %}{{- eos_token }}"
    "{%- endif %}{%- endfor %}")
PYTHONIC = (  # Llama 3.2's and Llama 4's pythonic templates: [name(arg=value, ...), ...]
    "{%- for message in messages %}{%- if message.tool_calls %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n[' -}}"
    "{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}"
    "{{- tool_call.name + '(' -}}{%- for param in tool_call.arguments %}"
    "{{- param + '=' -}}{{- tool_call.arguments[param] | tojson -}}"
    "{% if not loop.last %}, {% endif %}{%- endfor %}{{- ')' -}}"
    "{% if not loop.last %}, {% endif %}{%- endfor %}{{- ']<|eom_id|>' -}}"
    "{%- endif %}{%- endfor %}")

# what the model writes, as the template writes it: the reply between the turn's header and
# its end
REPLY = re.compile(r"(?:<\|start_header_id\|>assistant<\|end_header_id\|>\n\n)?(.*?)"
                   r"(?:<\|eot_id\|>|<\|eom_id\|>|</s>)\Z", re.DOTALL)


def _rendered_reply(template: str, calls, ids=None) -> str:
    message = ChatMessage(role="assistant", content=None, tool_calls=[
        {"id": (ids or [f"call{i}abcd" for i in range(len(calls))])[i], "type": "function",
         "function": {"name": name, "arguments": json.dumps(arguments)}}
        for i, (name, arguments) in enumerate(calls)])
    text = compile_chat_template(template).render(messages=[message.for_template()],
                                                  eos_token="</s>")
    return REPLY.fullmatch(text).group(1)


@pytest.mark.parametrize("parser, template, calls", [
    (Llama3JsonToolParser, LLAMA_3_1, CALLS[:1]),
    (MistralToolParser, MISTRAL_V3, CALLS),
    (MistralToolParser, MISTRAL_V11, CALLS),
    (PythonicToolParser, PYTHONIC, CALLS),
])
def test_each_parser_reads_its_familys_template_format(parser, template, calls):
    reply = _rendered_reply(template, calls)
    got = parser().extract(reply)
    assert got.content is None, reply
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == calls, reply


def test_mistral_calls_have_ids_its_template_takes_back():
    """Mistral's template refuses a history whose call ids are not 9 characters: the
    parser's ids are (vLLM's MistralToolCall), and the history renders with them."""
    got = MistralToolParser().extract("[TOOL_CALLS]" + '[{"name": "add", "arguments": '
                                      '{"a": 1, "b": 2}}]')
    [call] = got.tool_calls
    assert re.fullmatch("[A-Za-z0-9]{9}", call.id)
    assert _rendered_reply(MISTRAL_V3, [("add", {"a": 1, "b": 2})], ids=[call.id])


@pytest.mark.parametrize("parser, text, content, calls", [
    # llama3_json: <|python_tag|> first, "arguments" for "parameters", several with "; "
    (Llama3JsonToolParser, '<|python_tag|>{"name": "f", "parameters": {"x": 1}}', None,
     [("f", {"x": 1})]),
    (Llama3JsonToolParser, '{"name": "f", "arguments": {}}; {"name": "g", "parameters": '
                           '{"s": "é"}}', None, [("f", {}), ("g", {"s": "é"})]),
    (Llama3JsonToolParser, 'Let me see. {"name": "f", "parameters": {"x": {"y": 2}}}',
     "Let me see.", [("f", {"x": {"y": 2}})]),
    (Llama3JsonToolParser, "no calls here", "no calls here", []),
    (Llama3JsonToolParser, 'a set {1, 2} is not a call', None, None),
    (Llama3JsonToolParser, '{"name": "f"}', None, None),  # no parameters
    (Llama3JsonToolParser, '{"name": "f", "parameters": {"x": ', None, None),  # cut off
    # mistral: content before the marker; a list; a marker per call; bad JSON
    (MistralToolParser, 'Sure. [TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}]</s>',
     "Sure.", [("f", {"x": 1})]),
    (MistralToolParser, '[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g{"y": [1]}', None,
     [("f", {"x": 1}), ("g", {"y": [1]})]),
    (MistralToolParser, "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": ", None, None),
    (MistralToolParser, "[TOOL_CALLS][ARGS]{}", None, None),  # no name
    (MistralToolParser, "plain", "plain", []),
    # pythonic: literals only, the whole reply, never evaluated
    (PythonicToolParser, '[f(a=1, b="x", c=[True, None], d={"k": 2.5})]', None,
     [("f", {"a": 1, "b": "x", "c": [True, None], "d": {"k": 2.5}})]),
    (PythonicToolParser, "<|python_start|>[f(), g(x='y')]<|python_end|>", None,
     [("f", {}), ("g", {"x": "y"})]),
    (PythonicToolParser, "[f(a=__import__('os').getpid())]", None, None),
    (PythonicToolParser, "[f(1)]", None, None),  # positional
    (PythonicToolParser, "I would call [f(a=1)] next", None, None),
    (PythonicToolParser, "[" * 5000 + "]" * 5000, None, None),
    (PythonicToolParser, "[]", None, None),
])
def test_parsers_read_calls_or_leave_the_reply_as_content(parser, text, content, calls):
    got = parser().extract(text)
    if calls is None:  # not calls: the whole reply is content
        assert got.content == text and not got.tool_calls
        return
    assert got.content == content
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == calls


@pytest.mark.parametrize("parser, text, end", [
    (Llama3JsonToolParser, "hello", 5), (Llama3JsonToolParser, 'hi {"name"', 3),
    (Llama3JsonToolParser, "hi <|pyth", 3),
    (MistralToolParser, "hello [TOOL", 6), (MistralToolParser, "a[TOOL_CALLS]f", 1),
    (PythonicToolParser, "  [f(a=", 0), (PythonicToolParser, "<|pyt", 0),
    (PythonicToolParser, "Hello", 5), (PythonicToolParser, "", 0),
])
def test_parsers_stream_content_up_to_a_call(parser, text, end):
    assert parser().content_end(text) == end


# a compact template with tools (random:tiny reads 256 bytes at most)
TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
# each family's reply, as an EBNF grammar of the one text (the city free: [a-z]{1,6})
REPLIES = {
    "llama3_json": ('"{\\"name\\": \\"get_weather\\", \\"parameters\\": {\\"city\\": \\""',
                    '"\\"}}"'),
    "mistral": ('"[TOOL_CALLS] [{\\"name\\": \\"get_weather\\", \\"arguments\\": '
                '{\\"city\\": \\""', '"\\"}}]"'),
    "pythonic": ('"[get_weather(city=\\""', '"\\")]"'),
}


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_auto_tool_choice_with_each_parser(name):
    assert name in TOOL_PARSERS
    before, after = REPLIES[name]
    grammar = f"root ::= {before} [a-z]{{1,6}} {after}"
    with running_server("random:tiny", app_kwargs=dict(
            chat_template=TEMPLATE, tool_call_parser=name)) as (url, _):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "weather?"}],
                "tools": TOOLS, "max_tokens": 120, "temperature": 1.0, "seed": 1,
                "structured_outputs": {"grammar": grammar}}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        city = json.loads(call["function"]["arguments"])["city"]
        assert re.fullmatch("[a-z]{1,6}", city) and choice["message"]["content"] is None
        if name == "mistral":
            assert re.fullmatch("[A-Za-z0-9]{9}", call["id"])
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True},
                          timeout=120) as streamed:
            chunks = [json.loads(line[6:]) for line in streamed.iter_lines()
                      if line.startswith("data: {")]
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert not "".join(d.get("content") or "" for d in deltas)  # nothing but the call
        [streamed_call] = [t for d in deltas for t in d.get("tool_calls") or []]
        assert streamed_call["function"]["name"] == "get_weather"
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
