"""GGUF files cbatch does not run are refused with an error that names the file and what is
wrong with it: an architecture or a tensor type it does not load, a tensor name its model has
no place for, a missing metadata key, a file cut short or that is no GGUF at all, and a
directory holding two .gguf files (which one?)."""

import numpy as np
import pytest
import torch

from cbatch import LLM, load_model
from cbatch.hub import find_gguf_file
from tests.models.gguf_files import write_gguf
from tests.models.gguf_vocab import bpe_vocab

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
QT = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory):
    """A valid tiny llama file (F16 weights, a BPE vocabulary)."""
    config = transformers.LlamaConfig(vocab_size=400, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    path = tmp_path_factory.mktemp("valid") / "tiny.gguf"
    write_gguf(model, path, lambda name: "F16", bpe_vocab("llama-bpe"))
    return path


def write(path, arch: str = "llama", tensors: dict | None = None, kv: dict | None = None,
          **options):
    writer = gguf.GGUFWriter(str(path), arch, **options)
    for key, value in (kv or {}).items():
        writer.add_uint32(key, value)
    for name, (data, qtype) in (tensors or {}).items():
        writer.add_tensor(name, data, raw_dtype=QT[qtype] if data.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_valid_file_loads(llama_file):
    assert type(load_model(str(llama_file))).__name__ == "LlamaForCausalLM"


def test_an_unknown_architecture_is_named(tmp_path):
    path = write(tmp_path / "falcon.gguf", "falcon",
                 {"token_embd.weight": (np.zeros((4, 8), np.float32), "F32")})
    with pytest.raises(ValueError, match=f"{path} has general.architecture 'falcon'; cbatch "
                       "runs GGUF files of llama, qwen2, qwen3, gpt2"):
        load_model(str(path))


def test_an_unknown_tensor_type_is_named(tmp_path):
    q2_k = np.zeros((2, 84), np.uint8)  # two rows of one Q2_K block (84 bytes)
    path = write(tmp_path / "q2k.gguf", tensors={"blk.0.attn_q.weight": (q2_k, "Q2_K")})
    with pytest.raises(ValueError, match=r"q2k.gguf: tensor blk.0.attn_q.weight is of type "
                       r"Q2_K, which cbatch does not load; it loads F32, F16, BF16, Q8_0"):
        load_model(str(path))


def test_a_tensor_the_model_has_no_place_for_is_named(tmp_path, llama_file):
    reader = gguf.GGUFReader(str(llama_file))
    writer = gguf.GGUFWriter(str(tmp_path / "extra.gguf"), "llama")
    for key, field in reader.fields.items():
        if key.startswith(("llama.", "tokenizer.")):
            writer.add_key_value(key, field.contents(), field.types[0],
                                 field.types[-1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data))
    writer.add_tensor("blk.0.attn_gate.weight", np.zeros((64, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="extra.gguf: tensor blk.0.attn_gate.weight is not "
                       "one of a llama model's"):
        load_model(str(tmp_path / "extra.gguf"))


def test_a_missing_metadata_key_is_named(tmp_path):
    path = write(tmp_path / "bare.gguf",
                 tensors={"token_embd.weight": (np.zeros((4, 8), np.float32), "F32")},
                 kv={"llama.embedding_length": 8})
    with pytest.raises(ValueError, match="bare.gguf lacks the metadata key "
                       "llama.attention.head_count"):
        load_model(str(path))


def test_a_truncated_file_is_named(tmp_path, llama_file):
    data = llama_file.read_bytes()
    for size in (len(data) // 2, 100):  # in the tensors' data, in the header
        path = tmp_path / f"cut{size}.gguf"
        path.write_bytes(data[:size])
        with pytest.raises(ValueError, match=rf"{path} is truncated or damaged: its header or "
                           rf"tensor data does not fit its {size} bytes"):
            load_model(str(path))


def test_a_file_that_is_no_gguf_is_named(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 a zip, say")
    with pytest.raises(ValueError, match=f"{path} is not a GGUF file"):
        load_model(str(path))
    with pytest.raises(FileNotFoundError, match="no GGUF file at .*missing.gguf"):
        load_model(str(tmp_path / "missing.gguf"))


def test_a_big_endian_file_is_named(tmp_path):
    path = write(tmp_path / "be.gguf", tensors={
        "token_embd.weight": (np.zeros((4, 8), np.float32), "F32")},
        endianess=gguf.GGUFEndian.BIG)
    with pytest.raises(ValueError, match=f"{path} is a GGUF file of the other byte order"):
        load_model(str(path))


def test_a_directory_with_two_gguf_files_names_them(tmp_path, llama_file):
    (tmp_path / "a-Q4_K_M.gguf").write_bytes(llama_file.read_bytes())
    (tmp_path / "b-Q8_0.gguf").write_bytes(llama_file.read_bytes())
    with pytest.raises(ValueError, match=f"{tmp_path} holds 2 GGUF files \\(a-Q4_K_M.gguf, "
                       "b-Q8_0.gguf\\); name the one to load"):
        load_model(str(tmp_path))
    with pytest.raises(ValueError, match="holds 2 GGUF files"):
        LLM(str(tmp_path))  # the engine's tokenizer and model find it the same way


def test_a_directory_of_hugging_face_weights_is_no_gguf_model(tmp_path, llama_file):
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "x.gguf").write_bytes(llama_file.read_bytes())
    assert find_gguf_file(str(tmp_path)) is None
    assert find_gguf_file(str(tmp_path / "x.gguf")) == tmp_path / "x.gguf"
    assert find_gguf_file("random:tiny") is None and find_gguf_file("owner/repo") is None


def test_online_quantization_of_a_gguf_file_is_refused(llama_file):
    with pytest.raises(ValueError, match="quantization='int8' does not apply to .*tiny.gguf: "
                       "a GGUF file's tensors are quantized by the file itself"):
        load_model(str(llama_file), quantization="int8")


@pytest.mark.parametrize("where, name, qtype, value", [
    ("model.norm.weight", "output_norm.weight", "F32", float("nan")),  # a float tensor
    ("model.layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight", "Q8_0",
     float("inf")),  # a block's scale
    ("model.embed_tokens.weight", "token_embd.weight", "Q8_0",
     float("inf")),  # a tied embedding's block, which the lm_head runs as it is
])
def test_a_tensor_that_is_not_finite_is_named(tmp_path, where, name, qtype, value):
    """A NaN or inf in a file's tensor (a float value, or a block's scale) is refused at load,
    naming the tensor and the file: it would make every logit NaN."""
    config = transformers.LlamaConfig(vocab_size=400, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=64,
                                      tie_word_embeddings=name == "token_embd.weight")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.get_parameter(where).view(-1)[3] = value
    path = tmp_path / "bad.gguf"
    write_gguf(model, path, lambda tensor: qtype if tensor == name else "F16",
               bpe_vocab("llama-bpe"))
    with pytest.raises(ValueError, match=f"{path}: {name}.* not finite"):
        load_model(str(path))
