"""Which path each CPU kernel runs (csrc/cpu/cpu_options.cpp): torch.ops.cbatch.cpu_isa, the
per-path call counters (cpu_path_names / cpu_path_counts) and set_cpu_options, which caps the
kernels at their AVX2 paths or forces the portable attention step.  Each test asserts that the
counter of the path that should run went up by one and no other moved; paths this CPU lacks
are skipped.  The attention kernels' paths are asserted in tests/ops/test_attention.py
(test_cpu_kernel_paths), beside their results."""

import pytest
import torch

from cbatch import ops
from cbatch.ops import compiled, cpu
from cbatch.ops import quantized
from tests.helpers import CPU_FLAGS as FLAGS, needs_cpu_ext

pytestmark = needs_cpu_ext

HAS_AVX512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= FLAGS
HAS_AVX2 = {"avx2", "fma", "f16c"} <= FLAGS
needs_avx2 = pytest.mark.skipif(not HAS_AVX2, reason="no AVX2, FMA and F16C here")


@pytest.fixture(autouse=True)
def cpu_options():
    """Every test starts from the CPU's own paths and leaves the options as the extension's
    loader set them (cbatch/ops/compiled.py)."""
    torch.ops.cbatch.set_cpu_options("", "")
    yield
    torch.ops.cbatch.set_cpu_options(*compiled._cpu_options())


def _counts() -> dict[str, int]:
    return dict(zip(torch.ops.cbatch.cpu_path_names(), torch.ops.cbatch.cpu_path_counts()))


def _ran(fn) -> dict[str, int]:
    """The counters that fn's calls moved, and by how much."""
    before = _counts()
    fn()
    after = _counts()
    return {name: after[name] - before[name] for name in after if after[name] != before[name]}


def _isa() -> set[str]:
    return set(torch.ops.cbatch.cpu_isa().split())


def test_cpu_isa_is_what_the_cpu_reports():
    words = torch.ops.cbatch.cpu_isa().split()
    order = ["avx512", "avx512bf16", "avx512vnni", "avx2"]
    assert words == [w for w in order if w in words]
    if not FLAGS:
        return  # not Linux on x86: nothing to compare with
    assert ("avx512" in words) == HAS_AVX512
    assert ("avx512bf16" in words) == (HAS_AVX512 and "avx512_bf16" in FLAGS)
    assert ("avx512vnni" in words) == (HAS_AVX512 and "avx512_vnni" in FLAGS)
    assert ("avx2" in words) == HAS_AVX2


def test_quantized_kernels_run_wherever_their_isa_is():
    """The quantized linears' tests skip where the kernels do not run; here a CPU with AVX2
    and FMA that reports them unavailable fails instead, and each names its widest path."""
    if not {"avx2", "fma"} <= FLAGS:
        assert not quantized.available("w8a16")
        return
    assert quantized.available("w8a16") and quantized.available("w4a8")
    int8_isa = "avx512vnni" if HAS_AVX512 and "avx512_vnni" in FLAGS else "avx2"
    assert quantized.isa("w8a16") == ("avx512" if HAS_AVX512 else "avx2")
    assert quantized.isa("w8a8") == quantized.isa("w4a8") == quantized.isa("w8a8g") == int8_isa
    assert quantized.available("w8a8g")


def test_path_names_and_counts():
    names, counts = torch.ops.cbatch.cpu_path_names(), torch.ops.cbatch.cpu_path_counts()
    assert len(names) == len(set(names)) == len(counts)
    assert all(count >= 0 for count in counts)
    assert {"linear.avx512", "linear.avx2", "linear.amx", "linear.bf16.avx2",
            "quantized_linear.w8.avx512",
            "quantized_linear.w8.avx2", "quantized_linear.w4.avx512",
            "quantized_linear.w4.avx2", "quantized_linear.w4.avx512bf16",
            "quantized_linear.w8a8.avx512vnni",
            "quantized_linear.w8a8.avx2", "quantized_linear.w8a8.amx",
            "quantized_linear.w4a8.avx512vnni",
            "quantized_linear.w4a8.avx2", "quantized_linear.w4a8.amx",
            "quantized_linear.w8a8g.avx2", "quantized_linear.w8a8g.avx512vnni",
            "greedy_head.int8.avx512vnni",
            "greedy_head.int8.avx2", "greedy_head.bf16.avx512",
            "greedy_head.bf16.avx2", "greedy_head.kernel", "greedy_head.unsettled_rows",
            "decode_attention.avx512", "decode_attention.avx512bf16",
            "decode_attention.avx2", "decode_attention.generic", "prefill_attention.avx512",
            "prefill_attention.avx512bf16", "prefill_attention.avx2",
            "prefill_attention.generic", "prefill_attention.transposed_rows", "argmax.avx512",
            "argmax.generic", "sample.avx512", "sample.avx2", "sample.generic",
            "penalties.cpu", "bitmask.cpu", "write_kv_cache.cpu", "rms_norm.avx2",
            "rms_norm.generic", "fused_add_rms_norm.avx2", "fused_add_rms_norm.generic",
            "silu_and_mul.avx2", "silu_and_mul.generic", "rotary_embedding.avx2",
            "rotary_embedding.generic", "decoder_layers.cpu", "gguf_unpack.cpu",
            "quantized_pack.cpu"} == set(names)


