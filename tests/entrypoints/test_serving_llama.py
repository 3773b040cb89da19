"""A Qwen2-architecture checkpoint with its own tokenizer and ChatML chat template, served on
127.0.0.1 and asked through the official openai client (httpx when it is not installed):
the chat reply is transformers' greedy generate on transformers' rendering of the template.
The tokenizer adds a BOS to a text, as Llama's do: a completion's prompt gets it, a chat
prompt gets the one its template writes (``{{ bos_token }}``) and no second one."""

import json

import httpx
import pytest
import torch

from tests.serving_utils import running_server

pytestmark = pytest.mark.slow  # a server and a checkpoint
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

CHATML = ("{{ bos_token }}{% for m in messages %}"
          "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello there, how are you today?",
          "Paged attention keeps each sequence's keys and values in fixed-size blocks.",
          "Continuous batching lets requests join and leave the batch at every step."] * 20


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    """(directory, transformers model, tokenizers.Tokenizer): a byte-level BPE of 400 tokens
    trained here, the chat template in tokenizer_config.json, <|im_end|> the eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    eos = tok.token_to_id("<|im_end|>")
    bos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    config = transformers.Qwen2Config(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        max_position_embeddings=256, tie_word_embeddings=True, eos_token_id=eos,
        bos_token_id=None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    path = tmp_path_factory.mktemp("qwen2-chat")
    model.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    return path, model, tok


def _reference(path, model, tok, messages, max_tokens):
    """transformers renders the template and generates greedily; the text of the new tokens."""
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    text = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False).ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    new = out[0, len(ids):].tolist()
    return len(ids), tok.decode(new, skip_special_tokens=True)  # as the server, by default


def test_chat_completions_through_the_checkpoints_template(chat_checkpoint):
    path, model, tok = chat_checkpoint
    messages = [{"role": "system", "content": "You are brief."},
                {"role": "user", "content": "Hello there, how are you today?"}]
    prompt_len, want = _reference(path, model, tok, messages, 10)
    with running_server(str(path), "qwen2-chat", max_num_seqs=4) as (url, _):
        body = {"model": "qwen2-chat", "messages": messages, "max_tokens": 10,
                "temperature": 0.0, "ignore_eos": True}
        try:
            import openai
        except ImportError:
            reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
            content = reply["choices"][0]["message"]["content"]
            usage = reply["usage"]["prompt_tokens"], reply["usage"]["completion_tokens"]
        else:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
            reply = client.chat.completions.create(
                model="qwen2-chat", messages=messages, max_tokens=10, temperature=0.0,
                extra_body={"ignore_eos": True})
            content = reply.choices[0].message.content
            usage = reply.usage.prompt_tokens, reply.usage.completion_tokens
    assert usage == (prompt_len, 10)
    assert content == want


def test_a_completion_prompt_gets_the_tokenizers_bos(chat_checkpoint):
    path, model, tok = chat_checkpoint
    ids = transformers.AutoTokenizer.from_pretrained(path)("Hello there").input_ids
    assert ids[0] == tok.token_to_id("<|endoftext|>")
    with running_server(str(path), "qwen2-chat", max_num_seqs=4) as (url, _):
        reply = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": "qwen2-chat", "prompt": "Hello there", "max_tokens": 2}).json()
    assert reply["usage"]["prompt_tokens"] == len(ids)


def test_cbatch_serve_command_serves_the_checkpoint(chat_checkpoint):
    """`cbatch serve <checkpoint>` in its own process: the memory report names the KV heads,
    and the chat reply is the one the in-process server gives (transformers' greedy reply)."""
    import signal
    import subprocess
    import sys

    from tests.serving_utils import free_port, wait_healthy

    path, model, tok = chat_checkpoint
    messages = [{"role": "user", "content": "Hello there, how are you today?"}]
    _, want = _reference(path, model, tok, messages, 6)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cbatch.entrypoints.cli.main", "serve",
                             str(path), "--served-model-name", "chat", "--port", str(port),
                             "--threads", "1", "--dtype", "float32"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, timeout=120)
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "chat", "messages": messages, "max_tokens": 6, "temperature": 0.0,
            "ignore_eos": True}).json()
        assert reply["choices"][0]["message"]["content"] == want
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert "x 1 KV heads x head_dim 16" in out.decode(), out.decode()[-2000:]


def test_a_llama_without_a_chat_template_gets_a_400_naming_it_and_the_flag(tmp_path):
    """A base Llama checkpoint (no template, and here no tokenizer either): the 400 names the
    served model and its architecture and says how to give it a template."""
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="has no tokenizer"), \
            running_server(str(tmp_path), "tiny-llama", max_num_seqs=2) as (url, _):
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "messages"
    assert error["message"] == (
        "model 'tiny-llama' (LlamaForCausalLM) has no chat template: its checkpoint ships "
        "none, and the server was started without one; give it one with `cbatch serve ... "
        "--chat-template FILE` (a Jinja template), or use /v1/completions")
