"""Structured outputs (xgrammar) in the engine: every output of a random-weight model
follows its constraint, whatever shares its steps (several requests, chunked prefill,
preemption, prefix caching, async scheduling), greedy or sampled; an invalid constraint is a
ValueError naming it; a grammar compiles off the step loop, once per text."""

import json
import os
import re
import time

import jsonschema
import pytest
import torch

from cbatch import LLM, Engine, SamplingParams
from cbatch.sampling_params import StructuredOutputsParams
from tests.helpers import STRESS_CONFIGS
from tests.structured_utils import CONSTRAINTS, assert_follows

pytest.importorskip("xgrammar")

# bounded kinds: every output finishes (json_object's strings are not bounded: below)
BOUNDED = ["json", "regex", "choice", "grammar"]
# a pool of 160 tokens for six requests of up to 146: preemption
PREEMPTING = dict(max_num_seqs=10, max_num_batched_tokens=64, block_size=4, num_blocks=40)
CONFIGS = {**STRESS_CONFIGS, "preempting": PREEMPTING,
           "async": dict(max_num_seqs=10, max_num_batched_tokens=64, async_scheduling=True),
           "async-preempting": dict(PREEMPTING, async_scheduling=True)}


def _requests(kind: str, count: int = 6):
    """Prompts sharing a 24-token prefix (prefix caching finds it), each with its own seed,
    half greedy; every other request unconstrained."""
    prompts = [list(range(40, 64)) + [i + 1, 7 * i % 256] for i in range(count)]
    params = [SamplingParams(max_tokens=120, temperature=0.0 if i % 4 < 2 else 1.0, seed=i,
                             structured_outputs=CONSTRAINTS[kind] if i % 2 == 0 else None)
              for i in range(count)]
    return prompts, params


def _run(config: str, kind: str):
    llm = LLM("random:tiny", batch_invariant=True, **CONFIGS[config])
    prompts, params = _requests(kind)
    return llm, llm.generate(prompts, params, use_tqdm=False)


@pytest.fixture(scope="module")
def reference():
    """Per kind: the outputs in the roomy configuration."""
    return {kind: [o.token_ids for o in _run("roomy", kind)[1]] for kind in BOUNDED}


@pytest.mark.slow  # an engine per configuration
@pytest.mark.parametrize("kind", BOUNDED)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_output_follows_its_constraint_in_any_batch(config, kind, reference):
    """The matcher follows each sequence through chunked prefill, preemption and async
    scheduling: the tokens are those of the roomy run (batch-invariant), and every
    constrained output ends with reason "stop" and follows its constraint."""
    llm, outs = _run(config, kind)
    for i, out in enumerate(outs):
        if i % 2 == 0:
            assert out.finish_reason == "stop", (i, out.text)
            assert_follows(kind, out.text)
    assert [o.token_ids for o in outs] == reference[kind]
    stats = llm.engine.stats()
    if "preempting" in config:
        assert stats.num_preemptions > 0
    assert stats.prefix_cache_hit_tokens > 0
    llm.engine.block_manager.check_whole()


def test_json_object_outputs_that_finish_are_objects():
    """Any JSON object: its strings are unbounded, so a random model's output may reach
    max_tokens; every one that ends ends as an object."""
    llm = LLM("random:tiny", max_num_seqs=8)
    outs = llm.generate(["hello"] * 8, [SamplingParams(
        max_tokens=200, temperature=1.0, seed=i, structured_outputs={"json_object": True})
        for i in range(8)], use_tqdm=False)
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert len(finished) >= 4
    for out in finished:
        assert_follows("json_object", out.text)


