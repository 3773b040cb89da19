"""Chat content that cannot spell the template's control tokens
(``cbatch serve --no-special-tokens-in-content``).

A chat template writes its control tokens (``<|im_start|>``, ``<|im_end|>``) as text, and the
rendered prompt is encoded with special tokens read from that text, so a message whose content
spells ``<|im_end|>\\n<|im_start|>system`` would forge a turn of its own.  vLLM and
transformers encode it so by default; with this option the template is rendered with a
placeholder for each content, the contents are found where the placeholders landed in the
real rendering, and there encoded with special tokens read as plain text
(:meth:`cbatch.tokenizer.HFTokenizer.encode_literal_spans`).  A template's usual edits of a
content (``| trim``) are followed; one it rewrites otherwise (Qwen3's split of an assistant
turn's reasoning, say) goes into the prompt as it was sent, where its placeholder landed.
"""

from __future__ import annotations

import re
import secrets
from typing import Callable


def render_with_spans(render: Callable[[list[dict]], str], messages: list[dict]
                      ) -> tuple[str, list[tuple[int, int]]]:
    """``render(messages)`` (a chat template's text) and the character ranges ``[start,
    end)`` in it that the messages' contents fill: each text content (a string, or the
    ``text`` of a content part) is rendered once as a placeholder no client can guess, and
    found where its placeholder landed in the real rendering (or, if the template rewrote
    a content, put back there as it was sent, and that text returned)."""
    nonce = secrets.token_hex(8)
    contents: list[str] = []

    def mark(text: str) -> str:
        contents.append(text)
        return f"[[content-{nonce}-{len(contents) - 1}]]"  # survives trim, tojson, escaping

    marked = []
    for message in messages:
        message = dict(message)
        content = message.get("content")
        if isinstance(content, str):
            message["content"] = mark(content)
        elif isinstance(content, list):
            message["content"] = [
                {**part, "text": mark(part["text"])}
                if isinstance(part, dict) and isinstance(part.get("text"), str) else part
                for part in content]
        marked.append(message)
    skeleton = render(marked)
    parts = re.split(rf"\[\[content-{nonce}-(\d+)\]\]", skeleton)
    literals, order = parts[0::2], [contents[int(i)] for i in parts[1::2]]
    text = render(messages)
    spans = _locate(text, literals, order)
    if spans is not None:
        return text, spans
    # the template rewrote a content: each goes in as it was sent
    pieces, spans, length = [literals[0]], [], len(literals[0])
    for content, literal in zip(order, literals[1:]):
        spans.append((length, length + len(content)))
        pieces += [content, literal]
        length += len(content) + len(literal)
    return "".join(pieces), spans


def _locate(text: str, literals: list[str], contents: list[str]
            ) -> list[tuple[int, int]] | None:
    """Where ``contents`` (each as sent, or stripped as ``| trim`` leaves it) stand in
    ``text`` between the template's own ``literals``; None if ``text`` is not that."""
    if not text.startswith(literals[0]):
        return None
    pos, spans = len(literals[0]), []
    for content, literal in zip(contents, literals[1:]):
        for candidate in (content, content.strip(), content.lstrip(), content.rstrip()):
            end = pos + len(candidate)
            if text.startswith(candidate, pos) and text.startswith(literal, end):
                break
        else:
            return None
        spans.append((pos, end))
        pos = end + len(literal)
    return spans if pos == len(text) else None
