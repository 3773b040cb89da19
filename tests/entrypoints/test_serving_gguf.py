"""A GGUF file served on 127.0.0.1: a tiny Qwen2 in mixed quantized types whose tokenizer and
ChatML chat template come from the file's metadata.  The chat reply is transformers' on the
same file (its GGUF tokenizer renders the file's template, its GGUF model generates greedily);
``cbatch serve model.gguf`` serves it from its own process, ``cbatch generate --model
model.gguf`` (with its tokenizer, or ``--tokenizer`` a directory's) continues a prompt as
transformers does."""

import signal
import subprocess
import sys

import httpx
import pytest
import torch

from cbatch.entrypoints.openai.chat_utils import load_gguf_chat_template
from cbatch.tokenizer import load_tokenizer
from tests.models.gguf_files import write_gguf
from tests.models.gguf_vocab import bpe_vocab
from tests.serving_utils import free_port, running_server, wait_healthy

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers loads a GGUF model only with it

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "system", "content": "You are brief."},
            {"role": "user", "content": "Hello, world! How are you today?"}]
TYPES = ["Q4_K", "Q6_K", "Q8_0", "Q5_0"]


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    """(the .gguf, transformers' model and tokenizer of it)."""
    config = transformers.Qwen2Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True, initializer_range=0.2)  # (0.02: a reply of one repeated token)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    path = tmp_path_factory.mktemp("qwen2-gguf") / "model" / "chat-Q4_K_M.gguf"
    path.parent.mkdir()
    chosen: dict[str, str] = {}
    vocab = bpe_vocab("qwen2")
    write_gguf(model, path, lambda name: chosen.setdefault(name, TYPES[len(chosen) % 4]),
               vocab, chat_template=CHATML)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    vocab.original.save(str(path.parent.parent / "tokenizer.json"))  # for --tokenizer
    return path, theirs, tok


def _reference(model, tok, max_tokens: int) -> tuple[int, str]:
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                  return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return len(ids), tok.decode(out[0, len(ids):], skip_special_tokens=True)


def test_the_template_and_special_tokens_come_from_the_file(chat_file):
    path, _, _ = chat_file
    template, special = load_gguf_chat_template(path)
    assert template == CHATML
    assert special == {"bos_token": "", "eos_token": "<|endoftext|>"}  # (it names no BOS)
    # the engine's tokenizer of the file read them already: the server takes them from it
    tokenizer = load_tokenizer(str(path), None, 0)
    assert load_gguf_chat_template(path, tokenizer) == (template, special)
    assert tokenizer.chat_template == CHATML


@pytest.mark.slow
def test_chat_completions_through_the_files_template(chat_file):
    path, theirs, tok = chat_file
    prompt_len, want = _reference(theirs, tok, 8)
    # float activations (quantization="gguf"): transformers' greedy tokens, token for token
    with running_server(str(path), "qwen2-gguf", max_num_seqs=4,
                        quantization="gguf") as (url, _):
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "qwen2-gguf", "messages": MESSAGES, "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True}).json()
    assert (reply["usage"]["prompt_tokens"], reply["usage"]["completion_tokens"]) == (
        prompt_len, 8)
    assert reply["choices"][0]["message"]["content"] == want


@pytest.mark.slow
def test_cbatch_serve_command_serves_the_file(chat_file):
    path, theirs, tok = chat_file
    _, want = _reference(theirs, tok, 6)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cbatch.entrypoints.cli.main", "serve",
                             str(path), "--port", str(port), "--threads", "1",
                             "--dtype", "float32", "--device", "cpu",
                             "--quantization", "gguf"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, timeout=120)
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": str(path), "messages": MESSAGES, "max_tokens": 6, "temperature": 0.0,
            "ignore_eos": True}).json()
        assert reply["choices"][0]["message"]["content"] == want, reply
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    # the file's Q4_K/Q5_0/Q6_K linears ran on cbatch's quantized layers, not as floats
    quantized = [line for line in out.decode().splitlines() if "quantized linear" in line]
    assert quantized and "int4 g32 mins" in quantized[0] and "layers" in quantized[0], \
        out.decode()[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("own_tokenizer", [True, False])
def test_cbatch_generate_continues_a_prompt_as_transformers(chat_file, capsys, own_tokenizer):
    from cbatch.entrypoints.cli.main import main

    path, theirs, tok = chat_file
    ids = tok("Hello, world!")["input_ids"]
    with torch.no_grad():
        out = theirs.generate(torch.tensor([ids]), max_new_tokens=5, min_new_tokens=5,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
    want = tok.decode(out[0, len(ids):], skip_special_tokens=True)
    flags = [] if own_tokenizer else ["--tokenizer", str(path.parent.parent)]
    main(["generate", "--model", str(path), "--prompt", "Hello, world!", "--max-tokens", "5",
          "--temperature", "0", "--ignore-eos", "--dtype", "float32", "--quantization", "gguf",
          *flags])
    assert capsys.readouterr().out.startswith("Hello, world!" + want)
