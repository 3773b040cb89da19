"""Tokenizers: the checkpoint's own (Hugging Face ``tokenizers`` files, or the vocabulary a
GGUF file carries), one named by ``EngineConfig.tokenizer``, or a byte-level one.

A ``random:`` model has no vocabulary of its own, so it gets :class:`ByteTokenizer`: token
id b < 256 is byte b, and every other id decodes as ``<|id|>``.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import warnings
from pathlib import Path
from typing import Protocol

from cbatch import file_cache
from cbatch.hub import TOKENIZER_FILES, find_gguf_file, resolve_checkpoint_dir


class Tokenizer(Protocol):
    eos_token_id: int
    # at most this many characters of a text become one token (so a text of n characters
    # has at least n / max_chars_per_token tokens: check_text_fits)
    max_chars_per_token: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_literal_spans(self, text: str, spans: list[tuple[int, int]]) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False,
               spaces_between_special_tokens: bool = True) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


def token_text(tokenizer: Tokenizer, token_id: int) -> tuple[str, bytes]:
    """One token as a logprobs entry shows it: (its text, its bytes).  A token that is not
    whole UTF-8 on its own (a piece of a multi-byte character) is written as OpenAI writes it,
    ``bytes:\\xe2\\x80``, so that distinct tokens never share a text."""
    raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8"), raw
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


class ByteTokenizer:
    """UTF-8 bytes as token ids; needs a vocabulary of at least 256."""

    max_chars_per_token = 1  # a token is a byte, a character one to four of them

    def __init__(self, eos_token_id: int):
        self.eos_token_id = eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return list(text.encode("utf-8"))  # (it has no special tokens)
        except UnicodeEncodeError as e:
            raise not_utf8(text, e) from None

    def encode_literal_spans(self, text: str, spans: list[tuple[int, int]]) -> list[int]:
        return self.encode(text)  # no special tokens: every text is literal

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False,
               spaces_between_special_tokens: bool = True) -> str:
        """(It has no special tokens: the options change nothing.)"""
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

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if 0 <= token_id < 256 else f"<|{token_id}|>".encode()


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
            tok = _Tokenizer.from_file(str(path / "tokenizer.json"))
        else:
            from tokenizers.implementations import ByteLevelBPETokenizer

            tok = ByteLevelBPETokenizer(str(path / "vocab.json"), str(path / "merges.txt"))
        self._setup(tok, eos_token_id)

    @classmethod
    def from_gguf(cls, path: Path, eos_token_id: int) -> HFTokenizer:
        """The tokenizer a GGUF file describes (its vocabulary with merges or scores, its
        special tokens, whether it adds BOS), built by transformers' GGUF converter: byte-level
        BPE (``tokenizer.ggml.model`` gpt2: GPT-2, Qwen2, Llama 3) with the split its ``pre``
        names, or SentencePiece's (llama: Llama 2, TinyLlama) with byte fallback.
        ``PreTrainedTokenizerFast`` rather than ``AutoTokenizer``: the same tokenizer (the
        same ``tokenizer.json``, tested), without AutoTokenizer's model config, which
        transformers 5 reads for a llama file with gguf's reader, parsing every metadata
        array (10 s of a Llama 3 file's load on this machine, against 0.8 s).  Built once:
        later starts read its ``tokenizer.json`` and chat template from the file cache
        (:mod:`cbatch.file_cache`), without transformers (a Llama 3 vocabulary: seconds)."""
        import tokenizers

        cached = file_cache.entry("tokenizer", path, args={}, depends=dict(
            transformers=file_cache.version("transformers"), tokenizers=tokenizers.__version__))
        if cached is not None and cached.exists:
            try:
                tok = tokenizers.Tokenizer.from_file(str(cached.path / "tokenizer.json"))
                said = json.loads((cached.path / "gguf.json").read_text())
                return cls._of_gguf(path, tok, eos_token_id, said["chat_template"],
                                    said["special_tokens"])
            except Exception as e:  # noqa: BLE001 (a damaged entry is made anew)
                warnings.warn(f"{path.name}: the cached tokenizer {cached.path} did not load "
                              f"({type(e).__name__}: {e}); building it from the file",
                              stacklevel=2)
                cached.remove()
        try:
            from transformers import PreTrainedTokenizerFast
        except ImportError as e:
            raise ModuleNotFoundError(
                f"the tokenizer of {path} is built by transformers: pip install "
                "'cbatch[hf]', or pass tokenizer=<a Hugging Face tokenizer directory or hub "
                "id> (cbatch --tokenizer)", name="transformers") from e
        hf = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
        template = hf.chat_template if isinstance(hf.chat_template, str) else None
        special = {"bos_token": hf.bos_token or "", "eos_token": hf.eos_token or ""}
        if cached is not None:
            text = hf.backend_tokenizer.to_str()
            said = json.dumps({"chat_template": template, "special_tokens": special})
            cached.write(lambda folder: ((folder / "tokenizer.json").write_text(text),
                                         (folder / "gguf.json").write_text(said)), len(text))
        return cls._of_gguf(path, hf.backend_tokenizer, eos_token_id, template, special)

    @classmethod
    def _of_gguf(cls, path: Path, tok, eos_token_id: int, chat_template: str | None,
                 special_tokens: dict[str, str]) -> HFTokenizer:
        tokenizer = cls.__new__(cls)
        tokenizer._setup(tok, eos_token_id)
        # what the server needs of the file besides (opening it again parses its vocabulary)
        tokenizer.gguf_file, tokenizer.chat_template = path, chat_template
        tokenizer.special_tokens = special_tokens
        return tokenizer

    def _setup(self, tok, eos_token_id: int) -> None:
        self._tok = tok
        self.eos_token_id = eos_token_id
        # a GGUF file's tokenizer (from_gguf): the file, its chat template, BOS's and EOS's text
        self.gguf_file: Path | None = None
        self.chat_template: str | None = None
        self.special_tokens: dict[str, str] | None = None
        # added tokens (chat markers, EOS, ...): id -> text
        self._added = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}
        self._literal = None  # a copy that reads special tokens' spellings as text (lazy)
        self._literal_lock = threading.Lock()

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """The longest token's spelling in the vocabulary, times 4: a normalizer may shrink
        a text (NFKC composes a letter and its accent into one character) before it is
        split, never by that much."""
        return 4 * max(map(len, self.backend_tokenizer.get_vocab(with_added_tokens=True)))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``add_special_tokens``: what the tokenizer's post-processor adds around a text (a
        Llama tokenizer's BOS; GPT-2's and Qwen's add nothing), as vLLM does for a prompt; a
        rendered chat template has them in its text already, and is encoded without."""
        return _encoding(self._tok, text, add_special_tokens).ids

    def encode_literal_spans(self, text: str, spans: list[tuple[int, int]]) -> list[int]:
        """``text``'s ids (no special tokens added) where no special token comes from inside
        ``spans`` (character ranges ``[start, end)``): there, a special token's spelling
        (``<|im_end|>``) is ordinary text, as ``transformers``' ``split_special_tokens`` reads
        it.  A text whose spans spell none is encoded exactly as :meth:`encode` does."""
        encoding = _encoding(self._tok, text, False)
        added = self.backend_tokenizer.get_added_tokens_decoder()
        special = {i for i, t in added.items() if t.special}
        if not any(i in special and any(a < end and start < b for start, end in spans)
                   for i, (a, b) in zip(encoding.ids, encoding.offsets)):
            return encoding.ids
        ids, pos = [], 0
        for start, end in sorted(spans):
            if pos < start:
                ids += self._tok.encode(text[pos:start], add_special_tokens=False).ids
            ids += self._literal_tokenizer().encode(text[start:end],
                                                    add_special_tokens=False).ids
            pos = end
        if pos < len(text):
            ids += self._tok.encode(text[pos:], add_special_tokens=False).ids
        return ids

    def _literal_tokenizer(self):
        with self._literal_lock:  # encodes run in worker threads
            if self._literal is None:
                import tokenizers

                self._literal = tokenizers.Tokenizer.from_str(self.backend_tokenizer.to_str())
                self._literal.encode_special_tokens = True
            return self._literal

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False,
               spaces_between_special_tokens: bool = True) -> str:
        """The text of ``token_ids``.  ``skip_special_tokens``: special tokens (EOS, chat
        markers) are left out.  ``spaces_between_special_tokens=False``: the added tokens
        (special or not) are joined to the text around them without the space a decoder may
        put between tokens (as vLLM does for fast tokenizers; a byte-level decoder puts none,
        so there it changes nothing)."""
        if spaces_between_special_tokens or skip_special_tokens or not (
                self._added.keys() & set(token_ids)):
            return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)
        pieces, run = [], []
        for t in token_ids:
            if t in self._added:
                pieces += [self._tok.decode(run, skip_special_tokens=False), self._added[t]]
                run = []
            else:
                run.append(t)
        pieces.append(self._tok.decode(run, skip_special_tokens=False))
        return "".join(pieces)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for: a byte-level BPE piece (GPT-2, Llama 3,
        Qwen) through the byte-level alphabet, a byte-fallback piece ``<0xE2>``
        (SentencePiece) as its byte, any other token as the UTF-8 of its text."""
        text = self._tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode()
        piece = self._tok.id_to_token(token_id) or ""
        match = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        if match:
            return bytes([int(match.group(1), 16)])
        alphabet = _byte_level_alphabet()
        if piece and all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
        return text.encode()


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's ``bytes_to_unicode``):
    character -> byte."""
    from tokenizers.pre_tokenizers import ByteLevel

    chars = ByteLevel.alphabet()  # the 256 stand-ins, in no particular order
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):  # the printable bytes stand for themselves, the rest from U+0100 on
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    assert set(table) == set(chars), "tokenizers' byte-level alphabet is not GPT-2's"
    return table


