"""cbatch's C++ packers of quantized weights (csrc/cpu/quantized_pack.cpp: a load's path where
the extension is built) against the torch code in :mod:`cbatch.layers.quantization.weight`,
which documents each layout: bitwise, on ragged N (not a multiple of 16) and K (odd, not a
multiple of 32), and the refusal of 4-bit levels above 15."""

import pytest
import torch

from cbatch.layers.quantization.weight import pack, pack_w4a8, pack_w8a8g
from cbatch.ops import cpu
from tests.helpers import needs_cpu_ext

pytestmark = needs_cpu_ext

SHAPES = [(1, 32), (15, 33), (17, 64), (33, 100), (48, 2)]
PATH = "quantized_pack.cpu"


def packs() -> int:
    """How many weights cbatch's C++ packers have packed in this process."""
    return cpu.kernel_paths().get(PATH, 0)


def levels(bits: int, N: int, K: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if bits == 8:
        return torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    return torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("N, K", SHAPES)
def test_pack_levels_is_the_torch_packing_bitwise(bits, N, K):
    q = levels(bits, N, K, N * K)
    scales = torch.rand(1, N)
    before = packs()
    ours = pack(q, scales, None, bits, K)
    assert packs() == before + 1  # the C++ packer ran
    ref = pack(q, scales, None, bits, K, kernel=False)
    assert ours.qweight.dtype == ref.qweight.dtype
    assert torch.equal(ours.qweight, ref.qweight)
    assert torch.equal(ours.dequantize(), ref.dequantize())


@pytest.mark.parametrize("N, K", SHAPES + [(40, 96)])
def test_pack_w4a8_is_the_torch_packing_bitwise(N, K):
    weight = pack(levels(4, N, K, N + K), torch.rand(-(-K // 32), N), None, 4, 32)
    before = packs()
    ours = pack_w4a8(weight)
    assert packs() == before + 1
    assert torch.equal(ours, pack_w4a8(weight, kernel=False))


@pytest.mark.parametrize("N, K", SHAPES + [(40, 96)])
def test_pack_w8a8g_is_the_torch_packing_bitwise(N, K):
    weight = pack(levels(8, N, K, N + K), torch.rand(-(-K // 16), N), None, 8, 16)
    before = packs()
    ours = pack_w8a8g(weight)
    assert packs() == before + 1
    assert torch.equal(ours, pack_w8a8g(weight, kernel=False))


def test_four_bit_levels_above_15_are_refused_as_the_torch_packing_refuses_them():
    q = levels(4, 17, 33, 0)
    q[16, 32] = 16  # the last row's odd k: the last byte's low nibble
    for kernel in (True, False):
        with pytest.raises(ValueError, match=r"4-bit q must be in \[0, 15\]"):
            pack(q, torch.rand(1, 17), None, 4, 33, kernel=kernel)
