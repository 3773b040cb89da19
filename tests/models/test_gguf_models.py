"""GGUF files of tiny random transformers models (Llama with GQA, Qwen2 with q/k/v biases,
Qwen3 with q/k norms and heads wider than hidden / heads, GPT-2), written as llama.cpp's
converter writes them (tests/models/gguf_files.py) with their tensors in every type cbatch
loads, each file mixing Q4_K and Q6_K with the rest:

- cbatch's logits on a GPT-2 file (loaded as float) are bitwise cbatch's logits on a Hugging
  Face checkpoint of the same weights (gguf's dequantization of each tensor), fp32 and bf16
  (the Llama family's quantized linears: test_gguf_quantized.py);
- transformers' own GGUF loading (``from_pretrained(dir, gguf_file=...)``: its config mapping,
  names and permutation, dequantized by gguf) gives the same logits within 2e-5 (fp32 sums in
  another order; logits are of order 1): the independent check of cbatch's config, names and
  llama's q/k permutation.
"""

import copy

import pytest
import torch

from cbatch import LLM, KVCache, SamplingParams, load_model
from cbatch.core.input_batch import make_step_batch
from cbatch.models.gguf.config import model_config
from cbatch.models.gguf.names import unpermute
from cbatch.models.gguf.reader import GGUFFile
from cbatch.models.llama import LlamaConfig
from tests.models.gguf_files import permute, write_gguf
from tests.models.gguf_vocab import bpe_vocab, spm_vocab

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

VOCAB = 512
COMMON = dict(vocab_size=VOCAB, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
ARCHS = {  # K-quants need rows of 256: every matrix here has 256 or 512 columns
    "llama": ("LlamaConfig", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  tie_word_embeddings=False, **COMMON)),
    "qwen2": ("Qwen2Config", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  tie_word_embeddings=True, **COMMON)),
    "qwen3": ("Qwen3Config", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                  tie_word_embeddings=False, **COMMON)),
    # n_positions 1024: transformers' GGUF config for gpt2 drops the context length
    "gpt2": ("GPT2Config", dict(vocab_size=VOCAB, n_positions=1024, n_embd=256, n_layer=2,
                                n_head=4, bos_token_id=1, eos_token_id=2)),
}
TYPES = ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16"]
PROMPTS = [[5, 9, 200, 7, 11, 300, 17], [3], [42] * 20]


def rotating_types(offset: int = 0):
    """``type_of``: each 2-D tensor of a file in the next of :data:`TYPES`."""
    chosen: dict[str, str] = {}

    def type_of(name: str) -> str:
        return chosen.setdefault(name, TYPES[(len(chosen) + offset) % len(TYPES)])
    return type_of


