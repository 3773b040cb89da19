"""cbatch's GGUF header reader (cbatch.models.gguf.header) against llama.cpp's own,
``gguf.GGUFReader``: every metadata value of every GGUF value type, arrays of numbers and of
strings (a vocabulary's), and every tensor's type, shape and bytes, at alignments 32 and 64."""

import mmap

import numpy as np
import pytest

from cbatch.models.gguf.header import read_header
from cbatch.models.gguf.reader import GGUFFile

gguf = pytest.importorskip("gguf")
QT = gguf.GGMLQuantizationType
VT = gguf.GGUFValueType


def _write(path, alignment: int):
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment != 32:
        writer.add_custom_alignment(alignment)
    for kind, value in [(VT.UINT8, 200), (VT.INT8, -100), (VT.UINT16, 60000),
                        (VT.INT16, -30000), (VT.UINT32, 4_000_000_000), (VT.INT32, -2_000_000),
                        (VT.UINT64, 2**40 + 3), (VT.INT64, -(2**40)), (VT.FLOAT32, 1e-6),
                        (VT.FLOAT64, 0.1), (VT.BOOL, True), (VT.STRING, "ünïcode ✓")]:
        writer.add_key_value(f"test.{kind.name.lower()}", value, kind)
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.5, 1e-5, 3.25])
    writer.add_token_list(["<s>", "▁the", "Ġwörld", "", "<0x0A>"] * 1000)
    writer.add_token_merges(["Ġ t", "h e"] * 500)
    writer.add_chat_template("{{ messages }}")
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.standard_normal((5, 64)).astype(np.float32))
    writer.add_tensor("blk.0.attn_q.weight", rng.standard_normal((3, 96)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), QT.Q8_0)
    writer.add_tensor("blk.0.ffn_up.weight", q8, raw_dtype=QT.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [32, 64])
def test_the_header_reads_as_gguf_reads_it(tmp_path, alignment):
    path = _write(tmp_path / "all.gguf", alignment)
    theirs = gguf.GGUFReader(str(path))
    with open(path, "rb") as f:
        ours = read_header(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    assert ours.version == 3
    assert list(ours.metadata) == [k for k in theirs.fields if not k.startswith("GGUF.")]
    for key, value in ours.metadata.items():
        expected = theirs.fields[key].contents()
        if key in ("test.float32", "test.floats"):  # the shortest decimal of the float32
            expected = [float(str(np.float32(v))) for v in np.atleast_1d(expected)]
            value = value if isinstance(value, list) else [value]
        assert value == expected, key
    assert ours.metadata["test.float32"] == 1e-6 and ours.metadata["test.bool"] is True
    assert ours.data_offset == theirs.data_offset
    assert [(t.name, t.dims, t.type, t.offset) for t in ours.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type),
         int(t.data_offset) - theirs.data_offset) for t in theirs.tensors]
    with GGUFFile(path) as f:
        assert f.token(2) == "Ġwörld" and f.token(5000) is None
        for t in theirs.tensors:
            assert f.qtype(t.name) == t.tensor_type.name
            assert bytes(f.raw(t.name).numpy()) == t.data.tobytes()


def test_a_value_type_gguf_does_not_define_is_named(tmp_path):
    """A metadata value of a type number past GGUF's 12 is refused, naming the file."""
    import struct

    path = tmp_path / "odd.gguf"
    key = b"general.architecture"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                     + struct.pack("<I", 99) + b"\0" * 16)
    with pytest.raises(ValueError, match=f"{path} is damaged: a metadata value of type 99"):
        GGUFFile(path)