def test_length_bounded_strings_hold_no_raw_control_characters():
    """xgrammar's own grammar for a string with maxLength admits raw control characters,
    which JSON forbids; cbatch's does not: json.loads (strict) reads every output."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 12},
                                               "t": {"type": "string", "minLength": 2,
                                                     "maxLength": 6}},
              "required": ["s", "t"], "additionalProperties": False}
    llm = LLM("random:tiny", max_num_seqs=8)
    outs = llm.generate(["\t\n"] * 8, [SamplingParams(
        max_tokens=80, temperature=1.5, seed=i, structured_outputs={"json": schema})
        for i in range(8)], use_tqdm=False)
    for out in outs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), schema)


def test_streamed_snapshots_grow_into_a_valid_output():
    engine = Engine("random:tiny", max_num_seqs=4)
    rid = engine.add_request("name:", SamplingParams(
        max_tokens=120, temperature=1.0, seed=3, structured_outputs=CONSTRAINTS["json"]))
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.text for o in engine.step() if o.request_id == rid]
    assert len(texts) > 10
    assert all(texts[-1].startswith(t) for t in texts)
    assert_follows("json", texts[-1])


@pytest.mark.parametrize("constraint, match", [
    ({"json": {"type": "nonsense"}}, r"structured_outputs\.json is not a valid JSON schema.*"
                                      "nonsense"),
    ({"json": "{not json"}, r"structured_outputs\.json is not valid JSON"),
    ({"json": "[1, 2]"}, r"structured_outputs\.json .*a schema is a JSON object"),
    ({"regex": "a(b"}, r"structured_outputs\.regex is not a valid regular expression.*"
                       "parenthesis"),
    ({"grammar": 'root ::= "a" | rule_b'}, r"structured_outputs\.grammar is not a valid EBNF "
                                           r"grammar.*rule_b"),
])
def test_an_invalid_constraint_is_a_value_error_naming_it(constraint, match):
    engine = Engine("random:tiny")
    with pytest.raises(ValueError, match=match):
        engine.add_request([1, 2, 3], SamplingParams(structured_outputs=constraint))
    assert not engine.has_unfinished_requests()
    assert not engine.structured.held


# a choice of 100,000 strings: its compile takes many seconds on any machine, long enough for
# the tests below to watch it run (they stop it long before it ends)
SLOW = {"choice": [f"option number {i} of a long list" for i in range(100_000)]}


def _finish(engine, request_ids, timeout_s=120.0):
    """Step ``engine`` until the requests ``request_ids`` finish; their final outputs."""
    done, deadline = {}, time.monotonic() + timeout_s
    while not set(request_ids) <= set(done):
        assert time.monotonic() < deadline, f"not finished within {timeout_s} s: {done}"
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done


def _wait_for(condition, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _is_gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}") if os.path.isdir("/proc") else True


@pytest.mark.slow  # starts two compile workers, and a 100,000-entry choice's compile
def test_a_slow_compile_holds_up_no_other_grammar_or_request_and_stops_when_aborted():
    """Grammars compile in a pool of worker processes: while a 100,000-entry choice
    compiles, a 3-character regex compiles and its request finishes, and a request without
    a grammar runs; the slow one's request waits outside the scheduler.  Aborting it stops
    its compile: its worker is killed."""
    engine = Engine("random:tiny", max_num_seqs=4, grammar_compile_workers=2,
                    grammar_compile_timeout=600)
    pool = engine.structured.pool
    killed = pool.num_killed
    slow = engine.add_request([1, 2, 3], SamplingParams(max_tokens=8, structured_outputs=SLOW))
    quick = engine.add_request([1, 2, 3], SamplingParams(
        max_tokens=8, temperature=1.0, seed=1, structured_outputs={"regex": "[ab]{3}"}))
    free = engine.add_request([4, 5, 6], SamplingParams(max_tokens=8, ignore_eos=True))
    done = _finish(engine, [quick, free])
    assert done[free].finish_reason == "length"
    assert done[quick].finish_reason == "stop" and re.fullmatch("[ab]{3}", done[quick].text)
    assert slow not in done and [s.request_id for s, _ in engine.structured.held] == [slow]
    assert not engine.scheduler.waiting and not engine.scheduler.running
    [pid] = pool.busy_pids()  # the slow compile, still running
    engine.abort(slow)
    assert [(o.request_id, o.finish_reason) for o in engine.step()] == [(slow, "abort")]
    _wait_for(lambda: _is_gone(pid) and not pool.busy_pids())
    assert pool.num_killed == killed + 1
    assert not engine.structured.held and not engine.has_unfinished_requests()


@pytest.mark.slow  # a compile worker, and a 100,000-entry choice's compile
def test_a_compile_past_its_time_budget_is_stopped_and_its_request_fails():
    engine = Engine("random:tiny", grammar_compile_timeout=0.5)
    pool = engine.structured.pool
    killed = pool.num_killed
    rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=8, structured_outputs=SLOW))
    out = _finish(engine, [rid])[rid]
    assert out.finish_reason == "error"
    assert ("structured_outputs.choice takes longer than this engine's limit of 0.5 s to "
            "compile (grammar_compile_timeout)") in out.error
    _wait_for(lambda: not pool.busy_pids())
    assert pool.num_killed == killed + 1
    # the next compile gets a fresh worker
    rid = engine.add_request([1, 2], SamplingParams(max_tokens=8,
                                                    structured_outputs={"regex": "[ab]{3}"}))
    assert _finish(engine, [rid])[rid].finish_reason == "stop"


def test_a_grammar_past_its_size_budget_fails_its_request():
    engine = Engine("random:tiny", max_grammar_bytes=1000)
    rid = engine.add_request([1, 2, 3], SamplingParams(structured_outputs=CONSTRAINTS["json"]))
    out = _finish(engine, [rid])[rid]
    assert out.finish_reason == "error"
    assert re.search(r"structured_outputs\.json compiles to [\d.]+ MiB of token masks, more "
                     r"than this engine's limit of 0\.0 MiB \(max_grammar_bytes\)", out.error)


def test_a_constraint_is_compiled_once_and_cached_within_its_bytes():
    """Requests with the same constraint share one compile; compiled grammars are kept, least
    recently used dropped first, within grammar_cache_bytes."""
    probe = Engine("random:tiny")
    ticket = probe.structured.compile(StructuredOutputsParams(regex="a{3}"))
    size = ticket.future.result(timeout=120).num_bytes
    probe.structured.release(ticket)
    engine = Engine("random:tiny", grammar_cache_bytes=int(2.5 * size))
    pool, structured = engine.structured.pool, engine.structured
    jobs = pool.num_jobs
    for batch in ("aa", "b"):  # (one after the other: the cache's order is the order compiles end)
        rids = [engine.add_request([1, 2], SamplingParams(max_tokens=8, structured_outputs={
            "regex": f"{c}{{3}}"})) for c in batch]
        _finish(engine, rids)
    assert pool.num_jobs == jobs + 2  # a{3} once
    assert structured.cached_bytes == 2 * size
    rid = engine.add_request([1, 2], SamplingParams(max_tokens=8,
                                                    structured_outputs={"regex": "c{3}"}))
    _finish(engine, [rid])
    assert structured.cached_bytes == 2 * size <= structured.cache_bytes
    for regex, cached in (("b{3}", True), ("c{3}", True), ("a{3}", False)):  # a{3} dropped
        ticket = structured.compile(StructuredOutputsParams(regex=regex))
        assert ticket.future.done() == cached, regex
        ticket.future.result(timeout=120)
        structured.release(ticket)
    nothing = Engine("random:tiny", grammar_cache_bytes=0)
    rid = nothing.add_request([1], SamplingParams(max_tokens=8,
                                                  structured_outputs={"regex": "a{3}"}))
    assert _finish(nothing, [rid])[rid].text == "aaa"
    assert nothing.structured.cached_bytes == 0


@pytest.mark.parametrize("params, match", [
    (dict(structured_outputs={"grammar": "root ::= root"}),
     r"structured_outputs\.grammar matches no output at all"),
    # a $ref cycle: xgrammar up to 0.2.8 compiles it into a grammar with no output, 0.2.9
    # refuses the schema ("Circular $ref chain with no schema content"); either ends it alone
    (dict(structured_outputs={"json": {"$ref": "#"}}),
     r"structured_outputs\.json (matches no output at all|is not a valid JSON schema)"),
    (dict(structured_outputs={"json": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {
        "$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}),
     r"structured_outputs\.json (matches no output at all|is not a valid JSON schema)"),
    (dict(structured_outputs={"grammar": 'root ::= "a" x\nx ::= x'}),
     r"structured_outputs\.grammar allows no token after the output so far"),
    (dict(structured_outputs={"regex": "[a-z]{3}"}, allowed_token_ids=[48, 49]),
     r"allowed_token_ids allows no token that can begin an output of the request's "
     r"structured_outputs\.regex"),
    (dict(structured_outputs={"regex": "abc"}, allowed_token_ids=[97, 98]),
     r"structured_outputs\.regex cannot be followed together with the request's other "
     "rules"),
    (dict(structured_outputs={"choice": ["yes", "no"]}, bad_words=["yes", "no"]),
     r"structured_outputs\.choice cannot be followed together with the request's other "
     "rules"),
])
def test_a_constraint_nothing_can_follow_fails_its_request_alone(params, match):
    """Only generation tells for some (a rule that ends nowhere, another rule that forbids
    what the grammar allows later on); each ends its request alone with reason "error" and
    a ConstraintError, and the engine serves on."""
    engine = Engine("random:tiny", max_num_seqs=4)
    try:
        bad = engine.add_request([1, 2, 3], SamplingParams(max_tokens=8, seed=0, **params))
    except ValueError as exc:  # xgrammar 0.2.9 refuses a $ref cycle before the request exists
        assert re.match(match, str(exc)) and "is not a valid JSON schema" in str(exc), exc
        bad = None
    good = engine.add_request([1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True))
    done = _finish(engine, [good] if bad is None else [bad, good])
    if bad is not None:
        assert done[bad].finish_reason == "error"
        assert re.match("ConstraintError: " + match, done[bad].error), done[bad].error
    assert done[good].finish_reason == "length" and len(done[good].token_ids) == 8
    engine.block_manager.check_whole()


def test_greedy_rows_with_a_grammar_leave_the_greedy_screen():
    """On the CPU an all-greedy step takes its tokens from the lm_head's screen, which never
    sees the bitmask: a grammar row must not (its output would not follow it)."""
    outs = LLM("random:tiny").generate(["x"] * 2, SamplingParams(
        max_tokens=40, structured_outputs=CONSTRAINTS["regex"]), use_tqdm=False)
    for out in outs:
        assert_follows("regex", out.text)


@pytest.fixture(scope="module")
def bpe_checkpoint(tmp_path_factory):
    """A tiny Qwen2 checkpoint with a byte-level BPE of 300 tokens trained here (multi-byte
    tokens, special tokens, and a model vocabulary padded past the tokenizer's)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ['{"name": "ab", "age": 12, "ok": true, "tags": ["a", "b"]}',
              "123-abcd! 456-xyz!", "yes no maybe so (1+2+3)"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    config = transformers.Qwen2Config(
        vocab_size=tok.get_vocab_size() + 20, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        max_position_embeddings=256, tie_word_embeddings=True,
        eos_token_id=tok.token_to_id("<|endoftext|>"))
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen2-bpe")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.mark.slow  # a checkpoint saved by transformers
@pytest.mark.parametrize("kind", BOUNDED)
def test_a_checkpoints_bpe_tokenizer_constrains_its_outputs(bpe_checkpoint, kind):
    """xgrammar reads the vocabulary of a Hugging Face tokenizer (merged tokens that span
    several characters of the grammar); ids past it are never sampled."""
    llm = LLM(str(bpe_checkpoint), max_num_seqs=4)
    assert llm.engine.model.config.vocab_size > 300
    outs = llm.generate(["hello"] * 4, [SamplingParams(
        max_tokens=120, temperature=0.0 if i == 0 else 1.0, seed=i,
        structured_outputs=CONSTRAINTS[kind]) for i in range(4)], use_tqdm=False)
    for out in outs:
        assert out.finish_reason == "stop"
        assert max(out.token_ids) < 300
        assert_follows(kind, out.text)
    if kind == "json":  # merged tokens were sampled, not bytes alone
        assert any(len(out.token_ids) < len(out.text) for out in outs)


def test_a_schemas_properties_are_written_in_its_order():
    """The schema goes to its worker as JSON text in its own key order (sorted keys would put
    "a" first): xgrammar writes properties in the schema's order."""
    schema = {"type": "object", "properties": {"zeta": {"type": "integer"},
                                               "alpha": {"type": "integer"}},
              "required": ["zeta", "alpha"], "additionalProperties": False}
    out = LLM("random:tiny").generate(["x"], SamplingParams(
        max_tokens=60, structured_outputs={"json": schema}), use_tqdm=False)[0]
    assert out.text.startswith('{"zeta": '), out.text
