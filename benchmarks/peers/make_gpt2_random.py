"""A GPT-2 small checkpoint with random weights (seed 0) for the peers, written offline:

    python make_gpt2_random.py out_DIR

GPT-2's tokenizer may not be downloadable (no hub access) and cbatch has none (its random:
models use a byte tokenizer), so this writes a synthetic GPT-2-shaped byte-level BPE
tokenizer: 50257 ids, ids 0..255 = GPT-2's byte alphabet (bytes_to_unicode order), ids
256..50255 = placeholder tokens (no merges), 50256 = <|endoftext|>.  The benchmark feeds
token ids directly, so the tokenizer only has to exist for loading / detokenizer IRs.
"""
import json
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def main(out: str):
    torch.manual_seed(0)
    config = GPT2Config()
    model = GPT2LMHeadModel(config)
    model.eval()
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)

    alphabet = list(bytes_to_unicode().values())  # GPT-2 id order
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for i in range(256, config.vocab_size - 1):
        vocab[f"<tok{i}>"] = i
    vocab["<|endoftext|>"] = config.vocab_size - 1
    assert len(vocab) == config.vocab_size
    with open(os.path.join(out, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(out, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n")
    tok = GPT2TokenizerFast(vocab=vocab, merges=[])
    tok.save_pretrained(out)
    print("saved", out, "params", sum(p.numel() for p in model.parameters()),
          "vocab", len(tok))


if __name__ == "__main__":
    main(sys.argv[1])
