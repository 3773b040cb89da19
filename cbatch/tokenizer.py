"""Tokenizers: the checkpoint's own (Hugging Face ``tokenizers`` files), one named by
``EngineConfig.tokenizer``, or a byte-level one.

A ``random:`` model has no vocabulary of its own, so it gets :class:`ByteTokenizer`: token
id b < 256 is byte b, and every other id decodes as ``<|id|>``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Protocol

from cbatch.hub import TOKENIZER_FILES, resolve_checkpoint_dir


class Tokenizer(Protocol):
    eos_token_id: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids; needs a vocabulary of at least 256."""

    def __init__(self, eos_token_id: int):
        self.eos_token_id = eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))  # (it has no special tokens)

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

    @property
    def backend_tokenizer(self):
        """The ``tokenizers.Tokenizer`` itself (transformers' name for it): what a grammar
        engine reads the vocabulary from."""
        return getattr(self._tok, "_tokenizer", self._tok)  # ByteLevelBPETokenizer wraps one

    def __init__(self, path: Path, eos_token_id: int):
        from tokenizers import Tokenizer as _Tokenizer

        if (path / "tokenizer.json").is_file():
            self._tok = _Tokenizer.from_file(str(path / "tokenizer.json"))
        else:
            from tokenizers.implementations import ByteLevelBPETokenizer

            self._tok = ByteLevelBPETokenizer(str(path / "vocab.json"), str(path / "merges.txt"))
        self.eos_token_id = eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``add_special_tokens``: what the tokenizer's post-processor adds around a text (a
        Llama tokenizer's BOS; GPT-2's and Qwen's add nothing), as vLLM does for a prompt; a
        rendered chat template has them in its text already, and is encoded without."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=False)


def missing_tokenizer_files(path: Path) -> list[str]:
    """The files ``path`` lacks for a tokenizer: none when it has tokenizer.json, or
    vocab.json and merges.txt."""
    missing = [name for name in ("tokenizer.json", "vocab.json", "merges.txt")
               if not (path / name).is_file()]
    complete = "tokenizer.json" not in missing or missing == ["tokenizer.json"]
    return [] if complete else missing


def load_tokenizer(model: str, tokenizer: str | None, eos_token_id: int) -> Tokenizer:
    """The tokenizer for ``model`` (``EngineConfig.model``).

    ``tokenizer`` (a directory or hub id) wins when given; otherwise a checkpoint's own files,
    and a ``random:`` model's byte-level tokenizer.  A checkpoint without tokenizer files falls
    back to the byte-level tokenizer with a warning that names the missing files: its text
    would otherwise be silently wrong.
    """
    if tokenizer is not None:
        path = resolve_checkpoint_dir(tokenizer, TOKENIZER_FILES)
        missing = missing_tokenizer_files(path)
        if missing:
            raise FileNotFoundError(f"tokenizer={tokenizer!r}: {path} has no tokenizer.json "
                                    "(or vocab.json and merges.txt); missing: "
                                    f"{', '.join(missing)}")
        return HFTokenizer(path, eos_token_id)
    if model.startswith("random:"):
        return ByteTokenizer(eos_token_id)
    path = resolve_checkpoint_dir(model)
    missing = missing_tokenizer_files(path)
    if missing:
        warnings.warn(f"{path} has no tokenizer ({', '.join(missing)} missing): prompts and "
                      "outputs go through a byte-level tokenizer, so the text will not be the "
                      "model's; pass tokenizer=<directory or hub id> (cbatch --tokenizer)",
                      stacklevel=2)
        return ByteTokenizer(eos_token_id)
    return HFTokenizer(path, eos_token_id)


def prompt_token_ids(prompt: str | list[int], tokenizer: Tokenizer, vocab_size: int,
                     max_model_len: int, max_tokens: int) -> list[int]:
    """A prompt (a string or a list of token ids) as token ids that fit the model with
    ``max_tokens`` more; the one check of a prompt that every engine runs."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)):
        ids = list(prompt)
    else:
        raise TypeError("a prompt is a string or a list of token ids, got "
                        f"{type(prompt).__name__} {prompt!r:.40}")
    if not ids:
        raise ValueError("prompt is empty")
    if len(ids) + max_tokens > max_model_len:  # before reading a long list
        raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) "
                         f"= {len(ids) + max_tokens} exceeds the model's maximum length "
                         f"({max_model_len})")
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool)
           or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be ints in [0, {vocab_size}), got {bad[:5]}")
    return ids
