"""cbatch's GGUF block decoder against the gguf package's own ``dequantize`` (llama.cpp's
Python reference): bitwise, for every type cbatch loads, on random blocks (any bytes with
finite fp16 scales are a valid block), odd row counts, rows of one block and of several, 1-D
tensors, and a file holding many types at once, read back through cbatch's reader."""

import numpy as np
import pytest
import torch

from cbatch.models.gguf import BLOCK_TYPES, SUPPORTED_TYPES, dequantize_tensor, unpack
from cbatch.models.gguf.blocks import unpack_blocks
from cbatch.ops import cpu
from tests.helpers import needs_cpu_ext
from tests.models.gguf_files import quantize

gguf = pytest.importorskip("gguf")
QT = gguf.GGMLQuantizationType

# where each type keeps its fp16 fields (d, and dmin or m): random bytes there could be NaN
FP16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2],
               "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
# the level a type stores for 0 (zeros), or None: it subtracts fp32 mins instead
ZEROS = {"Q8_0": 0, "Q4_0": 8, "Q5_0": 16, "Q6_K": 32, "Q4_1": None, "Q5_1": None,
         "Q4_K": None, "Q5_K": None}
LEVELS = {"Q8_0": (-128, 127), "Q4_0": (0, 15), "Q4_1": (0, 15), "Q5_0": (0, 31),
          "Q5_1": (0, 31), "Q4_K": (0, 15), "Q5_K": (0, 31), "Q6_K": (0, 63)}


