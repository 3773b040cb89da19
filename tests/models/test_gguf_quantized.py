"""A GGUF file's quantized linears run on cbatch's quantized kernels, each in the exact form
of its block type (cbatch.models.gguf.quantized):

- every weight a quantized layer holds is bitwise ``gguf.quants.dequantize`` of the file's
  tensor (the Hugging Face checkpoint of test_gguf_models.py's writer holds exactly those);
- the model's logits are the float checkpoint's within fp32 rounding (the sums in another
  order), and the quantized kernels ran;
- a projection whose shards are of different types (Q4_K_M keeps attn_v at 6 bits) runs as
  a StackedLinear, one kernel per run of one type;
- by default (and with ``quantization="w4a8"``) every layer's inputs are quantized to int8
  per group (llama.cpp's route: W4A8 on 4-bit levels, W8A8 per group on 8-bit ones);
  ``quantization="gguf"`` keeps every layer's inputs float."""

import pytest
import torch

from cbatch import load_model
from cbatch.layers.linear import Linear
from cbatch.layers.quantization import QuantizedLinear
from cbatch.layers.stacked_linear import StackedLinear
from cbatch.models.gguf.blocks import BLOCK_TYPES
from cbatch.ops import cpu, quantized
from tests.models.test_gguf_models import logits, make_files

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
LLAMA_FAMILY = ("llama", "qwen2", "qwen3")


@pytest.fixture(scope="module", params=LLAMA_FAMILY)
def files(request, tmp_path_factory):
    return (request.param, *make_files(request.param, tmp_path_factory.mktemp(request.param)))


def dense(module) -> torch.Tensor:
    """The fp32 weight a quantized (or stacked) layer runs."""
    if isinstance(module, StackedLinear):
        return torch.cat([dense(part) for part in module.parts])
    if isinstance(module, QuantizedLinear):
        assert module.perm is None
        return module.weight.dequantize()
    return module.weight.float()


def linears(model) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules()
            if isinstance(m, (QuantizedLinear, StackedLinear, Linear))
            and not any(name.startswith(s) for s in _parts_of(model))}


def _parts_of(model) -> list[str]:
    return [f"{name}.parts." for name, m in model.named_modules() if isinstance(m, StackedLinear)]


def quantized_calls() -> int:
    return sum(n for path, n in cpu.kernel_paths().items() if path.startswith("quantized_linear"))


def test_each_quantized_weight_is_ggufs_dequantize(files):
    arch, file, hf_dir, _ = files
    ours, ref = load_model(str(file), quantization="gguf"), load_model(str(hf_dir))
    mine, theirs = linears(ours), linears(ref)
    assert set(mine) == set(theirs)
    kinds = {type(m) for m in mine.values()}
    assert {QuantizedLinear, StackedLinear} <= kinds, kinds  # the file mixes types
    for name, module in mine.items():
        assert torch.equal(dense(module), theirs[name].weight), name


@pytest.mark.parametrize("method", ["gguf", None, "w4a8"])
def test_logits_are_the_dequantized_checkpoints(files, method):
    arch, file, hf_dir, _ = files
    ours = load_model(str(file), quantization=method)
    ref = load_model(str(hf_dir))
    layers = [m for name, m in ours.named_modules()
              if isinstance(m, QuantizedLinear) and name != "lm_head"]  # (a tied one: below)
    assert {m.bits for m in layers} == {4, 8}
    assert all((m.act_bits == 8) == (method != "gguf") for m in layers)  # llama.cpp's route
    before = quantized_calls()
    got, want = logits(ours), logits(ref)
    if quantized.available("w8a16"):
        assert quantized_calls() > before
    if method == "gguf":  # fp32 sums in another order
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:  # x rounded to int8 per group of the weight's (32; Q6_K's 16) in every layer
        assert (got - want).abs().max() <= 0.05 * want.abs().max()


@pytest.mark.parametrize("qtype", sorted(BLOCK_TYPES))
def test_every_block_type_runs_as_one_layer(tmp_path, qtype):
    """A llama file whose 2-D tensors are all ``qtype``: q/k/v and gate/up fuse into one
    quantized layer each, its weights gguf's bitwise, its logits with float inputs the float
    checkpoint's."""
    file, hf_dir, _ = make_files("llama", tmp_path, type_of=lambda name: qtype)
    ours, ref = load_model(str(file), quantization="gguf"), load_model(str(hf_dir))
    attn = ours.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, QuantizedLinear)
    assert isinstance(ours.lm_head, QuantizedLinear)
    for name, module in linears(ours).items():
        assert torch.equal(dense(module), linears(ref)[name].weight), name
    want = logits(ref)
    torch.testing.assert_close(logits(ours), want, atol=1e-4, rtol=1e-4)
    # by default every layer takes int8 inputs per group: W4A8 or W8A8 per group
    default = load_model(str(file))
    kind = "w4a8" if BLOCK_TYPES[qtype].bits == 4 else "w8a8g"
    assert {m.kind for m in linears(default).values()} == {kind}
    before = cpu.kernel_paths().get(f"quantized_linear.{kind}.{quantized.isa(kind)}", 0)
    assert (logits(default) - want).abs().max() <= 0.05 * want.abs().max()
    if quantized.available(kind):
        assert cpu.kernel_paths()[f"quantized_linear.{kind}.{quantized.isa(kind)}"] > before