@pytest.mark.parametrize("isa, attention, amx", [("avx512", "", ""), ("", "fast", ""),
                                                 ("AVX2", "", ""), ("", "Generic", ""),
                                                 ("", "", "on"), ("", "", "Model")])
def test_set_cpu_options_rejects_other_values(isa, attention, amx):
    before = torch.ops.cbatch.cpu_isa()
    with pytest.raises(ValueError, match=f'"{isa or attention or amx}"'):
        torch.ops.cbatch.set_cpu_options(isa, attention, amx)
    assert torch.ops.cbatch.cpu_isa() == before  # nothing changed


@pytest.mark.skipif(not HAS_AVX512 or "avx512_vnni" not in FLAGS, reason="no AVX512-VNNI")
def test_set_cpu_options_amx_turns_w8a8s_tiles_on_the_model_and_off():
    """amx="model": W8A8 calls of 8 rows take the tiles (amx_tile_ops.h's model of them here),
    cpu_isa says amx-int8; "off": VNNI; the ISA cap turns them off too (no AVX512-VNNI)."""
    from cbatch.layers.quantization.weight import pack, pack_w8a8
    q = pack(torch.randint(-128, 128, (16, 64)), torch.ones(1, 16), None, 8, 64)
    w, x = pack_w8a8(q), torch.randn(8, 64)

    def w8a8():
        return _ran(lambda: torch.ops.cbatch.quantized_linear_w8a8(x, w, q.scales, 16, None))
    torch.ops.cbatch.set_cpu_options("", "", "model")
    assert "amx-int8" in torch.ops.cbatch.cpu_isa().split()
    assert w8a8() == {"quantized_linear.w8a8.amx": 1}
    torch.ops.cbatch.set_cpu_options("", "", "off")
    assert "amx-int8" not in torch.ops.cbatch.cpu_isa().split()
    assert w8a8() == {"quantized_linear.w8a8.avx512vnni": 1}
    torch.ops.cbatch.set_cpu_options("avx2", "", "model")
    assert torch.ops.cbatch.cpu_isa() == "avx2"
    assert w8a8() == {"quantized_linear.w8a8.avx2": 1}


def _linear(dtype, M=3, N=40, K=32):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=gen).to(dtype)
    x, bias = torch.randn(M, K, generator=gen).to(dtype), torch.randn(N, generator=gen).to(dtype)
    packed = cpu.pack(w, "cbatch")

    def call():
        y = torch.ops.cbatch.linear(x, packed, N, bias, None, "none")
        torch.testing.assert_close(y, torch.nn.functional.linear(x, w, bias),
                                   **({} if dtype == torch.float32 else
                                      {"atol": 0.1, "rtol": 0.02}))
    return call


@needs_avx2
def test_linear_runs_the_widest_tile():
    want = "linear.avx512" if HAS_AVX512 else "linear.avx2"
    assert _ran(_linear(torch.float32)) == {want: 1}
    # bf16: vdpbf16ps with AVX512-BF16, the AVX2 tile (bf16 widened in registers) without
    # AVX-512; an AVX-512 CPU without AVX512-BF16 runs no bf16 here
    if "avx512bf16" in _isa() or not HAS_AVX512:
        want = "linear.avx512" if "avx512bf16" in _isa() else "linear.bf16.avx2"
        assert _ran(_linear(torch.bfloat16)) == {want: 1}
    else:
        assert not torch.ops.cbatch.cpu_linear_supported(torch.bfloat16)


