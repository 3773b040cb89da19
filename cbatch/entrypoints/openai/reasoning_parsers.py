"""A reasoning model's thinking, split from its answer (vLLM's ``--reasoning-parser``): the
text inside ``<think>...</think>`` is the reply's ``reasoning_content``, the text after it
its ``content`` (where tool calls are then looked for).

- ``qwen3``: Qwen3 opens the block itself when it thinks; a reply that does not begin with
  ``<think>`` is all content (``enable_thinking: false``: the template closed an empty block
  in the prompt).
- ``deepseek_r1``: DeepSeek-R1's template opens the block in the prompt, so a reply is
  reasoning until ``</think>`` (a ``<think>`` the model writes anyway is dropped).

A reply cut off before ``</think>`` is all reasoning, in both.  Structured output (and a
forced tool call) is a grammar from the first token on, so such a reply has no thinking: the
server does not split it (vLLM instead starts the grammar once the reasoning ends).
"""

from __future__ import annotations


def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may begin ``tag`` (held back while
    streaming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ThinkReasoningParser:
    start, end = "<think>", "</think>"
    opened_by_prompt = False  # whether a reply begins inside the block

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


class Qwen3ReasoningParser(ThinkReasoningParser):
    pass


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    opened_by_prompt = True


# --reasoning-parser NAME -> its parser
REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser, "deepseek_r1": DeepSeekR1ReasoningParser}
