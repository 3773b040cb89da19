"""Incremental detokenization (multi-byte characters, bounded windows) and stop strings."""

import random

import pytest

from cbatch import Engine, SamplingParams
from cbatch.core.detokenizer import IncrementalDetokenizer
from cbatch.tokenizer import ByteTokenizer

TEXT = "naïve café — 東京 🙂👍🏽 déjà vu, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and plain ascii.\n"


class CountingTokenizer:
    """Wraps a tokenizer and records the length of every decode call."""

    def __init__(self, inner):
        self.inner, self.eos_token_id, self.lengths = inner, inner.eos_token_id, []

    def encode(self, text):
        return self.inner.encode(text)

    def decode(self, ids, **options):
        self.lengths.append(len(ids))
        return self.inner.decode(ids, **options)


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory):
    """A small byte-level BPE trained here, so merges split and join multi-byte characters."""
    tokenizers = pytest.importorskip("tokenizers")
    from cbatch.tokenizer import HFTokenizer

    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator([TEXT * 3, "hello world " * 20], vocab_size=300, min_frequency=1,
                            show_progress=False)
    path = tmp_path_factory.mktemp("bpe")
    bpe.save(str(path / "tokenizer.json"))
    return HFTokenizer(path, eos_token_id=0)


def _streams(tokenizer, ids, num_prompt):
    """Text of every snapshot while the request runs, then the finished text."""
    seq = list(ids[:num_prompt])
    detok = IncrementalDetokenizer(tokenizer, seq, num_prompt)
    texts = []
    for t in ids[num_prompt:]:
        seq.append(t)
        texts.append(detok.text_at(len(seq) - num_prompt, finished=False))
    return texts, detok.text_at(len(seq) - num_prompt, finished=True)


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
@pytest.mark.parametrize("seed", range(4))
def test_pieces_join_to_the_full_decode(kind, seed, bpe_tokenizer):
    rng = random.Random(seed)
    tokenizer = ByteTokenizer(511) if kind == "bytes" else bpe_tokenizer
    words = TEXT.split(" ")
    text = " ".join(rng.choice(words) for _ in range(40))
    ids = tokenizer.encode(text)
    if kind == "bytes" and seed % 2:  # invalid bytes and ids past the byte range
        for _ in range(10):
            ids.insert(rng.randrange(len(ids)), rng.choice([0x80, 0xE2, 0xFF, 300, 511]))
    num_prompt = rng.randrange(1, 8)
    texts, final = _streams(tokenizer, ids, num_prompt)
    assert final == tokenizer.decode(ids[num_prompt:])
    for a, b in zip(texts, texts[1:] + [final]):
        assert b.startswith(a)  # streaming never takes text back
    if kind == "bpe" or seed % 2 == 0:  # valid UTF-8: no half characters reach a client
        assert all("\ufffd" not in t for t in texts)


def test_each_token_is_decoded_in_a_bounded_window():
    tokenizer = CountingTokenizer(ByteTokenizer(511))
    ids = tokenizer.encode(TEXT * 20)
    texts, final = _streams(tokenizer, ids, 1)
    assert final == tokenizer.inner.decode(ids[1:])
    # valid UTF-8 bytes: the window is the previous character and the one being completed
    assert max(tokenizer.lengths) <= 8
    assert len(tokenizer.lengths) <= 2 * len(ids) + 2  # two small decodes per token


def test_stop_strings_truncate_text_and_streams_never_show_them():
    tokenizer = ByteTokenizer(511)
    ids = tokenizer.encode("one two\n\nthree")
    seq = ids[:1]
    detok = IncrementalDetokenizer(tokenizer, seq, 1, stop=["\n\n", "zzz"])
    streamed = []
    for t in ids[1:]:
        seq.append(t)
        if detok.hits_stop():
            break
        streamed.append(detok.text_at(len(seq) - 1, finished=False))
    assert detok.text_at(len(seq) - 1, finished=True) == "ne two"
    assert seq[-1] == ord("\n")  # the token that completed the stop string is kept
    assert all("\n" not in t for t in streamed)


