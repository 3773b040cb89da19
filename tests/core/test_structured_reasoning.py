"""Structured output after the reasoning (``StructuredOutputsParams.reasoning_end``): the
output is free until it has written the end ids, and follows its constraint from the next
token on, as vLLM applies a grammar once a reasoning parser says the thinking ended.

random:tiny's tokenizer is byte-level, so ``</think>`` is eight tokens (the multi-token
end).  The reasoning is scripted (:func:`tests.structured_utils.script_outputs`): the
scripted bytes are ones the grammar forbids at the start (``<`` begins no JSON), so they
appear only if no bitmask applied while reasoning, and the rest is the model's own under
the grammar."""

import json

import jsonschema
import pytest
import torch

from cbatch import LLM, SamplingParams
from cbatch.core.structured_output import SequenceGrammar, StructuredOutputs
from cbatch.sampling_params import StructuredOutputsParams
from tests.structured_utils import PERSON, script_outputs

pytest.importorskip("xgrammar")

END = list(b"</think>")
THOUGHT = b"<think>\nhm, a person\n</think>"
CONFIGS = {"roomy": dict(max_num_seqs=8),
           "async": dict(max_num_seqs=8, max_num_batched_tokens=64, async_scheduling=True),
           "preempting": dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=4,
                              num_blocks=48)}


def _params(i: int, reasoning_end=END, max_tokens: int = 160) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0 if i % 2 else 1.0, seed=i,
                          structured_outputs=StructuredOutputsParams(
                              json=PERSON, reasoning_end=reasoning_end))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_constraint_applies_after_the_reasoning_ends(monkeypatch, config):
    script_outputs(monkeypatch, THOUGHT)
    llm = LLM("random:tiny", **CONFIGS[config])
    outs = llm.generate(["who?"] * 4, [_params(i) for i in range(4)], use_tqdm=False)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        assert bytes(out.token_ids[:len(THOUGHT)]) == THOUGHT  # free: no bitmask
        jsonschema.validate(json.loads(out.text[len(THOUGHT):]), PERSON)
    if config == "preempting":
        assert llm.engine.stats().num_preemptions > 0
    llm.engine.block_manager.check_whole()


def test_without_reasoning_end_the_grammar_beats_the_script(monkeypatch):
    """The oracle of the test above: the same script with the grammar from the first token
    gives JSON from the first token (the bitmask forbids ``<``)."""
    script_outputs(monkeypatch, THOUGHT)
    out = LLM("random:tiny").generate(["who?"], _params(1, reasoning_end=None),
                                      use_tqdm=False)[0]
    jsonschema.validate(json.loads(out.text), PERSON)


def test_reasoning_cannot_end_before_its_constraint_begins(monkeypatch):
    """The model would write its end token (511, pushed far up) inside the reasoning: it is
    masked there, so the output goes on to max_tokens ("length"), never "stop" with no
    answer; with the grammar begun, the end token ends it as usual."""
    script_outputs(monkeypatch, b"<think>hm")
    bias = {511: 100.0}
    out = LLM("random:tiny").generate(["who?"], SamplingParams(
        max_tokens=20, seed=0, logit_bias=bias, structured_outputs=StructuredOutputsParams(
            regex="[a-z]*", reasoning_end=END)), use_tqdm=False)[0]
    assert out.finish_reason == "length" and 511 not in out.token_ids
    script_outputs(monkeypatch, b"<think>hm</think>")
    out = LLM("random:tiny").generate(["who?"], SamplingParams(
        max_tokens=40, seed=0, logit_bias=bias, structured_outputs=StructuredOutputsParams(
            regex="[a-z]*", reasoning_end=END)), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.text == "<think>hm</think>"


def test_reasoning_that_never_ends_finishes_with_length(monkeypatch):
    """The grammar never applies: the output is the reasoning, cut at max_tokens."""
    script_outputs(monkeypatch, b"<think>" + b"a" * 100)
    out = LLM("random:tiny").generate(["who?"], _params(1, max_tokens=30), use_tqdm=False)[0]
    assert out.finish_reason == "length" and out.text == "<think>" + "a" * 23


def _allows(row: torch.Tensor, token: int) -> bool:
    return bool(row[0, token // 32] >> (token % 32) & 1)


def test_a_reasoning_row_allows_all_but_its_end_and_the_matcher_waits():
    """SequenceGrammar alone: a one-token end (a tokenizer with ``</think>`` as one id) and
    a multi-token one; an end split by another token does not count.  While it reasons, its
    row allows every token but the stop token (511): it cannot end before its grammar."""
    from cbatch.config import EngineConfig
    from cbatch.tokenizer import ByteTokenizer

    structured = StructuredOutputs(ByteTokenizer(511), 512, 511, EngineConfig(model="random:tiny"))
    ticket = structured.compile(StructuredOutputsParams(regex="ab"))
    compiled = ticket.future.result(timeout=60)
    structured.release(ticket)
    for end, before in (([300], [97, 300]), (END, list(b"</th") + [97] + END)):
        grammar = SequenceGrammar(compiled, 512, [511], "structured_outputs.regex", end)
        for token in before:
            row = torch.zeros(1, 16, dtype=torch.int32)
            grammar.fill(row, 0)
            assert all(_allows(row, t) for t in (60, 97, 300)) and not _allows(row, 511)
            assert grammar.reasoning and not grammar.accept(token)  # "<" is free
        assert not grammar.reasoning  # the end was written: constrained from here
        row = torch.zeros(1, 16, dtype=torch.int32)
        grammar.fill(row, 0)
        assert _allows(row, 97) and not _allows(row, 98)
        assert not grammar.accept(97) and grammar.accept(98)


def test_reasoning_end_outside_the_vocabulary_is_refused():
    llm = LLM("random:tiny")
    with pytest.raises(ValueError, match="structured_outputs.reasoning_end"):
        llm.generate(["x"], _params(0, reasoning_end=[600]), use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs.reasoning_end"):
        StructuredOutputsParams(regex="a", reasoning_end=[])