def _encoding(tokenizer, text: str, add_special_tokens: bool):
    """``tokenizers``' encoding of ``text``; a text UTF-8 cannot encode is a ValueError that
    says so (``tokenizers`` says only "TextInputSequence must be str")."""
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except TypeError:
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise not_utf8(text, e) from None
        raise


def not_utf8(text: str, error: UnicodeEncodeError) -> ValueError:
    """The error for a text that UTF-8 cannot encode (a lone surrogate, as JSON's "\\ud800"
    or Python's surrogateescape make): it names the character and its place."""
    char = text[error.start]
    why = (f"perhaps the byte 0x{ord(char) - 0xDC00:02x}, not UTF-8, of a command line or a "
           "file name" if 0xDC80 <= ord(char) <= 0xDCFF else
           "half of a UTF-16 pair, which no text holds alone")
    return ValueError(f"the text cannot be encoded as UTF-8: {char!r} at character "
                      f"{error.start} is a lone surrogate ({why})")


def missing_tokenizer_files(path: Path) -> list[str]:
    """The files ``path`` lacks for a tokenizer: none when it has tokenizer.json, or
    vocab.json and merges.txt."""
    missing = [name for name in ("tokenizer.json", "vocab.json", "merges.txt")
               if not (path / name).is_file()]
    complete = "tokenizer.json" not in missing or missing == ["tokenizer.json"]
    return [] if complete else missing


