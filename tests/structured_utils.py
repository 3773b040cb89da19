"""Constraints whose every output a random-weight model can finish (bounded languages), and
the check that an output follows one: the structured-output tests of the engine and of the
server share them."""

from __future__ import annotations

import json
import re

import jsonschema

# strings by pattern, bounded integers and arrays: every output ends within ~80 bytes
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                  "maxItems": 3}},
          "required": ["name", "age", "ok", "tags"], "additionalProperties": False}
REGEX = r"\d{3}-[a-z]{2,4}!"
CHOICE = ["yes", "no", "maybe so"]
GRAMMAR = 'root ::= "(" [0-9]{1,3} ("+" [0-9]{1,3}){0,2} ")"'

# kind -> vLLM's structured_outputs dict
CONSTRAINTS = {"json": {"json": PERSON}, "regex": {"regex": REGEX},
               "choice": {"choice": CHOICE}, "grammar": {"grammar": GRAMMAR},
               "json_object": {"json_object": True}}


def assert_follows(kind: str, text: str) -> None:
    """``text`` is what the constraint of ``CONSTRAINTS[kind]`` allows."""
    assert "\ufffd" not in text, text  # whole UTF-8: no grammar lets a surrogate's bytes in
    if kind == "json":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICE, text
    else:
        assert re.fullmatch(r"\(\d{1,3}(\+\d{1,3}){0,2}\)", text), text


# two tools' parameters: a short city with a unit, and two small integers (their outputs are
# cut short by no random model's max_tokens)
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                          "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object",
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                      "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}


def script_outputs(monkeypatch, script: bytes) -> None:
    """A logits-processor trick for a random-weight model with a byte-level tokenizer: while
    ``monkeypatch`` holds, every row that draws output token i < len(script) has ``script[i]``
    raised far above the rest (+1e4) before the sampler's rules, so an unconstrained row
    writes the script, greedy or sampled; a grammar's bitmask, applied after, still forbids
    what it forbids.  Rows past the script are the model's own."""
    from cbatch.core import model_runner

    sample = model_runner.sample

    def scripted(logits, batch):
        rows = [r for r, p in enumerate(batch.positions) if p < len(script)]
        if rows:
            logits = logits.clone()
            for r in rows:
                logits[r, script[batch.positions[r]]] += 1e4
        return sample(logits, batch)

    monkeypatch.setattr(model_runner, "sample", scripted)
