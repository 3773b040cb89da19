"""Tiny vocabularies for GGUF test files, trained here (offline) with ``tokenizers``, and
written as llama.cpp's converter writes a vocabulary:

- :func:`bpe_vocab`: byte-level BPE (GPT-2, Qwen2, Llama 3, SmolLM2): ``tokenizer.ggml.model``
  "gpt2", the tokens in the byte-level alphabet, their merges, the special tokens as CONTROL;
  ``pre`` names the split regex (``gpt-2``, ``qwen2``, ``llama-bpe``), which the trained
  tokenizer uses too.
- :func:`spm_vocab`: a SentencePiece-style BPE (Llama 2, TinyLlama): ``tokenizer.ggml.model``
  "llama", ``<unk>``, ``<s>``, ``</s>``, the 256 byte-fallback tokens ``<0x00>``..., then the
  pieces with scores (higher merges first) and no merges; BOS added to every text.

Each :class:`Vocab` keeps the trained ``tokenizers.Tokenizer`` (``original``): the tokenizer a
Hugging Face checkpoint would ship, to compare the one cbatch builds from the file against.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, \
    processors, trainers

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I am fine, thank you.",
    "cbatch serves language models with continuous batching on CPUs and GPUs.",
    "A GGUF file holds the weights, the tokenizer and the chat template of a model.",
    "Numbers like 12345 and 3.14159 are split into digits by some tokenizers.",
    "the the the and and of of to to in in is is that that it it",
] * 4
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@dataclass
class Vocab:
    model: str  # tokenizer.ggml.model
    pre: str | None  # tokenizer.ggml.pre
    tokens: list[str]
    token_types: list[int]
    merges: list[str] | None
    scores: list[float] | None
    bos_token_id: int | None
    eos_token_id: int
    add_bos: bool
    original: Tokenizer
    eot_token_id: int | None = None  # a chat model's end of turn (llama.cpp stops at it)

    def write(self, writer, vocab_size: int, chat_template: str | None = None) -> None:
        """The converter's tokenizer keys, the list padded to ``vocab_size`` (``[PAD<i>]``,
        UNUSED) as ``get_vocab_base`` and ``_create_vocab_sentencepiece`` pad it."""
        pad = range(len(self.tokens), vocab_size)
        writer.add_tokenizer_model(self.model)
        if self.pre is not None:
            writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens + [f"[PAD{i}]" for i in pad])
        writer.add_token_types(self.token_types + [5] * len(pad))
        if self.scores is not None:
            writer.add_token_scores(self.scores + [-1000.0] * len(pad))
        if self.merges is not None:
            writer.add_token_merges(self.merges)
        if self.bos_token_id is not None:
            writer.add_bos_token_id(self.bos_token_id)
        writer.add_eos_token_id(self.eos_token_id)
        if self.eot_token_id is not None:
            writer.add_eot_token_id(self.eot_token_id)
        writer.add_add_bos_token(self.add_bos)
        if chat_template is not None:
            writer.add_chat_template(chat_template)


def bpe_vocab(pre: str = "qwen2", vocab_size: int = 400) -> Vocab:
    """A byte-level BPE trained on :data:`CORPUS`, split as ``pre`` splits; its special
    tokens are :data:`CHAT_SPECIALS` (EOS ``<|endoftext|>``, the ChatML markers)."""
    tok = Tokenizer(models.BPE())
    if pre == "gpt-2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        split = {"qwen2": QWEN2_SPLIT, "llama-bpe": LLAMA3_SPLIT}[pre]
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=CHAT_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    merges = [" ".join(pair) for pair in _merges(tok)]
    types = [3 if t in CHAT_SPECIALS else 1 for t in tokens]
    eos = vocab["<|endoftext|>"]
    return Vocab("gpt2", pre, tokens, types, merges, None, eos if pre == "gpt-2" else None, eos,
                 False, tok)


def spm_vocab(vocab_size: int = 400) -> Vocab:
    """A SentencePiece-style BPE (Llama 2's tokenizer.json: ``▁`` for spaces, byte fallback)
    trained on :data:`CORPUS`; ids 0-2 ``<unk>``, ``<s>``, ``</s>``, 3-258 the bytes."""
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    types = [2 if t == "<unk>" else 3 if t in ("<s>", "</s>") else 6 if t in specials else 1
             for t in tokens]
    # SentencePiece scores: pieces learned earlier score higher; the specials score 0
    scores = [0.0 if t in specials else -float(i) for i, t in enumerate(tokens)]
    return Vocab("llama", "default", tokens, types, None, scores, 1, 2, True, tok)


def _merges(tok: Tokenizer) -> list[tuple[str, str]]:
    import json

    merges = json.loads(tok.to_str())["model"]["merges"]
    return [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]