def test_engine_stops_at_a_stop_string():
    engine = Engine("random:tiny", max_num_seqs=4, seed=3)
    prompt = [5, 6, 7]
    full = _run(engine, prompt, SamplingParams(max_tokens=60, ignore_eos=True, temperature=1.0,
                                               seed=9))
    # a stop string taken from the middle of the free-running text, and one never produced
    text = full.text
    stop = next(text[i:i + 2] for i in range(10, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    cut = text.find(stop)
    out = _run(engine, prompt, SamplingParams(max_tokens=60, ignore_eos=True, temperature=1.0,
                                              seed=9, stop=["never-there", stop]))
    assert out.finish_reason == "stop" and out.text == text[:cut]
    assert out.token_ids == full.token_ids[:len(out.token_ids)]
    assert len(out.token_ids) < len(full.token_ids)
    engine.block_manager.check_whole()


def _run(engine, prompt, params):
    engine.add_request(prompt, params)
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            last = out
    return last


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    """A byte-level BPE with two special tokens (0 and 1: chat markers) trained here."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from cbatch.tokenizer import HFTokenizer

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT * 3, "hello world " * 20], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|end|>", "<|start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("chat-bpe")
    tok.save(str(path / "tokenizer.json"))
    return HFTokenizer(path, eos_token_id=0)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_are_left_out_unless_asked(chat_tokenizer, skip):
    tokenizer = chat_tokenizer
    ids = tokenizer.encode("hello world") + [1] + tokenizer.encode(" café") + [0, 0]
    seq = ids[:1]
    detok = IncrementalDetokenizer(tokenizer, seq, 1, skip_special_tokens=skip)
    texts = []
    for t in ids[1:]:
        seq.append(t)
        texts.append(detok.text_at(len(seq) - 1, finished=False))
    final = detok.text_at(len(seq) - 1, finished=True)
    assert ids[0] == tokenizer.encode("hello")[0]  # (one token: the prompt)
    want = " world café" if skip else " world<|start|> café<|end|><|end|>"
    assert final == want == tokenizer.decode(ids[1:], skip_special_tokens=skip)
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:] + [final]))


def test_spaces_between_special_tokens_off_joins_added_tokens_to_the_text(tmp_path):
    """A decoder that puts spaces between tokens (WordPiece's) puts them around added tokens
    too; spaces_between_special_tokens=False leaves those out, as vLLM's."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers

    from cbatch.tokenizer import HFTokenizer

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "[END]": 3}
    tok = tokenizers.Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(["[END]"])
    tok.save(str(tmp_path / "tokenizer.json"))
    tokenizer = HFTokenizer(tmp_path, eos_token_id=3)
    ids = [1, 3, 3, 2]
    assert tokenizer.decode(ids) == "hello [END] [END] world"
    assert tokenizer.decode(ids, spaces_between_special_tokens=False) == "hello[END][END]world"
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hello world"
    seq = [1]
    detok = IncrementalDetokenizer(tokenizer, seq, 0, skip_special_tokens=False,
                                   spaces_between_special_tokens=False)
    seq += ids[1:]
    assert detok.text_at(4, finished=True) == "hello[END][END]world"


def test_include_stop_str_in_output_keeps_it_and_holds_nothing_back():
    tokenizer = ByteTokenizer(511)
    ids = tokenizer.encode("one two\n\nthree")
    seq = ids[:1]
    detok = IncrementalDetokenizer(tokenizer, seq, 1, stop=["zzz", "\n\n"],
                                   include_stop_str_in_output=True)
    streamed = []
    for t in ids[1:]:
        seq.append(t)
        if detok.hits_stop():
            break
        streamed.append(detok.text_at(len(seq) - 1, finished=False))
    assert detok.text_at(len(seq) - 1, finished=True) == "ne two\n\n"
    # nothing is held back: every snapshot has all the text of its tokens
    assert streamed == ["ne two\n\n"[:i + 1] for i in range(len(streamed))]


def test_token_bytes_name_parts_of_characters(chat_tokenizer):
    from cbatch.tokenizer import token_text

    tokenizer = chat_tokenizer
    for text in ("café", "東京", "🙂👍🏽"):
        ids = tokenizer.encode(text)
        assert b"".join(tokenizer.token_bytes(t) for t in ids) == text.encode()
        for t in ids:
            name, raw = token_text(tokenizer, t)
            try:
                assert name == raw.decode()
            except UnicodeDecodeError:
                assert name == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    assert token_text(tokenizer, 0) == ("<|end|>", b"<|end|>")
    assert token_text(ByteTokenizer(511), 0xE6) == ("bytes:\\xe6", b"\xe6")


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_at_the_end_is_left_out_of_the_final_text(include):
    tokenizer = ByteTokenizer(511)
    ids = [7, 97, 98, 0xC3, 300]  # half a character before stop token 300
    seq = list(ids)
    detok = IncrementalDetokenizer(tokenizer, seq, 1, stop_token_ids=frozenset({300, 511}),
                                   include_stop_str_in_output=include)
    assert detok.text_at(3, finished=False) == "ab"
    want = tokenizer.decode(ids[1:] if include else ids[1:-1])
    assert detok.text_at(4, finished=True) == want == ("ab\ufffd<|300|>" if include
                                                        else "ab\ufffd")
    # a stop token that did not end the output (max_tokens reached after it) stays
    seq2 = [7, 300, 97]
    detok = IncrementalDetokenizer(tokenizer, seq2, 1, stop_token_ids=frozenset({300}))
    assert detok.text_at(2, finished=True) == "<|300|>a"