@needs_avx2
def test_set_cpu_options_avx2_switches_linear_to_its_avx2_tile():
    torch.ops.cbatch.set_cpu_options("avx2", "")
    assert torch.ops.cbatch.cpu_isa() == "avx2"
    assert torch.ops.cbatch.cpu_linear_supported(torch.float32)
    assert torch.ops.cbatch.cpu_linear_supported(torch.bfloat16)
    assert torch.ops.cbatch.greedy_head_supported(torch.bfloat16)  # as bf16's linear
    assert _ran(_linear(torch.float32)) == {"linear.avx2": 1}
    assert _ran(_linear(torch.bfloat16)) == {"linear.bf16.avx2": 1}
    torch.ops.cbatch.set_cpu_options("", "")  # and back, on the next call
    if HAS_AVX512:
        assert _ran(_linear(torch.float32)) == {"linear.avx512": 1}


def _greedy(dtype, int8, M):
    gen = torch.Generator().manual_seed(1)
    N, K = 300, 64
    w = (torch.randn(N, K, generator=gen) * 0.05).to(dtype)
    x = torch.randn(M, K, generator=gen).to(dtype)
    packed, screen = cpu.pack(w, "cbatch"), cpu.pack_screen(w, int8)

    def call():
        got = torch.ops.cbatch.greedy_head(x, packed, screen.weight, N, screen.w_norm,
                                           screen.screen_norm, screen.error_norm, screen.scales)
        logits = torch.ops.cbatch.linear(x, packed, N, None, None, "none")
        assert torch.equal(got, logits.argmax(dim=-1))
    return call


def _without_linear(ran: dict[str, int]) -> dict[str, int]:
    """What greedy_head ran, without the linear call that checks its answer."""
    return {name: n for name, n in ran.items() if not name.startswith("linear.")}


@needs_avx2
def test_greedy_head_bf16_screen():
    want = "greedy_head.bf16.avx512" if "avx512bf16" in _isa() else "greedy_head.bf16.avx2"
    assert _without_linear(_ran(_greedy(torch.float32, False, 4))) == {want: 1}
    torch.ops.cbatch.set_cpu_options("avx2", "")
    assert _without_linear(_ran(_greedy(torch.float32, False, 4))) == \
        {"greedy_head.bf16.avx2": 1}


@needs_avx2
def test_greedy_head_int8_screens_and_the_kernel_from_16_bf16_rows():
    """The int8 screens run vpdpwssd's tile where the CPU has AVX512-VNNI (and AVX512-BF16),
    else AVX2's vpmaddwd one, as under the avx2 cap; a bf16 lm_head's wherever its linear runs
    on cbatch's kernel, and from 16 rows, compute-bound, the kernel runs every row."""
    vnni = {"avx512bf16", "avx512vnni"} <= _isa()
    want = {"greedy_head.int8.avx512vnni" if vnni else "greedy_head.int8.avx2": 1}
    for M in (1, 4, 17):  # one tile, a tile and part of one, packed rows
        assert _without_linear(_ran(_greedy(torch.float32, True, M))) == want
    if torch.ops.cbatch.greedy_head_supported(torch.bfloat16):
        assert _without_linear(_ran(_greedy(torch.bfloat16, True, 4))) == want
        assert _without_linear(_ran(_greedy(torch.bfloat16, True, 16))) == \
            {"greedy_head.kernel": 1}
    torch.ops.cbatch.set_cpu_options("avx2", "")
    for dtype in (torch.float32, torch.bfloat16):
        assert _without_linear(_ran(_greedy(dtype, True, 4))) == {"greedy_head.int8.avx2": 1}
    assert _without_linear(_ran(_greedy(torch.bfloat16, True, 16))) == \
        {"greedy_head.kernel": 1}


def test_argmax_paths():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 1000, generator=gen)
    wide = "argmax.avx512" if "avx512" in _isa() else "argmax.generic"
    for dtype, path in ((torch.float32, wide), (torch.bfloat16, wide),
                        (torch.float16, "argmax.generic")):
        x = logits.to(dtype)

        def call(x=x):
            assert torch.equal(torch.ops.cbatch.argmax(x), x.argmax(dim=-1))
        assert _ran(call) == {path: 1}
    if HAS_AVX512:
        torch.ops.cbatch.set_cpu_options("avx2", "")
        assert _ran(lambda: torch.ops.cbatch.argmax(logits)) == {"argmax.generic": 1}


def test_write_kv_cache_path():
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    key_cache, value_cache = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
    slots = torch.tensor([0, 5, -1])
    assert _ran(lambda: ops.write_kv_cache(key, value, key_cache, value_cache, slots,
                                           backend="cpu")) == {"write_kv_cache.cpu": 1}
    assert torch.equal(key_cache.view(16, 2, 8)[5], key[1])