def load_tokenizer(model: str, tokenizer: str | None, eos_token_id: int | None = None
                   ) -> Tokenizer:
    """The tokenizer for ``model`` (``EngineConfig.model``); ``eos_token_id`` the model's
    (None: the caller sets it once the model is loaded, as the engine does, which builds
    the tokenizer while the model loads).

    ``tokenizer`` (a directory or hub id) wins when given; otherwise a checkpoint's own files,
    a GGUF file's vocabulary, and a ``random:`` model's byte-level tokenizer.  A checkpoint
    without tokenizer files falls back to the byte-level tokenizer with a warning that names
    the missing files: its text would otherwise be silently wrong.
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
    if (gguf_file := find_gguf_file(model)) is not None:
        return HFTokenizer.from_gguf(gguf_file, eos_token_id)
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
                     max_model_len: int, max_tokens: int, truncate: int | None = None
                     ) -> list[int]:
    """A prompt (a string or a list of token ids) as token ids that fit the model with
    ``max_tokens`` more; the one check of a prompt that every engine runs.  ``truncate``
    (``SamplingParams.truncate_prompt_tokens``): only the last k tokens are kept (-1: the
    model's length less ``max_tokens``)."""
    if isinstance(prompt, str):
        if truncate is None:  # (with truncation, any length keeps its end)
            check_text_fits(prompt, tokenizer, max_model_len)
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)):
        ids = list(prompt)
    else:
        raise TypeError("a prompt is a string or a list of token ids, got "
                        f"{type(prompt).__name__} {prompt!r:.40}")
    ids = truncate_prompt(ids, max_model_len, max_tokens, truncate)
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


def check_text_fits(text: str, tokenizer: Tokenizer, max_model_len: int,
                    name: str = "prompt") -> None:
    """ValueError naming ``name`` when ``text`` has too many characters to be at most
    ``max_model_len`` tokens, told by its length before any tokenizer reads it: a prompt of
    megabytes costs a server no more than one that fits."""
    limit = max_model_len * tokenizer.max_chars_per_token
    if len(text) > limit:
        raise ValueError(f"{name} of {len(text)} characters exceeds the model's maximum "
                         f"length ({max_model_len} tokens hold at most {limit} here)")


def truncate_prompt(ids: list[int], max_model_len: int, max_tokens: int,
                    truncate: int | None) -> list[int]:
    """The prompt tokens a request keeps: the last ``truncate`` (-1: the model's length less
    ``max_tokens``; None: all of them)."""
    if truncate is None:
        return ids
    keep = max_model_len - max_tokens if truncate == -1 else truncate
    return ids[-keep:] if keep > 0 else ids


def tokenize_bad_words(bad_words: list[str] | None, tokenizer: Tokenizer
                       ) -> list[tuple[int, ...]]:
    """``SamplingParams.bad_words`` as token ids: each word as it is and with a leading space
    (a word in mid-text is usually one token with its space), as vLLM does."""
    words: set[tuple[int, ...]] = set()
    for word in bad_words or ():
        for text in (word, " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                words.add(ids)
    return sorted(words)