def hf_model(arch: str, **overrides):
    config_cls, kwargs = ARCHS[arch]
    config = getattr(transformers, config_cls)(**{**kwargs, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # biases are zero at init: make Qwen2's (and GPT-2's) count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model.eval()


def make_files(arch: str, path, model=None, type_of=None):
    """(the .gguf, a Hugging Face checkpoint of its weights, the reference model)."""
    model = model if model is not None else hf_model(arch)
    vocab = spm_vocab() if arch == "llama" else bpe_vocab("gpt-2" if arch == "gpt2" else "qwen2")
    path.mkdir(parents=True, exist_ok=True)
    file = path / f"tiny-{arch}.gguf"
    type_of = type_of or rotating_types(sum(map(ord, arch)))
    if arch == "gpt2":  # the converter's copy of the tied head, in its embedding's type
        inner = type_of

        def type_of(name: str) -> str:
            return inner("token_embd.weight" if name == "output.weight" else name)
    weights = write_gguf(model, file, type_of, vocab)
    reference = copy.deepcopy(model)
    result = reference.load_state_dict(weights, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
    reference.save_pretrained(path / "hf")
    return file, path / "hf", reference


@pytest.fixture(scope="module", params=list(ARCHS))
def files(request, tmp_path_factory):
    return (request.param, *make_files(request.param, tmp_path_factory.mktemp(request.param)))


def logits(model, prompts=PROMPTS) -> torch.Tensor:
    """A packed prefill of ``prompts`` then one decode step each: every row's logits."""
    block = 16
    per = max(len(p) for p in prompts) // block + 1  # blocks a sequence takes
    tables = [list(range(per * i, per * (i + 1))) for i in range(len(prompts))]
    cache = KVCache(model.config, per * len(prompts), block, dtype=model.dtype)
    with torch.no_grad():
        first = model.compute_logits(model(make_step_batch(prompts, [0] * len(prompts), tables,
                                                           block), cache))
        step = make_step_batch([[7]] * len(prompts), [len(p) for p in prompts], tables, block)
        second = model.compute_logits(model(step, cache))
    return torch.cat([first, second]).float()


def test_the_file_is_a_mix_of_types(files):
    arch, file, _, _ = files
    with GGUFFile(file) as f:
        counts = f.type_counts()
    assert {"Q4_K", "Q6_K", "F32"} <= set(counts) and len(counts) >= 8, counts


@pytest.mark.parametrize("dtype", [torch.float32,
                                   pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
def test_logits_are_bitwise_those_of_the_dequantized_checkpoint(files, dtype):
    """Where the file loads as float (GPT-2; the Llama family's quantized linears run on the
    quantized kernels: test_gguf_quantized.py)."""
    arch, file, hf_dir, _ = files
    if arch != "gpt2":
        pytest.skip("its quantized linears run cbatch's quantized kernels "
                    "(test_gguf_quantized.py)")
    ours = load_model(str(file), dtype=dtype)
    ref = load_model(str(hf_dir), dtype=dtype)
    assert type(ours) is type(ref)
    assert torch.equal(logits(ours), logits(ref))


def test_config_from_metadata_is_the_checkpoints(files):
    arch, file, hf_dir, _ = files
    ours, ref = load_model(str(file)).config, load_model(str(hf_dir)).config
    if arch == "gpt2":
        assert ours == type(ref)(**{**ref.__dict__, "eos_token_id": ours.eos_token_id,
                                    "bos_token_id": ours.bos_token_id})
        return
    # the ids are the file's tokenizer's (the checkpoint's config.json has the test's 1 and 2)
    ids = dict(bos_token_id=ours.bos_token_id, eos_token_id=ours.eos_token_id)
    assert ours == LlamaConfig(**{**ref.__dict__, **ids})
    assert ours.head_dim == (128 if arch == "qwen3" else 64)  # qwen3: key_length, not 256 / 4


@pytest.mark.slow
def test_transformers_loading_the_same_file_agrees(files):
    arch, file, _, reference = files
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(file.parent), gguf_file=file.name, dtype=torch.float32).eval()
    ours = load_model(str(file), quantization="gguf")  # float activations, as transformers'
    for prompt in PROMPTS:
        with torch.no_grad():
            want = theirs(torch.tensor([prompt])).logits[0]
            # (transformers reads its own float checkpoint of the weights the same)
            torch.testing.assert_close(reference(torch.tensor([prompt])).logits[0], want,
                                       atol=2e-5, rtol=2e-5)
        got = logits(ours, [prompt])[:len(prompt)]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.slow
def test_llm_generates_from_the_file_and_from_its_directory(files):
    arch, file, hf_dir, _ = files
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(hf_dir), max_num_seqs=4).generate(
        PROMPTS, params, use_tqdm=False)]
    for model in (str(file), str(file.parent)):  # the directory holds one .gguf
        llm = LLM(model, max_num_seqs=4, quantization="gguf")  # float activations
        got = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.token_ids for o in got] == want
    # a text prompt goes through the file's own tokenizer, both ways
    out = llm.generate("Hello, world!", params, use_tqdm=False)[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("Hello, world!")
    assert out.text == llm.tokenizer.decode(out.token_ids)


def test_unpermute_undoes_the_converters_permute():
    w = torch.arange(8 * 16 * 3, dtype=torch.float32).reshape(8 * 16, 3)
    for heads, kv_heads in ((8, 8), (8, 2)):
        rows = w[:kv_heads * 16]
        permuted = torch.from_numpy(permute(rows.numpy(), heads, kv_heads))
        assert not torch.equal(permuted, rows)
        assert torch.equal(unpermute(permuted, kv_heads), rows)
    bias = torch.arange(64.0)
    assert torch.equal(unpermute(torch.from_numpy(permute(bias.numpy(), 4, 4)), 4), bias)


def test_llama3_rope_scaling_from_the_rope_freqs_tensor(tmp_path):
    """Llama 3.1's rope scaling reaches a GGUF file as ``rope_freqs`` (one divisor per pair,
    llama.cpp's): its inverse frequencies are the checkpoint's (llama3 rope parameters) to
    within an fp32 rounding (the same numbers, divided in another order), and the logits at
    positions up to 200 within 1e-5."""
    from cbatch.layers.rotary_embedding import inverse_frequencies

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    model = hf_model("llama", rope_parameters=rope, max_position_embeddings=1024)
    file, hf_dir, _ = make_files("llama", tmp_path, model, lambda name: "F32")
    ours, ref = load_model(str(file)), load_model(str(hf_dir))
    assert len(ours.config.rope["freq_factors"]) == 32
    assert ours.config.max_model_len == ref.config.max_model_len == 1024
    theirs = inverse_frequencies(64, ref.config.rope, 1024)
    torch.testing.assert_close(inverse_frequencies(64, ours.config.rope, 1024), theirs,
                               atol=0, rtol=2.4e-7)
    prompts = [list(range(3, 203))]
    torch.testing.assert_close(logits(ours, prompts), logits(ref, prompts), atol=1e-5,
                               rtol=1e-5)


def test_generation_stops_at_the_files_eos_and_end_of_turn(tmp_path):
    """A chat model's file names its end of turn (``<|im_end|>``) apart from its EOS; the
    model stops at either, as llama.cpp does (and as cbatch unites config.json's and
    generation_config.json's)."""
    vocab = bpe_vocab("qwen2")
    vocab.eot_token_id = vocab.tokens.index("<|im_end|>")
    model = hf_model("qwen2", num_hidden_layers=1)
    file = tmp_path / "chat.gguf"
    write_gguf(model, file, lambda name: "F16", vocab)
    config = load_model(str(file)).config
    assert config.eos_token_id == (vocab.eos_token_id, vocab.eot_token_id)
    assert config.bos_token_id is None  # the file names none


def test_linear_rope_scaling_from_the_metadata(tmp_path):
    rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    model = hf_model("llama", rope_parameters=rope)
    file, hf_dir, _ = make_files("llama", tmp_path, model, lambda name: "F16")
    with GGUFFile(file) as f:
        config = model_config(f)
    assert config.rope == load_model(str(hf_dir)).config.rope
    assert config.max_model_len == 512