def random_tensor(qtype: str, shape: tuple[int, ...], rng) -> np.ndarray:
    """uint8: the bytes of a ``qtype`` tensor of ``shape`` (rows last): random, with finite
    fp16 scales spanning small and large magnitudes and both signs (subnormals included)."""
    if qtype in ("F32", "F16", "BF16"):
        x = (rng.standard_normal(shape) * 10.0 ** rng.integers(-6, 4, shape)).astype(np.float32)
        if qtype == "BF16":
            return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return x.astype(np.float16 if qtype == "F16" else np.float32).view(np.uint8)
    block, size = gguf.GGML_QUANT_SIZES[QT[qtype]]
    count = int(np.prod(shape)) // block
    raw = rng.integers(0, 256, (count, size), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        scale = rng.standard_normal(count) * 10.0 ** rng.integers(-7, 3, count)
        raw[:, offset:offset + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(*shape[:-1], -1)


def assert_bitwise(ours: torch.Tensor, ref: np.ndarray) -> None:
    assert ours.dtype == torch.float32 and tuple(ours.shape) == ref.shape
    same = ours.numpy().view(np.uint32) == ref.astype(np.float32).view(np.uint32)
    assert same.all(), f"{(~same).sum()} of {same.size} differ"


def shapes(qtype: str) -> list[tuple[int, ...]]:
    block = gguf.GGML_QUANT_SIZES[QT[qtype]][0]
    k = block if block > 1 else 7
    return [(k,), (1, k), (3, k), (5, 3 * k), (17, 2 * k), (2, 3, k)]


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES)
def test_every_type_decodes_bitwise_as_gguf_dequantizes(qtype):
    rng = np.random.default_rng(sum(map(ord, qtype)))
    for shape in shapes(qtype):
        raw = random_tensor(qtype, shape, rng)
        ref = gguf.quants.dequantize(raw, QT[qtype]).reshape(shape)
        assert_bitwise(dequantize_tensor(torch.from_numpy(raw), qtype, shape), ref)


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_the_unpacked_form_holds_levels_scales_and_zeros_or_mins(qtype):
    """q [N, K] in the type's range, scales fp32 [G, N], zeros int8 [G, N] holding the
    type's zero level or mins fp32 [G, N]; its formula gives gguf's floats bitwise."""
    rng = np.random.default_rng(1)
    block = gguf.GGML_QUANT_SIZES[QT[qtype]][0]
    N, K = 5, 2 * block
    raw = random_tensor(qtype, (N, K), rng)
    u = unpack(torch.from_numpy(raw), qtype, (N, K))
    G = K // u.group_size
    assert u.group_size == (16 if qtype == "Q6_K" else 32)
    assert u.q.shape == (N, K) and u.q.dtype == (torch.int8 if qtype == "Q8_0" else torch.uint8)
    low, high = LEVELS[qtype]
    assert low <= int(u.q.min()) and int(u.q.max()) <= high < 2 ** u.bits
    assert u.scales.shape == (G, N) and u.scales.dtype == torch.float32
    if ZEROS[qtype] is None:
        assert u.zeros is None and u.mins.shape == (G, N) and u.mins.dtype == torch.float32
        w = u.scales.t().repeat_interleave(u.group_size, 1) * u.q.float() - \
            u.mins.t().repeat_interleave(u.group_size, 1)
    else:
        assert u.mins is None and u.zeros.dtype == torch.int8
        assert (u.zeros == ZEROS[qtype]).all() and u.zeros.shape == (G, N)
        w = u.scales.t().repeat_interleave(u.group_size, 1) * (u.q.float() - u.zeros.t().float()
                                                               .repeat_interleave(u.group_size, 1))
    ref = gguf.quants.dequantize(raw, QT[qtype])
    assert_bitwise(u.dequantize(), ref)
    assert_bitwise(w, ref)


@needs_cpu_ext
@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_the_cpp_unpacker_is_the_torch_one_bitwise(qtype):
    """cbatch's C++ unpacker (a load's path where the extension is built: its counter moves)
    against each type's torch unpacker, field for field, on 4099 random blocks (more than
    one thread's share) with finite scales; both decode as gguf does."""
    rng = np.random.default_rng(2)
    block, size = gguf.GGML_QUANT_SIZES[QT[qtype]]
    raw = random_tensor(qtype, (4099, block), rng)
    blocks = torch.from_numpy(raw).reshape(-1, size)
    before = cpu.kernel_paths().get("gguf_unpack.cpu", 0)
    ours = unpack_blocks(blocks, qtype)
    assert cpu.kernel_paths()["gguf_unpack.cpu"] == before + 1
    for got, want in zip(ours, unpack_blocks(blocks, qtype, kernel=False), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(torch.int32) if got.dtype == torch.float32 else got,
                           want.view(torch.int32) if want.dtype == torch.float32 else want)
    ref = gguf.quants.dequantize(raw, QT[qtype])
    assert_bitwise(unpack(torch.from_numpy(raw), qtype, (4099, block)).dequantize(), ref)


def test_sizes_that_are_no_whole_blocks_are_refused():
    raw = torch.zeros(18 * 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match="whole blocks of 32"):
        dequantize_tensor(raw, "Q4_0", (3, 40))
    with pytest.raises(ValueError, match="is 36 bytes"):
        dequantize_tensor(raw, "Q4_0", (2, 32))
    with pytest.raises(ValueError, match="not a block-quantized type"):
        unpack(raw, "F16", (27,))


def test_f32_decodes_to_a_copy_not_a_view_of_the_file():
    raw = torch.from_numpy(np.arange(6, dtype=np.float32).view(np.uint8))
    out = dequantize_tensor(raw, "F32", (2, 3))
    raw.zero_()
    assert out.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_a_file_of_mixed_types_reads_back_bitwise(tmp_path):
    """A Q4_K_M-like file (Q4_K beside Q6_K, F32 norms) with every other type too, written by
    gguf's writer and read through cbatch's reader (memory-mapped): each tensor is gguf's
    dequantize of the file's own bytes, and the types are counted for the load's log line."""
    from cbatch.models.gguf.reader import GGUFFile

    rng = np.random.default_rng(2)
    writer = gguf.GGUFWriter(str(tmp_path / "mixed.gguf"), "llama")
    written = {}
    for i, qtype in enumerate(["Q4_K", "Q6_K", "Q4_K", "Q6_K", *SUPPORTED_TYPES]):
        block = gguf.GGML_QUANT_SIZES[QT[qtype]][0]
        shape = (3 + 2 * (i % 3), 256 if block == 256 else 3 * max(block, 32))
        if qtype in ("Q4_K", "Q6_K", "Q4_0", "Q8_0", "Q5_1"):  # blocks from real weights
            data = quantize(rng.standard_normal(shape).astype(np.float32) * 0.02, qtype)
        else:
            data = random_tensor(qtype, shape, rng)
            data = data.view(np.float32 if qtype == "F32" else np.float16) if qtype in (
                "F32", "F16") else data
        name = f"blk.{i}.ffn_up.weight"
        writer.add_tensor(name, data, raw_dtype=QT[qtype] if data.dtype == np.uint8 else None)
        written[name] = (qtype, shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(str(tmp_path / "mixed.gguf"))
    with GGUFFile(tmp_path / "mixed.gguf") as f:
        assert f.describe_types().startswith("Q4_K: 3 tensors, Q6_K: 3")
        for tensor in reader.tensors:
            qtype, shape = written[tensor.name]
            assert f.qtype(tensor.name) == qtype and f.shape(tensor.name) == shape
            ours = dequantize_tensor(f.raw(tensor.name), qtype, shape)
            assert_bitwise(ours, gguf.quants.dequantize(tensor.data, tensor.tensor_type))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_the_test_k_quantizer_writes_blocks_that_hold_the_weights(qtype):
    """The test files' K-quant writer (tests/models/gguf_files.py) makes blocks whose gguf
    dequantization is the weights within the type's step: the model tests load real-looking
    weights, not noise."""
    x = np.random.default_rng(3).standard_normal((4, 512)).astype(np.float32) * 0.02
    w = gguf.quants.dequantize(quantize(x, qtype), QT[qtype])
    step = {"Q4_K": 1 / 15, "Q5_K": 1 / 31, "Q6_K": 1 / 31}[qtype]
    assert np.abs(w - x).max() <= 1.2 * step * np.abs(x).max()
