"""A request's constraint as its output grows (the third stage of
:mod:`cbatch.core.structured_output`): each sequence's xgrammar ``GrammarMatcher``
(:class:`SequenceGrammar`), advanced by every token the engine reads, and the step's token
bitmask (:func:`bitmask`), which the sampler applies; :class:`ConstraintError`, a request's
own constraint fault."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cbatch.core.structured_output.grammar import xgrammar
from cbatch.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from cbatch.core.scheduler import ScheduledSequence


class ConstraintError(ValueError):
    """A constraint this engine cannot use (it does not parse, compiles past a budget, or
    matches no output), or that an output can no longer follow: the request's own fault (the
    server's 400).  ``field`` names the constraint as the request gave it; ``problem`` is
    the rest of the message."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field} {problem}")
        self.field, self.problem = field, problem

    def named(self, field: str) -> ConstraintError:
        """The same error, the constraint named ``field`` (how an API request spelt it);
        itself when it is about another field (allowed_token_ids)."""
        if not self.field.startswith("structured_outputs"):
            return self
        return ConstraintError(field, self.problem)


def field_of(params: StructuredOutputsParams) -> str:
    return f"structured_outputs.{params.kind}"


@dataclass
class CompiledConstraint:
    """A compiled grammar, its size, and the tokens it allows first (int32 ``[1, W]``)."""

    grammar: object  # xgrammar.CompiledGrammar
    num_bytes: int
    first: torch.Tensor


def _allowed(row: torch.Tensor, token_ids) -> bool:
    """Whether bitmask ``row`` (int32 ``[1, W]``) allows any of ``token_ids``."""
    ids = torch.tensor([t for t in token_ids if t < 32 * row.shape[1]], dtype=torch.long)
    return bool(((row[0, ids // 32] >> (ids % 32)) & 1).any())


def check_request(constraint: CompiledConstraint, params: SamplingParams) -> None:
    """:class:`ConstraintError` when ``params``' other rules leave the constraint no first
    token: the request could never begin an output."""
    if params.allowed_token_ids is not None and not _allowed(constraint.first,
                                                             params.allowed_token_ids):
        raise ConstraintError("allowed_token_ids", "allows no token that can begin an output "
                              f"of the request's {field_of(params.structured_outputs)}, so "
                              "nothing could be generated")


class SequenceGrammar:
    """One sequence's place in its grammar: an xgrammar ``GrammarMatcher``, and the tokens
    it allows next (filled once per token: :meth:`accept` needs them, and :meth:`fill`
    copies them).

    With ``reasoning_end`` (``StructuredOutputsParams.reasoning_end``), the sequence is
    reasoning first (:attr:`reasoning`): its tokens do not advance the matcher, until its
    output ends with those ids; the grammar then applies from the next token on, as vLLM's
    structured outputs do once a reasoning parser says the thinking ended.  The end may be
    several tokens (a tokenizer without a ``</think>`` token).  While it reasons, every token
    is allowed but the stop tokens: an output cannot end before its constraint has begun
    (a reply would otherwise end "stop" with no answer, a tool_choice "required" with no
    call); it writes the end and then its grammar, or reaches max_tokens ("length")."""

    def __init__(self, constraint: CompiledConstraint, vocab_size: int,
                 stop_token_ids: list[int], field: str,
                 reasoning_end: list[int] | None = None):
        xgr = xgrammar()
        self.matcher = xgr.GrammarMatcher(constraint.grammar)
        self.field = field  # the constraint's name, for errors
        # the ids that end the reasoning while it goes on (None: constrained), and the
        # output's last tokens, as many as they are
        self._reasoning_end = None if not reasoning_end else list(reasoning_end)
        self._tail: list[int] = []
        self.num_words = -(-vocab_size // 32)  # int32 words of a bitmask row
        self._row = constraint.first.clone()  # [1, num_words]: allowed next
        # every bit but the stop tokens': what may follow a complete grammar besides its end
        words = [-1] * self.num_words
        for t in stop_token_ids:
            bit = 1 << (t % 32)
            words[t // 32] &= ~(bit - (1 << 32) if bit >= 1 << 31 else bit)
        self._not_stop = torch.tensor(words, dtype=torch.int32)

    @property
    def reasoning(self) -> bool:
        """Whether the output is still reasoning (free but for its end: the grammar
        waits)."""
        return self._reasoning_end is not None

    def accept(self, token: int) -> bool:
        """Advance by the sequence's new token; whether the output is done: its grammar
        ended (a stop token), or is complete and allows nothing but a stop token next.
        :class:`ConstraintError` if the grammar does not allow ``token`` (another rule masked
        every token it allowed) or allows no token after it.  While :attr:`reasoning`, the
        token only moves the output towards the reasoning's end."""
        if self._reasoning_end is not None:
            end = self._reasoning_end
            self._tail = (self._tail + [token])[-len(end):]
            if self._tail == end:
                self._reasoning_end = self._tail = None  # the grammar applies from here
            return False
        if not self.matcher.accept_token(token):
            raise ConstraintError(self.field, "cannot be followed together with the "
                                  "request's other rules: they forbid every token it allows "
                                  "next (allowed_token_ids, bad_words, logit_bias or "
                                  "min_tokens)")
        if self.matcher.is_terminated():
            return True
        self.matcher.fill_next_token_bitmask(self._row)
        if self.matcher.is_completed():
            return not bool((self._row[0] & self._not_stop).any())
        if not bool(self._row.any()):
            raise ConstraintError(self.field, "allows no token after the output so far (a "
                                  "rule that never ends?)")
        return False

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32 ``[S, num_words]``):
        the grammar's, or, while reasoning, every token but the stop tokens."""
        bitmask[row] = self._not_stop if self.reasoning else self._row[0]


def bitmask(scheduled: list[ScheduledSequence]) -> torch.Tensor | None:
    """The step's token bitmask: int32 ``[S, ceil(vocab / 32)]`` on the CPU, row s the tokens
    sequence s may sample next (all ones for rows without a grammar or that do not sample);
    None when no row has a grammar."""
    rows = [(s, grammar) for s, item in enumerate(scheduled)
            if (grammar := item.seq.grammar) is not None and item.samples]
    if not rows:
        return None
    out = torch.full((len(scheduled), rows[0][1].num_words), -1, dtype=torch.int32)
    for s, grammar in rows:
        grammar.fill(out, s)
    return out
