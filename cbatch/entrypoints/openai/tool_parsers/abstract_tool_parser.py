"""What every tool parser shares (vLLM's ``ToolParser``): the calls of a reply, and how much
of a reply still being streamed is surely content."""

from __future__ import annotations

import random
import string
from dataclasses import dataclass, field


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # the arguments object as JSON text
    id: str | None = None  # None: the server's own (chatcmpl-tool-<hex>)


@dataclass
class ExtractedToolCalls:
    """A reply split into its text (None when there is none) and its tool calls."""

    content: str | None
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


class ToolParser:
    """Finds the calls a model wrote in its chat format (``tool_choice="auto"``).  A call
    that does not parse leaves the whole reply as content, as vLLM's parsers do."""

    # what a call may begin with: streamed content stops at the first of them (or at what
    # may become one), and the reply's content is what comes before it
    starts: tuple[str, ...] = ()
    # the call's marker is a special token, which the reply must keep to be read
    # (skip_special_tokens off, as vLLM's mistral parser asks)
    keeps_special_tokens = False

    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls of a finished reply."""
        raise NotImplementedError

    def content_end(self, text: str) -> int:
        """While streaming: how much of the reply so far is surely content (it stops where
        a call starts, or may start: a prefix of a start at the end is held back)."""
        found = [at for at in (text.find(s) for s in self.starts) if at >= 0]
        if found:
            return min(found)
        return len(text) - max((partial_suffix(text, s) for s in self.starts), default=0)


def partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may begin ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def content_before(text: str, at: int, *tags: str) -> str | None:
    """The reply's text before its first call (at ``at``), ``tags`` taken out; None when
    there is none."""
    content = text[:at]
    for tag in tags:
        content = content.replace(tag, "")
    return content.strip() or None


def mistral_call_id() -> str:
    """A call id as Mistral's templates require (9 letters and digits; vLLM's
    ``MistralToolCall``): a history with another id does not render."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))
