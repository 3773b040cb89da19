"""The file cache (cbatch.file_cache): a GGUF file's packed model and its tokenizer, made once
and read back at the next start.  What is read back is what the file makes (logits bitwise,
the same token ids and chat template); a read back never touches the file's blocks or
transformers (the paths that make them are made to fail); a changed file, other arguments,
a damaged entry or a cache that cannot be written make or read the file anew, never fail."""

import logging
import os

import pytest
import torch

from cbatch import LLM, SamplingParams, file_cache, load_model
from cbatch.layers.quantization import QuantizedLinear
from cbatch.models.gguf import loader as gguf_loader
from cbatch.tokenizer import HFTokenizer
from tests.models.test_gguf_models import PROMPTS, logits, make_files
from tests.models.test_gguf_tokenizer import TEXTS, VOCABS, write_vocab_file

gguf = pytest.importorskip("gguf")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The cache on, in a folder of the test's own."""
    monkeypatch.setenv("CBATCH_FILE_CACHE", "1")
    monkeypatch.setenv("CBATCH_CACHE_ROOT", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def reads(monkeypatch):
    """How many times a GGUF file's tensors were read (read_gguf_model's calls)."""
    calls = []
    real = gguf_loader.read_gguf_model
    monkeypatch.setattr(gguf_loader, "read_gguf_model",
                        lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    return calls


def entries(cache, kind="model"):
    return sorted(p for p in (cache / kind).glob("*/*") if not p.name.startswith("."))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_a_cached_model_is_the_files_bit_for_bit(arch, tmp_path, cache, reads):
    file, _, _ = make_files(arch, tmp_path / arch)  # every block type, in turn
    made = load_model(str(file))
    assert reads == [file] and len(entries(cache)) == 1
    back = load_model(str(file))
    assert reads == [file]  # read back from the cache, not from the file
    assert torch.equal(logits(back), logits(made))
    layers = [m for m in back.modules() if isinstance(m, QuantizedLinear)]
    assert all(m.placed for m in layers)  # (left in the mapped file: the runner copies none)
    assert len(layers) > 2 or arch == "gpt2"  # (GPT-2's blocks are dequantized)
    # a tensor held twice is read back once, tied as it was
    tied = {n for n, _ in made.named_parameters(remove_duplicate=False)} - \
        {n for n, _ in made.named_parameters()}
    assert {n for n, _ in back.named_parameters(remove_duplicate=False)} - \
        {n for n, _ in back.named_parameters()} == tied
    assert tied or arch != "gpt2"


def test_an_engine_generates_the_same_tokens_from_the_cache(tmp_path, cache, reads):
    file, _, _ = make_files("llama", tmp_path, type_of=lambda name: "Q4_K")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(file), max_num_seqs=4).generate(
        PROMPTS, params, use_tqdm=False)]
    got = [o.token_ids for o in LLM(str(file), max_num_seqs=4).generate(
        PROMPTS, params, use_tqdm=False)]
    assert got == want and reads == [file]
    assert len(entries(cache, "tokenizer")) == 1


def test_a_changed_file_or_other_arguments_make_a_new_entry(tmp_path, cache, reads):
    file, _, _ = make_files("llama", tmp_path, type_of=lambda name: "Q8_0")
    load_model(str(file))
    old = entries(cache)
    stat = file.stat()
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the file "changed"
    load_model(str(file))
    assert len(reads) == 2
    assert len(entries(cache)) == 1 and entries(cache) != old  # the old key's entry removed
    load_model(str(file), dtype=torch.bfloat16)  # another slot, beside the first
    assert len(reads) == 3 and len(entries(cache)) == 2


def test_a_damaged_entry_is_made_anew(tmp_path, cache, reads, caplog):
    file, _, _ = make_files("llama", tmp_path, type_of=lambda name: "Q4_0")
    want = logits(load_model(str(file)))
    (entry,) = entries(cache)
    with open(entry / "module.pickle", "r+b") as f:
        f.truncate(100)
    with caplog.at_level(logging.WARNING, logger="cbatch"):
        got = logits(load_model(str(file)))
    assert "did not load" in caplog.text and len(reads) == 2
    assert torch.equal(got, want)
    load_model(str(file))  # the entry written again reads back
    assert len(reads) == 2


def test_no_entry_when_off_or_unwritable(tmp_path, cache, reads, monkeypatch, caplog):
    file, _, _ = make_files("llama", tmp_path, type_of=lambda name: "Q4_0")
    monkeypatch.setenv("CBATCH_FILE_CACHE", "0")
    load_model(str(file))
    assert not cache.exists()
    monkeypatch.setenv("CBATCH_FILE_CACHE", "1")
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("CBATCH_CACHE_ROOT", str(tmp_path / "a-file" / "cache"))
    with caplog.at_level(logging.INFO, logger="cbatch"):
        load_model(str(file))
    assert "not caching" in caplog.text and len(reads) == 2


def test_an_entry_that_would_fill_the_disk_is_not_written(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(file_cache, "MIN_FREE_BYTES", 1 << 60)
    (tmp_path / "source").write_text("x")
    made = file_cache.entry("model", tmp_path / "source", {}, {})
    assert not made.write(lambda folder: (folder / "f").write_text("x"), nbytes=1)
    assert not made.exists and not list(made.slot.iterdir())  # nothing left behind


def test_a_model_that_cannot_be_saved_still_loads(tmp_path, cache, reads, monkeypatch, caplog):
    """What the pickler cannot write (here: every module) is logged; the load goes on."""
    file, _, _ = make_files("llama", tmp_path, type_of=lambda name: "Q4_0")

    def refuse(module, folder):
        (folder / "module.pickle").write_text("half")
        raise TypeError("cannot pickle this")

    monkeypatch.setattr(gguf_loader, "save_module", refuse)
    with caplog.at_level(logging.INFO, logger="cbatch"):
        model = load_model(str(file))
    assert "not caching" in caplog.text and "TypeError" in caplog.text
    assert entries(cache) == [] and not list((cache / "model").glob("*/.*"))
    assert torch.equal(logits(model), logits(load_model(str(file))))
    assert len(reads) == 2


@pytest.mark.parametrize("name", ["spm", "llama-bpe"])
def test_a_cached_tokenizer_is_the_files(name, tmp_path, cache, monkeypatch):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    file = write_vocab_file(tmp_path / "vocab.gguf", VOCABS[name](), template=template)
    made = HFTokenizer.from_gguf(file, 2)
    assert len(entries(cache, "tokenizer")) == 1
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)  # no import
    back = HFTokenizer.from_gguf(file, 2)
    for text in TEXTS:
        ids = made.encode(text)
        assert back.encode(text) == ids and back.decode(ids) == made.decode(ids)
    assert (back.chat_template, back.special_tokens, back.gguf_file) == \
        (made.chat_template, made.special_tokens, made.gguf_file) and made.chat_template
