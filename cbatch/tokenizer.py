"""Tokenizers: the checkpoint's own (Hugging Face ``tokenizers`` files) or a byte-level one.

A ``random:`` model has no vocabulary of its own, so it gets :class:`ByteTokenizer`: token
id b < 256 is byte b, and every other id decodes as ``<|id|>``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    eos_token_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids; needs a vocabulary of at least 256."""

    def __init__(self, eos_token_id: int):
        self.eos_token_id = eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        out, run = [], bytearray()
        for t in token_ids:
            if 0 <= t < 256:
                run.append(t)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            out.append(f"<|{t}|>")
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


class HFTokenizer:
    """A checkpoint's tokenizer.json (or vocab.json + merges.txt) through ``tokenizers``."""

    def __init__(self, path: Path, eos_token_id: int):
        from tokenizers import Tokenizer as _Tokenizer

        if (path / "tokenizer.json").is_file():
            self._tok = _Tokenizer.from_file(str(path / "tokenizer.json"))
        else:
            from tokenizers.implementations import ByteLevelBPETokenizer

            self._tok = ByteLevelBPETokenizer(str(path / "vocab.json"), str(path / "merges.txt"))
        self.eos_token_id = eos_token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=False)


def load_tokenizer(checkpoint_dir: Path | None, eos_token_id: int) -> Tokenizer:
    """The checkpoint's tokenizer when its files are there, else :class:`ByteTokenizer`."""
    if checkpoint_dir is not None and (
        (checkpoint_dir / "tokenizer.json").is_file()
        or ((checkpoint_dir / "vocab.json").is_file() and (checkpoint_dir / "merges.txt").is_file())
    ):
        return HFTokenizer(checkpoint_dir, eos_token_id)
    return ByteTokenizer(eos_token_id)
