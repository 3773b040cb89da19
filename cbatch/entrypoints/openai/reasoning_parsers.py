"""A reasoning model's thinking, split from its answer (vLLM's ``--reasoning-parser``): the
text inside ``<think>...</think>`` is the reply's ``reasoning_content``, the text after it
its ``content`` (where tool calls are then looked for).

- ``qwen3``: Qwen3 opens the block itself when it thinks; a reply that does not begin with
  ``<think>`` is all content.
- ``deepseek_r1``: DeepSeek-R1's template opens the block in the prompt, so a reply is
  reasoning until ``</think>`` (a ``<think>`` the model writes anyway is dropped).

A reply cut off before ``</think>`` is all reasoning, in both.  The prompt decides first, by
token ids as vLLM's ``is_reasoning_end`` does: where its last think tag is ``</think>`` (Qwen3's
``enable_thinking: false`` closes an empty block there), the reasoning is over and the
reply is all content.  Otherwise a constrained reply (structured output, a forced tool
call) thinks first: its grammar waits for ``</think>`` (``StructuredOutputsParams.
reasoning_end``), and the reply is reasoning up to it with either parser (:meth:`gated`).
"""

from __future__ import annotations

import copy
import functools


def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may begin ``tag`` (held back while
    streaming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def last_index(ids: list[int], part: tuple[int, ...]) -> int:
    """Where the last occurrence of ``part`` begins in ``ids`` (-1: nowhere).  A prompt is
    searched on the event loop: its reversed copy is scanned by ``list.index`` (C), and
    only where ``part``'s last token is."""
    backwards, n, at = ids[::-1], len(part), 0
    while at < len(backwards):
        try:
            at = backwards.index(part[-1], at) + 1
        except ValueError:
            return -1
        end = len(ids) - at + 1  # just past the candidate's last token
        if end >= n and tuple(ids[end - n:end]) == part:
            return end - n
    return -1


class ThinkReasoningParser:
    start, end = "<think>", "</think>"
    opened_by_prompt = False  # whether a reply begins inside the block

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer  # the engine's (token ids of the tags); None: text only

    @functools.cached_property
    def start_ids(self) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(self.start, add_special_tokens=False))

    @functools.cached_property
    def end_ids(self) -> tuple[int, ...]:
        """``</think>``'s token ids: one where the tokenizer has it as a token, else several."""
        return tuple(self.tokenizer.encode(self.end, add_special_tokens=False))

    def prompt_ends_reasoning(self, prompt_ids: list[int]) -> bool:
        """Whether the prompt's last think tag is ``</think>`` (no reasoning follows)."""
        return last_index(prompt_ids, self.end_ids) > last_index(prompt_ids, self.start_ids)

    def gated(self) -> ThinkReasoningParser:
        """This parser for a reply whose grammar waits for ``</think>``: reasoning up to it
        (as DeepSeek-R1's), whether or not it begins with ``<think>``."""
        parser = copy.copy(self)
        parser.opened_by_prompt = True
        return parser

    def split(self, text: str, final: bool = True) -> tuple[str | None, str]:
        """(reasoning, content) of a reply's text (reasoning None when it does not think).
        ``final=False``: of a reply still growing, holding back what may yet become a tag,
        so that what is returned only ever grows."""
        body = text.lstrip()
        if not final and self.start.startswith(body):  # "", "<", "<th": may open the block
            return None, ""
        thinking = self.opened_by_prompt
        if body.startswith(self.start):
            body, thinking = body[len(self.start):], True
        if not thinking:
            return None, text
        reasoning, end, content = body.partition(self.end)
        if end:
            return reasoning, content
        if not final:
            reasoning = reasoning[:len(reasoning) - _partial_suffix(reasoning, self.end)]
        return reasoning, ""

    def num_reasoning_tokens(self, token_ids: list[int]) -> int:
        """How many of a reply's tokens are its reasoning (the Responses API's
        ``reasoning_tokens``): those inside the block, its tags not counted, by the rule of
        :meth:`split` (a reply that does not think has none)."""
        ids, begin = list(token_ids), 0
        start = _first_index(ids[:len(self.start_ids) + 8], self.start_ids, 0)  # (spaces)
        if start >= 0 and not self.tokenizer.decode(ids[:start]).strip():
            begin = start + len(self.start_ids)
        elif not self.opened_by_prompt:
            return 0
        end = _first_index(ids, self.end_ids, begin)
        return (len(ids) if end < 0 else end) - begin


def _first_index(ids: list[int], part: tuple[int, ...], begin: int) -> int:
    n = len(part)
    for i in range(begin, len(ids) - n + 1):
        if ids[i] == part[0] and tuple(ids[i:i + n]) == part:
            return i
    return -1


class Qwen3ReasoningParser(ThinkReasoningParser):
    pass


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    opened_by_prompt = True


# --reasoning-parser NAME -> its parser
REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser, "deepseek_r1": DeepSeekR1ReasoningParser}
