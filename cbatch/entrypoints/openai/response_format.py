"""What a request's output must follow, in each of the ways clients ask: OpenAI's
``response_format`` (chat and completions; the Responses API's ``text.format`` is turned into
one), vLLM's ``structured_outputs``, and vLLM's older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``, which are ``structured_outputs`` under other names.
A request gives one of them; every one becomes a :class:`StructuredOutputsParams`, which the
engine enforces token by token, so none is ever accepted and left unconstrained."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cbatch.sampling_params import CONSTRAINT_KINDS, StructuredOutputsParams

# vLLM's older field -> its key of structured_outputs
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``."""

    model_config = ConfigDict(populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict | None = Field(default=None, alias="schema")  # ("schema" is BaseModel's)
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON
    object) or ``json_schema`` (a JSON value its schema validates)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _has_schema(self):
        if self.type == "json_schema" and (self.json_schema is None
                                           or self.json_schema.json_schema is None):
            raise ValueError('response_format of type "json_schema" needs '
                             "json_schema.schema (the JSON schema)")
        return self


def structured_outputs_of(response_format: ResponseFormat | None,
                          structured_outputs: dict | None, guided: dict | None = None
                          ) -> StructuredOutputsParams | None:
    """The constraint of a request: OpenAI's ``response_format``, vLLM's
    ``structured_outputs`` or its ``guided_*`` fields (``guided``: those given, by name), one
    of them; None for none; ValueError naming the field."""
    guided = {k: v for k, v in (guided or {}).items() if v is not None}
    if guided:
        names = ", ".join(sorted(guided))
        if structured_outputs is not None:
            raise ValueError(f"structured_outputs and {names} were both given: the guided_* "
                             "fields are vLLM's older names of structured_outputs' keys; give "
                             "structured_outputs alone")
        if response_format is not None:
            raise ValueError(f"give either response_format or structured_outputs ({names}), "
                             "not both")
        structured_outputs = {GUIDED_FIELDS[k]: v for k, v in guided.items()}
    if response_format is not None and structured_outputs is not None:
        raise ValueError("give either response_format or structured_outputs, not both")
    if structured_outputs is not None:
        # (reasoning_end is the server's to set, from its --reasoning-parser)
        unknown = sorted(set(structured_outputs) - set(CONSTRAINT_KINDS))
        if unknown:
            raise ValueError(f"structured_outputs takes json, json_object, regex, choice or "
                             f"grammar (not {', '.join(map(str, unknown))})")
        return StructuredOutputsParams(**structured_outputs)
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    return StructuredOutputsParams(json=response_format.json_schema.json_schema)


class ConstraintFields(BaseModel):
    """The fields of a request that constrain its output (see the module)."""

    response_format: ResponseFormat | None = None  # structured outputs, OpenAI's way
    structured_outputs: dict | None = None  # and vLLM's (json, regex, choice, grammar, ...)
    guided_json: str | dict | None = None  # vLLM's older names of structured_outputs' keys
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def has_constraint(self) -> bool:
        """Whether any of these fields is given."""
        return (self.response_format is not None or self.structured_outputs is not None
                or any(getattr(self, name) is not None for name in GUIDED_FIELDS))

    def constraint(self) -> StructuredOutputsParams | None:
        """What the output must follow; ValueError naming the field."""
        return structured_outputs_of(self.response_format, self.structured_outputs,
                                     {name: getattr(self, name) for name in GUIDED_FIELDS})

    def constraint_field(self) -> str | None:
        """The field that holds the constraint, as errors about it name it (None: the
        engine's own name, ``structured_outputs.<kind>``)."""
        if self.response_format is not None and self.response_format.type == "json_schema":
            return "response_format.json_schema.schema"
        return next((name for name in GUIDED_FIELDS if getattr(self, name) is not None), None)
