"""The Llama layers' small CPU ops (csrc/cpu/layernorm.cpp, activation.cpp, pos_encoding.cpp)
against independent references: transformers' LlamaRMSNorm and apply_rotary_pos_emb, torch's
F.silu, and float64 maths.  Bit for bit where the kernels round as the formulas do; where they
sum or exponentiate differently, within the bound their docstrings state.  Each test asserts
the kernel's path counter moved."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from cbatch.ops import cpu, layer_ops
from tests.helpers import CPU_FLAGS, needs_cpu_ext

pytestmark = [needs_cpu_ext, pytest.mark.skipif(not layer_ops.kernels_available(),
                                                reason="the extension lacks these ops")]

PATH = "avx2" if {"avx2", "fma", "f16c"} <= CPU_FLAGS else "generic"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROWS = [1, 7, 300]
HIDDEN = [1, 5, 123, 960]


def _moved(op: str, fn):
    before = cpu.kernel_paths()
    out = fn()
    after = cpu.kernel_paths()
    moved = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    assert moved == {f"{op}.{PATH}": 1}, moved
    return out


def _hf_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = LlamaRMSNorm(x.shape[-1], eps).to(weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm(x)


def _exact_inputs(shape, dtype, gen):
    # multiples of 1/8 in [-2, 2]: every sum of their squares is exact in fp32, in any order,
    # so the kernel must match the formula bit for bit
    return (torch.randint(-16, 17, shape, generator=gen) / 8).to(dtype)


def _ulps(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """|a - b| in units of the last place of dtype (b's) at b (at least its smallest normal)."""
    finfo = torch.finfo(dtype or b.dtype)
    scale = (b.double().abs() * finfo.eps).clamp_min(finfo.tiny)
    return (a.double() - b.double()).abs() / scale


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_rms_norm_is_transformers_bit_for_bit_on_exact_sums(dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows * 1000 + hidden)
    x = _exact_inputs((rows, hidden), dtype, gen)
    x[0] = 0  # a zero row: eps alone
    weight = torch.randn(hidden, generator=gen).to(dtype)
    out = torch.full_like(x, float("nan"))  # poisoned
    _moved("rms_norm", lambda: torch.ops.cbatch.rms_norm(out, x, weight, 1e-5))
    assert torch.equal(out, _hf_norm(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [5, 123, 960])
def test_rms_norm_random_rows_within_the_sum_order_bound(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(300, hidden, generator=gen) * 3).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    out = _moved("rms_norm", lambda: layer_ops.rms_norm(x, weight, 1e-6))
    expected = _hf_norm(x, weight, 1e-6)
    # the fp32 sum of squares in another order: its relative error is below n * 2^-24, which
    # moves 1/sqrt by half that; fp32 outputs within a few ulps, bf16/fp16 within one
    ulps = _ulps(out, expected)
    limit = 1 + hidden * 2.0 ** -24 / torch.finfo(dtype).eps if dtype == torch.float32 else 1
    assert ulps.max() <= limit + 2, ulps.max()
    if dtype != torch.float32:
        assert (out == expected).float().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_on_heads_of_a_wider_tensor(dtype):
    # qk_norm's input: q [T, H, D], a view of the fused qkv projection (token stride wider)
    gen = torch.Generator().manual_seed(0)
    qkv = _exact_inputs((9, 3 * 4 * 12), dtype, gen)
    q = qkv[:, :48].view(9, 4, 12)
    weight = torch.randn(12, generator=gen).to(dtype)
    out = _moved("rms_norm", lambda: layer_ops.rms_norm(q, weight, 1e-6))
    assert out.shape == (9, 4, 12) and out.is_contiguous()
    assert torch.equal(out, _hf_norm(q, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_fused_add_rms_norm_in_place(dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows + hidden)
    x = _exact_inputs((rows, hidden), dtype, gen)
    residual = _exact_inputs((rows, hidden), dtype, gen)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    total = x + residual  # torch's add, rounded to dtype
    expected = _hf_norm(total, weight, 1e-6)
    x_ptr, r_ptr = x.data_ptr(), residual.data_ptr()
    got_x, got_residual = _moved("fused_add_rms_norm",
                                 lambda: layer_ops.fused_add_rms_norm(x, residual, weight, 1e-6))
    assert got_x.data_ptr() == x_ptr and got_residual.data_ptr() == r_ptr  # in place
    assert torch.equal(residual, total)
    assert torch.equal(x, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("d", [1, 7, 64, 2560])
def test_silu_and_mul(dtype, rows, d):
    gen = torch.Generator().manual_seed(rows * 7 + d)
    x = (torch.randn(rows, 2 * d, generator=gen) * 4).to(dtype)
    x[0, 0] = -100.0  # e^100 overflows: silu is -0, as torch's
    x[-1, -1] = 90.0
    out = _moved("silu_and_mul", lambda: layer_ops.silu_and_mul(x))
    gate, up = x.chunk(2, dim=-1)
    expected = F.silu(gate) * up  # torch's bf16/fp16 ops round each result, as the kernel
    g, u = gate.double(), up.double()
    exact = g * torch.sigmoid(g) * u
    # fp32: e^-x to within an ulp or two, then a division and a product
    assert torch.equal(out[0, 0], expected[0, 0]) and out[0, 0] == 0
    # against the exact value: fp32's few ulps; bf16/fp16 round twice (silu, the product)
    assert _ulps(out, exact, dtype).max() <= (6 if dtype == torch.float32 else 2)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-30)
    else:  # a different fp32 silu moves a rounding only when it lies at a tie's edge
        assert _ulps(out, expected).max() <= 1
        assert (out == expected).float().mean() > 0.98


def _hf_rotary(q, k, positions, cos_table, sin_table):
    cos = torch.cat((cos_table, cos_table), -1)[positions]  # [T, D]
    sin = torch.cat((sin_table, sin_table), -1)[positions]
    return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)  # q: [T, H, D]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 300])
@pytest.mark.parametrize("head_dim", [2, 6, 64, 80])
def test_rotary_embedding_is_transformers_bit_for_bit(dtype, tokens, head_dim):
    gen = torch.Generator().manual_seed(tokens + head_dim)
    heads, kv_heads, max_pos = 4, 2, 512
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)  # views, as the model's
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    angle = torch.randn(max_pos, head_dim // 2, generator=gen, dtype=torch.float64) * 10
    cos_table, sin_table = angle.cos().to(dtype), angle.sin().to(dtype)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen)
    eq, ek = _hf_rotary(q.clone(), k.clone(), positions, cos_table, sin_table)
    cache = torch.cat((cos_table, sin_table), -1)
    _moved("rotary_embedding",
           lambda: layer_ops.rotary_embedding(positions, q, k, cache))
    assert torch.equal(q, eq) and torch.equal(k, ek)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v untouched


def test_rotary_embedding_refuses_a_position_past_the_table():
    q = torch.zeros(2, 1, 4)
    with pytest.raises(IndexError, match="outside cos_sin_cache"):
        torch.ops.cbatch.rotary_embedding(torch.tensor([0, 9]), q, q.clone(), 4,
                                          torch.zeros(8, 4), True)


def test_mismatched_arguments_get_a_sentence():
    x = torch.zeros(3, 8)
    with pytest.raises(TypeError, match="one dtype"):
        torch.ops.cbatch.rms_norm(torch.empty_like(x), x, torch.ones(8, dtype=torch.bfloat16),
                                  1e-6)
    with pytest.raises(ValueError, match="weight must be a dense"):
        torch.ops.cbatch.fused_add_rms_norm(x, x.clone(), torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match=r"\[\.\., 2d\]"):
        torch.ops.cbatch.silu_and_mul(torch.empty(3, 3), x)


def test_opcheck():
    x, w = torch.randn(4, 16), torch.randn(16)
    torch.library.opcheck(torch.ops.cbatch.rms_norm.default, (torch.empty_like(x), x, w, 1e-6))
    torch.library.opcheck(torch.ops.cbatch.fused_add_rms_norm.default,
                          (x.clone(), x.clone(), w, 1e-6))
    torch.library.opcheck(torch.ops.cbatch.silu_and_mul.default, (torch.empty(4, 8), x))
    q = torch.randn(4, 2, 16)
    torch.library.opcheck(torch.ops.cbatch.rotary_embedding.default,
                          (torch.arange(4), q, q.clone(), 16, torch.randn(8, 16), True))


def test_autograd_and_other_devices_take_the_torch_formula():
    w = torch.ones(8, requires_grad=True)
    x = torch.randn(2, 8)
    assert not layer_ops.runs_kernel(x, w)  # grad enabled, a weight that wants grad
    with torch.no_grad():
        assert layer_ops.runs_kernel(x, w)
    assert not layer_ops.runs_kernel(x.to("meta"))