@pytest.mark.parametrize("method,qtype", [(None, "Q8_0"), (None, "Q6_K"), (None, "Q4_0"),
                                          (None, "Q4_K"), ("w4a8", "Q8_0"), ("gguf", "Q8_0")])
def test_a_tied_quantized_embedding_runs_as_its_own_blocks(tmp_path, method, qtype):
    """A tied file (Qwen2's) whose token_embd is quantized: by default (and with w4a8) its
    lm_head runs the file's blocks with int8 inputs per group (W8A8 per group on Q8_0's and
    Q6_K's levels, W4A8 on Q4_0's and Q4_K's, mins and all), and the embedding reads its rows
    from them, bitwise the file's dequantized rows (no float copy of the vocabulary kept); with
    "gguf" the head stays the float blocks' own."""
    from cbatch.layers.embedding import Embedding

    file, hf_dir, _ = make_files("qwen2", tmp_path, type_of=lambda name: qtype)
    ours, ref = load_model(str(file), quantization=method), load_model(str(hf_dir))
    embedding = next(m for m in ours.modules() if isinstance(m, Embedding))
    if method == "gguf":
        assert isinstance(ours.lm_head, Linear) and embedding.weight is ours.lm_head.weight
        return
    kind = "w4a8" if BLOCK_TYPES[qtype].bits == 4 else "w8a8g"
    assert isinstance(ours.lm_head, QuantizedLinear) and ours.lm_head.kind == kind
    assert embedding.weight is None
    ids = torch.tensor([0, 5, 5, 17, 511])
    want = ref.model.embed_tokens.weight[ids]  # the file's blocks, dequantized
    assert torch.equal(embedding(ids), want)
    bf16 = load_model(str(file), quantization=method, dtype=torch.bfloat16)  # rows in its dtype
    assert torch.equal(bf16.model.embed_tokens(ids), want.to(torch.bfloat16))
    counter = f"quantized_linear.{kind}.{quantized.isa(kind)}"
    before = cpu.kernel_paths().get(counter, 0)
    got, want = logits(ours), logits(ref)
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    if quantized.available(kind):
        assert cpu.kernel_paths()[counter] > before


def test_each_quantized_layer_goes_to_huge_pages_as_it_loads(tmp_path, monkeypatch):
    """On the CPU the loader places each quantized layer's packed tensors where the runner
    keeps weights as soon as the layer is made (``load_model``'s ``place``,
    cbatch.models.quantized_checkpoint.install), so one layer's unpacked and packed copies are
    freed before the next is read: after ``load_model`` alone every quantized layer is placed,
    and where Linux gives huge pages its qweight and scales lie in one of HugePages' chunks.
    An engine's load passes its runner's place: its model comes back from loading placed,
    before any runner exists; without ``place`` the runner places them later."""
    import cbatch.core.engine as engine_module
    from cbatch.core.cpu.memory import CHUNK, HUGE_PAGE, huge_pages_available
    from cbatch.core.worker import weight_place

    def quantized(model):
        layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
        assert len(layers) > 2
        return layers

    file, _, _ = make_files("llama", tmp_path, type_of=lambda name: "Q4_0")
    assert not any(m.placed for m in quantized(load_model(str(file))))
    layers = quantized(load_model(str(file), place=weight_place("cpu")))
    assert all(m.placed for m in layers)
    if huge_pages_available():
        for m in layers:
            for t in (m.qweight, m.scales):
                assert t.untyped_storage().nbytes() == CHUNK + HUGE_PAGE

    loaded = []
    load = engine_module.load_model_and_tokenizer

    def spy(config, place=None):
        model, tokenizer = load(config, place)
        loaded.append([m.placed for m in quantized(model)])
        return model, tokenizer

    monkeypatch.setattr(engine_module, "load_model_and_tokenizer", spy)
    engine_module.Engine(str(file), max_num_seqs=2, num_blocks=8)
    assert len(loaded) == 1 and all(loaded[0])
