"""Incremental detokenization and stop strings.

A request's text grows by one token at a time.  Decoding the whole output again at every
step costs O(n) per token; instead each new token is decoded once, in a small window that
starts at the previous piece of text (the context some tokenizers need to place spaces), as
vLLM and transformers' ``TextStreamer`` do.  A token that ends in the middle of a multi-byte
character decodes to U+FFFD; its text is held back until the character is complete, so the
pieces join up to ``tokenizer.decode(output_token_ids)``.

Stop strings are searched only in the text that each new piece can complete, and the text
ends before the first one found (after it, with ``include_stop_str_in_output``).  Special
tokens are left out of the text unless ``skip_special_tokens=False`` (vLLM's options; the
tokenizer's ``decode`` takes them).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cbatch.core.sequence import Sequence
    from cbatch.tokenizer import Tokenizer

# Held tokens wait for the rest of a character (at most 3 more bytes).  Only a run of invalid
# bytes keeps text held longer; past this many tokens it is emitted as U+FFFDs, which bounds
# the window (the pieces then differ from one whole decode only inside such garbage).
MAX_HELD_TOKENS = 16


class IncrementalDetokenizer:
    """The output text of one sequence, extended lazily as its tokens are read.

    ``token_ids`` is the sequence's own list (prompt + output), read, never written: it only
    grows, so every snapshot of the output can ask for its text later (:meth:`text_at`).
    """

    def __init__(self, tokenizer: Tokenizer, token_ids: list[int], num_prompt_tokens: int,
                 stop: list[str] | None = None, *, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True,
                 include_stop_str_in_output: bool = False,
                 stop_token_ids: frozenset[int] = frozenset(), min_tokens: int = 0):
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.stop = list(stop or [])
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens  # stop strings count only in text from later tokens
        # the tokens that finish the request where they are sampled (its stop_token_ids, and
        # EOS unless ignored): as in vLLM, the text of the one that finished it is left out
        # unless include_stop_str_in_output
        self._stop_token_ids = frozenset() if include_stop_str_in_output else stop_token_ids
        self._decode = functools.partial(
            tokenizer.decode, skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens)
        # a stop string may straddle the old text and a new piece: the search starts this
        # many characters back
        self._search_back = max((len(s) for s in self.stop), default=1) - 1
        # Streaming holds back as many characters: they might be the start of a stop string,
        # which must never reach the client (unless the output keeps it anyway).
        self._holdback = 0 if include_stop_str_in_output else self._search_back
        self.text = ""  # the decoded output so far (complete characters only)
        self.stop_at: int | None = None  # where the first stop string starts in text
        self._stop_end: int | None = None  # and where it ends
        self._text_ends: list[int] = []  # len(text) after each output token
        self._prefix = self._read = num_prompt_tokens  # window: [prefix, read) is decoded

    def _advance(self, num_tokens: int) -> None:
        """Decode the tokens up to ``token_ids[:num_tokens]``, one at a time."""
        ids, decode = self.token_ids, self._decode
        for end in range(self.num_prompt_tokens + len(self._text_ends), num_tokens):
            if self.stop_at is None:
                prefix_text = decode(ids[self._prefix:self._read])
                new_text = decode(ids[self._prefix:end + 1])
                if len(new_text) > len(prefix_text) and (
                        not new_text.endswith("\ufffd") or end + 1 - self._read > MAX_HELD_TOKENS):
                    self._append(new_text[len(prefix_text):],
                                 search=end + 1 - self.num_prompt_tokens > self.min_tokens)
                    self._prefix, self._read = self._read, end + 1
            self._text_ends.append(len(self.text))

    def _append(self, piece: str, search: bool = True) -> None:
        # A stop string may straddle the old text and the new piece.
        start = max(0, len(self.text) - self._search_back)
        self.text += piece
        if not search:
            return
        found = [(i, -len(s)) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if found:  # the first to start (the longest of those)
            self.stop_at, minus_len = min(found)
            self._stop_end = self.stop_at - minus_len

    def hits_stop(self) -> bool:
        """Read every token so far; whether the text now contains a stop string."""
        self._advance(len(self.token_ids))
        return self.stop_at is not None

    def text_at(self, num_output_tokens: int, finished: bool) -> str:
        """The text of the first ``num_output_tokens`` output tokens: for a finished request
        all of it (a character cut off by the end included) up to the first stop string or
        the stop token that finished it (or through it, with ``include_stop_str_in_output``);
        for an unfinished one the part that no later token can change."""
        end = self.num_prompt_tokens + num_output_tokens
        final = finished and end == len(self.token_ids)
        if final and num_output_tokens and self.token_ids[end - 1] in self._stop_token_ids:
            end, num_output_tokens = end - 1, num_output_tokens - 1  # the stop token's text
        self._advance(end)
        if final and self.stop_at is None and self._read < end:
            # flush what was held back for a character that will never be completed
            prefix_text = self._decode(self.token_ids[self._prefix:self._read])
            self._append(self._decode(self.token_ids[self._prefix:end])[len(prefix_text):])
            self._prefix = self._read = end
            self._text_ends[num_output_tokens - 1] = len(self.text)
        n = self._text_ends[num_output_tokens - 1] if num_output_tokens else 0
        if not finished:
            n -= self._holdback
        if self.stop_at is not None:
            n = min(n, self._stop_end if self.include_stop_str_in_output else self.stop_at)
        return self.text[:max(0, n)]


def eos_token_ids(eos_token_id: int | tuple[int, ...] | None) -> frozenset[int]:
    """A model's EOS (a config may name one, several or none) as a set of ids."""
    return frozenset(eos_token_id if isinstance(eos_token_id, tuple)
                     else () if eos_token_id is None else (eos_token_id,))


def detokenizer_for(seq: Sequence, tokenizer: Tokenizer) -> IncrementalDetokenizer:
    """The sequence's detokenizer, made on first use (requests nobody reads pay nothing)."""
    if seq.detokenizer is None:
        p = seq.params
        seq.detokenizer = IncrementalDetokenizer(
            tokenizer, seq.token_ids, seq.num_prompt_tokens, p.stop,
            skip_special_tokens=p.skip_special_tokens,
            spaces_between_special_tokens=p.spaces_between_special_tokens,
            include_stop_str_in_output=p.include_stop_str_in_output,
            stop_token_ids=frozenset(p.stop_token_ids) | (
                frozenset() if p.ignore_eos else eos_token_ids(tokenizer.eos_token_id)),
            min_tokens=p.min_tokens)
    return seq.detokenizer
