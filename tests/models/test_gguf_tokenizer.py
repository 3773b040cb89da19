"""The tokenizer a GGUF file carries, as cbatch builds it (cbatch.tokenizer.HFTokenizer over
transformers' GGUF conversion): its ids are those of the tokenizer the file was made from
(trained here with ``tokenizers``, written as llama.cpp's converter writes a vocabulary), and
those of transformers' ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``; decoding gives
the text back.  Byte-level BPE with each split llama.cpp names (gpt-2, qwen2, llama-bpe) and a
SentencePiece-style vocabulary with byte fallback and BOS."""

import pytest

from cbatch.tokenizer import load_tokenizer
from tests.models.gguf_vocab import bpe_vocab, spm_vocab

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

TEXTS = ["Hello, world! How are you today?", "The lazy dog 12345 jumps over 3.14159.",
         "émoji 🙂 unicode ü and 中文", "new\nlines\n\nand\ttabs", "the quick brown fox",
         "<|im_start|>user\nhi there<|im_end|>\n"]
# (a text starting with spaces: transformers' SentencePiece conversion (Metaspace) writes one
# "▁" fewer than Llama 2's own tokenizer.json (Prepend + Replace), and decodes it with one
# space fewer; cbatch follows transformers there: asserted against transformers only)
SPACES = "  two leading spaces and two trailing  "
VOCABS = {"spm": spm_vocab, "gpt-2": lambda: bpe_vocab("gpt-2"),
          "qwen2": lambda: bpe_vocab("qwen2"), "llama-bpe": lambda: bpe_vocab("llama-bpe")}


def write_vocab_file(path, vocab, arch: str = "llama", template: str | None = None):
    """A GGUF file holding a vocabulary (and no tensors: a tokenizer reads none)."""
    writer = gguf.GGUFWriter(str(path), arch)
    vocab.write(writer, len(vocab.tokens) + 3, template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module", params=list(VOCABS))
def vocab_file(request, tmp_path_factory):
    vocab = VOCABS[request.param]()
    path = tmp_path_factory.mktemp(request.param) / "vocab.gguf"
    return request.param, vocab, write_vocab_file(path, vocab)


def test_ids_are_the_original_tokenizers_and_transformers(vocab_file):
    kind, vocab, path = vocab_file
    ours = load_tokenizer(str(path), None, vocab.eos_token_id)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # built without AutoTokenizer (cbatch.tokenizer.HFTokenizer.from_gguf), the same tokenizer
    assert ours._tok.to_str() == theirs.backend_tokenizer.to_str()
    for text in TEXTS + [SPACES]:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        if text == SPACES and kind == "spm":
            continue
        assert ids == vocab.original.encode(text).ids, text
        # the text back (SentencePiece's BOS skipped; BPE's chat markers are its text)
        assert ours.decode(ids, skip_special_tokens=kind == "spm") == text, text


def test_bos_where_the_file_adds_it_and_specials_stay_whole(vocab_file):
    kind, vocab, path = vocab_file
    ours = load_tokenizer(str(path), None, vocab.eos_token_id)
    ids = ours.encode("hi")
    assert (ids[0] == vocab.bos_token_id) == vocab.add_bos
    assert ours.encode("hi", add_special_tokens=False) == ids[vocab.add_bos:]
    if kind != "spm":  # the ChatML markers are CONTROL tokens: one id each
        marker = vocab.tokens.index("<|im_end|>")
        assert ours.encode("<|im_end|>", add_special_tokens=False) == [marker]
        assert ours.decode([marker], skip_special_tokens=True) == ""


def test_byte_fallback_tokens_are_their_bytes(vocab_file):
    kind, vocab, path = vocab_file
    ours = load_tokenizer(str(path), None, vocab.eos_token_id)
    ids = ours.encode("🙂", add_special_tokens=False)
    assert b"".join(ours.token_bytes(i) for i in ids) == "🙂".encode()
    if kind == "spm":  # an emoji outside the vocabulary: its four bytes, <0xF0> ...
        assert [vocab.tokens[i] for i in ids][-4:] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]


def test_a_tokenizer_directory_wins_over_the_files(vocab_file, tmp_path):
    """tokenizer= (``--tokenizer``) takes the tokenizer from a Hugging Face directory, as vLLM
    does for a GGUF model."""
    kind, vocab, path = vocab_file
    vocab.original.save(str(tmp_path / "tokenizer.json"))
    ours = load_tokenizer(str(path), str(tmp_path), vocab.eos_token_id)
    assert type(ours).__name__ == "HFTokenizer"
    assert ours.encode(TEXTS[0]) == vocab.original.encode(TEXTS[0]).ids
