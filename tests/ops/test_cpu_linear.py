"""CPU linear layers on packed weights (cbatch.ops.cpu: cbatch's own kernel and
oneDNN), and dtype="auto"."""

import copy

import pytest
import torch
import torch.nn.functional as F

from cbatch import LLM, Engine, KVCache, SamplingParams
from cbatch.config import EngineConfig
from cbatch.devices import auto_dtype
from cbatch.core.input_batch import make_step_batch
from cbatch import envs
from cbatch.ops import compiled, cpu
from cbatch.core.cpu.packing import pack_linears, unpack_linears
from cbatch.layers.linear import Linear
from cbatch.models.loader import load_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

PACKED_ROUTES = ("cbatch", "onednn")
needs_packing = pytest.mark.skipif(
    cpu.cpu_linear_route(torch.float32) == "torch",
    reason="this CPU runs F.linear (packed routes are chosen on x86 CPUs with AVX2 or AVX-512)")
needs_bf16 = pytest.mark.skipif(
    cpu.cpu_linear_route(torch.bfloat16) == "torch",
    reason="this CPU has no packed bf16 route (cbatch's kernel needs AVX2 and FMA)")

# (dtype, error allowed beyond twice F.linear's own, relative to the largest output)
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1e-2}
CASES = [pytest.param(route, dtype, id=f"{route}-{str(dtype)[6:]}",
                      marks=pytest.mark.skipif(not cpu.route_available(route, dtype),
                                               reason=f"{route} does not run {dtype} here"))
         for route in PACKED_ROUTES for dtype in TOLERANCE]


SHAPES = [(M, N, K) for M in (1, 2, 5, 12, 15, 17, 64)
          for N, K in ((123, 6), (96, 64), (2304, 768), (768, 3072))]
SHAPES += [(1027, N, K) for N, K in ((123, 6), (96, 64))]  # long prefill chunks


@pytest.mark.parametrize("route,dtype", CASES)
@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_matches_f_linear(route, dtype, M, N, K, bias):
    """Against the float64 product: at most twice the error of F.linear in the same dtype
    (another summation order, so a little more; four times for the cbatch route, whose every
    output is one running sum in k order, where MKL and oneDNN add blocked partial sums).
    Row counts below and above the one where the cbatch route hands over to oneDNN; N not a
    multiple of 16; K of one pair."""
    gen = torch.Generator().manual_seed(M * N + K)
    w = (torch.randn(N, K, generator=gen) * 0.05).to(dtype)
    b = (torch.randn(N, generator=gen) * 0.05).to(dtype) if bias else None
    x = torch.randn(M, K, generator=gen).to(dtype)
    truth = F.linear(x.double(), w.double(), None if b is None else b.double())
    packed = cpu.pack(w, route)
    assert torch.equal(cpu.unpack(packed, N), w)
    ours = cpu.packed_linear(x, packed, b, N)
    assert ours.dtype == dtype and ours.shape == (M, N)
    torch_err = (F.linear(x, w, b).double() - truth).abs().max().item()
    allowed = (4 if route == "cbatch" else 2) * torch_err \
        + TOLERANCE[dtype] * truth.abs().max().item()
    assert (ours.double() - truth).abs().max().item() <= allowed


# The AMX tests run on the CPU's tiles where it has them, else on amx_tile_ops.h's software model
# of the tile instructions (set_cpu_options(amx="model")), which checks the kernel's
# addressing, tile shapes and epilogue, not the silicon; either needs AVX512-BF16 (the
# epilogue) and cbatch's bf16 route.
HARDWARE_AMX = cpu.has_amx()
AMX = pytest.mark.skipif(not ("avx512bf16" in cpu.cpu_isa().split()
                              and cpu.route_available("cbatch", torch.bfloat16)),
                         reason="needs AVX512-BF16 and cbatch's bf16 route")


@pytest.fixture
def amx_tiles():
    torch.ops.cbatch.set_cpu_options(*compiled._cpu_options(), "" if HARDWARE_AMX else "model")
    yield
    torch.ops.cbatch.set_cpu_options(*compiled._cpu_options())


def _amx_runs() -> int:
    return cpu.kernel_paths().get("linear.amx", 0)


@AMX
# (200 rows of K = 3072 are two of amx_bf16_linear.h's chunks of rows: 160 and 40)
@pytest.mark.parametrize("M", [8, 9, 16, 31, 33, 64, 100, 200])
@pytest.mark.parametrize("N,K", [(40, 64), (33, 96), (40, 3072), (768, 3072), (2304, 768)])
@pytest.mark.parametrize("epilogue", ["none", "gelu", "residual"])
def test_amx_tiles_match_the_float64_product(M, N, K, epilogue, amx_tiles):
    """bf16 rows from 8 on AMX tiles (csrc/cpu/amx_bf16_linear.h), the packed layout read as it is:
    within the error the AVX-512 tiles make (another order of the same pairs), bias, GELU and
    residual included; rows and columns that do not fill a tile; the path counted.  (The
    model, a scalar loop, takes the shapes up to 40 x 3072.)"""
    if not HARDWARE_AMX and N * K > 40 * 3072:
        pytest.skip("a model-sized shape runs on AMX hardware only")
    gen = torch.Generator().manual_seed(M * N + K)
    w = (torch.randn(N, K, generator=gen) * 0.05).bfloat16()
    b = (torch.randn(N, generator=gen) * 0.05).bfloat16()
    x = torch.randn(M, K, generator=gen).bfloat16()
    res = torch.randn(M, N, generator=gen).bfloat16() if epilogue == "residual" else None
    gelu = "tanh" if epilogue == "gelu" else None
    packed = cpu.pack(w, "cbatch")
    before = _amx_runs()
    ours = cpu.packed_linear(x, packed, b, N, gelu, res, amx=True)
    assert _amx_runs() == before + 1
    tiles = cpu.packed_linear(x, packed, b, N, gelu, res)  # the AVX-512 tiles
    assert _amx_runs() == before + 1
    truth = F.linear(x.double(), w.double(), b.double())
    if gelu:
        truth = F.gelu(truth, approximate="tanh")
    if res is not None:
        truth = truth + res.double()
    err = (tiles.double() - truth).abs().max().item()
    assert (ours.double() - truth).abs().max().item() <= 2 * err + 1e-2 * truth.abs().max()


@AMX
def test_amx_waits_for_enough_rows_and_whole_tiles_of_k(amx_tiles):
    """Below 8 rows, or with K not a multiple of 32, the AVX-512 tiles run (bit for bit the
    same as without amx)."""
    gen = torch.Generator().manual_seed(0)
    for M, K in ((7, 64), (16, 48)):
        w = torch.randn(40, K, generator=gen).bfloat16()
        x = torch.randn(M, K, generator=gen).bfloat16()
        packed = cpu.pack(w, "cbatch")
        before = _amx_runs()
        assert torch.equal(cpu.packed_linear(x, packed, None, 40, amx=True),
                           cpu.packed_linear(x, packed, None, 40))
        assert _amx_runs() == before


@AMX
def test_engines_run_amx_unless_batch_invariant(amx_tiles):
    """A bf16 engine's steps of 8 rows and more take the AMX tiles (its linears and the
    lm_head's greedy rows from 16); a batch-invariant one never does, so a row's tokens
    cannot depend on its batch-mates."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompts = [[i + 1, 2, 3] for i in range(16)]
    for invariant in (False, True):
        llm = LLM("random:tiny", dtype="bfloat16", max_num_seqs=16, batch_invariant=invariant)
        before = _amx_runs()
        llm.generate(prompts, params, use_tqdm=False)
        assert (_amx_runs() > before) == (not invariant)


@pytest.mark.parametrize("route,dtype", CASES)
@pytest.mark.parametrize("M", [7, 9, 10, 11, 40])
def test_fused_epilogues(route, dtype, M):
    """GELU (tanh and exact) and a residual add inside the matmul, against the unfused ops."""
    gen = torch.Generator().manual_seed(M)
    w = (torch.randn(100, 64, generator=gen) * 0.1).to(dtype)
    b = (torch.randn(100, generator=gen) * 0.1).to(dtype)
    x = torch.randn(M, 64, generator=gen).to(dtype)
    residual = torch.randn(M, 100, generator=gen).to(dtype)
    packed = cpu.pack(w, route)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for approximate in ("tanh", "none"):
        want = F.gelu(F.linear(x.float(), w.float(), b.float()), approximate=approximate)
        got = cpu.packed_linear(x, packed, b, 100, gelu=approximate)
        torch.testing.assert_close(got.float(), want, **tol)
    want = residual.float() + F.linear(x.float(), w.float(), b.float())
    got = cpu.packed_linear(x, packed, b, 100, residual=residual)
    torch.testing.assert_close(got.float(), want, **tol)


@pytest.mark.skipif(not cpu.route_available("cbatch", torch.float32),
                    reason="cbatch's CPU linear needs AVX-512 or AVX2 and the extension")
def test_cbatch_route_rows_are_independent_of_the_batch():
    """Each output element is one thread's sum over k in order: a row's result is bitwise
    the same whatever other rows share the call, and whatever the thread count (K = 3072,
    where oneDNN's rows differ with M; as many rows as a long prefill chunk)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 3072, generator=gen)
    x = torch.randn(1054, 3072, generator=gen)
    packed = cpu.pack(w, "cbatch")
    full = cpu.packed_linear(x, packed, None, 300)
    before = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            for rows in (slice(0, 1), slice(5, 13), slice(3, 70)):
                assert torch.equal(cpu.packed_linear(x[rows], packed, None, 300), full[rows])
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not cpu.route_available("cbatch", torch.float32),
                    reason="cbatch's CPU linear needs AVX-512 or AVX2 and the extension")
def test_cbatch_route_rejects_bad_arguments():
    packed = cpu.pack(torch.randn(40, 8), "cbatch")
    with pytest.raises(ValueError, match="does not hold"):
        torch.ops.cbatch.linear(torch.randn(2, 9), packed, 40, None, None, "none")
    with pytest.raises(TypeError, match="packed weight"):
        torch.ops.cbatch.linear(torch.randn(2, 8, dtype=torch.float64), packed, 40, None, None,
                                "none")
    with pytest.raises(ValueError, match="bias must be"):
        torch.ops.cbatch.linear(torch.randn(2, 8), packed, 40, torch.randn(39), None, "none")
    with pytest.raises(ValueError, match="activation"):
        torch.ops.cbatch.linear(torch.randn(2, 8), packed, 40, None, None, "relu")
    assert torch.ops.cbatch.linear(torch.randn(0, 8), packed, 40, None, None,
                                   "none").shape == (0, 40)


@needs_packing
@pytest.mark.parametrize("route", PACKED_ROUTES)
def test_packing_replaces_the_weights_and_keeps_the_checkpoint(route, monkeypatch):
    """Packed weights take the dense weights' place, the tied lm_head's too: the embedding
    gathers its rows from the packed weight (cbatch's layout; oneDNN's keeps the dense weight
    and a packed copy); state_dict and unpacking give the dense weights back bitwise, and
    unpacking ties the two modules to one dense weight again."""
    if not cpu.route_available(route, torch.float32):
        pytest.skip(f"{route} does not run float32 here")
    monkeypatch.setenv("CBATCH_CPU_LINEAR", route)
    model = load_model("random:tiny")
    wte = model.transformer.wte
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([0, 511, 17, 17, 256])
    rows = wte(ids)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert pack_linears(model)
    assert pack_linears(model)  # idempotent
    c_fc = model.transformer.h[0].mlp.c_fc
    assert cpu.is_packed(c_fc.weight) and c_fc.packed_weight is not None
    assert model.lm_head.weight is wte.weight
    assert cpu.is_packed(model.lm_head.packed_weight)
    if route == "cbatch":  # one weight for both, in the packed layout
        assert cpu.is_packed(wte.weight) and model.lm_head.packed_weight.data_ptr() == \
            wte.weight.data_ptr()
    else:
        assert not cpu.is_packed(wte.weight)
    assert torch.equal(wte(ids), rows)
    # the same bytes (the cbatch layout pads N to a multiple of 16: GPT-2's are multiples)
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == nbytes
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    unpack_linears(model)
    assert not any(isinstance(m, Linear) and (cpu.is_packed(m.weight)
                                              or m.packed_weight is not None)
                   for m in model.modules())
    assert model.lm_head.weight is wte.weight and not cpu.is_packed(wte.weight)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 100])
def test_packed_rows_are_the_dense_rows(dtype, n):
    """cpu.packed_rows (a tied embedding's lookup) gives pack's input rows back bitwise, in
    the ids' order, repeats and the last (padded) block included."""
    K = 6
    w = (torch.randn(n, K) * 50).to(dtype)
    ids = torch.cat([torch.tensor([n - 1, 0, n - 1]), torch.randint(0, n, (40,))])
    got = cpu.packed_rows(cpu.pack(w, "cbatch"), ids)
    assert got.dtype == dtype and got.is_contiguous() and torch.equal(got, w[ids])
    assert cpu.packed_rows(cpu.pack(w, "cbatch"), ids[:0]).shape == (0, K)


@needs_packing
def test_engine_packs_on_the_cpu_and_batch_invariant_mode_keeps_only_the_cbatch_route(
        monkeypatch):
    """A batch-invariant engine keeps weights packed for cbatch's kernel (rows independent of
    M) and gives oneDNN's packed weights back as dense ones (its rows are not)."""
    c_attn = lambda m: m.transformer.h[1].attn.c_attn  # noqa: E731
    for route in PACKED_ROUTES:
        if not cpu.route_available(route, torch.float32):
            continue
        monkeypatch.setenv("CBATCH_CPU_LINEAR", route)
        model = load_model("random:tiny")
        Engine(model, max_num_seqs=2)
        assert cpu.is_packed(c_attn(model).weight)
        assert model.lm_head.packed_weight.is_mkldnn == (route == "onednn")  # as every layer
        Engine(model, max_num_seqs=2, batch_invariant=True)
        assert cpu.is_packed(c_attn(model).weight) == (route == "cbatch")
        assert (c_attn(model).packed_weight is not None) == (route == "cbatch")
        if route == "cbatch":  # every layer on cbatch's kernel, the lm_head too
            assert not model.lm_head.packed_weight.is_mkldnn


def test_route_override(monkeypatch):
    monkeypatch.setenv("CBATCH_CPU_LINEAR", "torch")
    model = load_model("random:tiny")
    Engine(model, max_num_seqs=2)
    assert not cpu.is_packed(model.transformer.h[0].attn.c_attn.weight)
    monkeypatch.setenv("CBATCH_CPU_LINEAR", "mkl")  # not a route: warned about, then the default
    monkeypatch.setattr(envs, "_warned", set())
    with pytest.warns(RuntimeWarning, match="CBATCH_CPU_LINEAR='mkl': expected one of"):
        assert cpu.cpu_linear_route(torch.float32) == next(
            r for r in cpu.ROUTES if cpu.route_available(r, torch.float32))


def _step_logits(model, prompts, block_size=4):
    """All-token logits of one prefill step, then the last-token logits of one decode step
    of token 7 per prompt."""
    lens = [len(p) + 1 for p in prompts]
    num_blocks = sum(-(-n // block_size) for n in lens)
    cache = KVCache(model.config, num_blocks, block_size, dtype=model.dtype)
    tables, start = [], 0
    for n in lens:
        tables.append(list(range(start, start + -(-n // block_size))))
        start += len(tables[-1])
    with torch.no_grad():
        batch = make_step_batch(prompts, [0] * len(prompts), tables, block_size)
        prefill = model.compute_logits(model(batch, cache))
        batch = make_step_batch([[7]] * len(prompts), [len(p) for p in prompts], tables,
                                block_size)
        decode = model.compute_logits(model(batch, cache)[batch.logits_indices])
    return prefill.float(), decode.float()


@pytest.mark.parametrize("route", [pytest.param(r, marks=pytest.mark.skipif(
    not cpu.route_available(r, torch.float32), reason=f"no {r} route here"))
    for r in PACKED_ROUTES])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=needs_packing),
                                   pytest.param(torch.bfloat16, marks=needs_bf16)])
def test_packed_model_matches_transformers(tiny_hf_dir, tiny_hf_model, dtype, route,
                                           monkeypatch):
    """Prefill and decode logits of the packed model against transformers' GPT2LMHeadModel:
    fp32 within 1e-4 (as the unpacked model); bf16 against transformers in fp32, with an
    error at most twice that of transformers' own model run in bf16 (plus 1e-2)."""
    prompts = [[(5 * i + 3 * j) % 500 for j in range(n)] for i, n in enumerate([1, 3, 4, 9])]
    if not cpu.route_available(route, dtype):
        pytest.skip(f"{route} does not run {dtype} here")
    monkeypatch.setenv("CBATCH_CPU_LINEAR", route)
    model = load_model(str(tiny_hf_dir), dtype=dtype)
    assert pack_linears(model)
    prefill, decode = _step_logits(model, prompts)
    hf_bf16 = copy.deepcopy(tiny_hf_model).to(torch.bfloat16)  # the fixture stays fp32
    with torch.no_grad():
        offset = 0
        for s, p in enumerate(prompts):
            ids = torch.tensor([p + [7]])
            truth = tiny_hf_model(ids).logits[0]
            ours = torch.cat([prefill[offset:offset + len(p)], decode[s:s + 1]])
            offset += len(p)
            if dtype == torch.float32:
                torch.testing.assert_close(ours, truth, atol=1e-4, rtol=1e-4)
            else:
                hf_err = (hf_bf16(ids).logits[0].float() - truth).abs().max().item()
                assert (ours - truth).abs().max().item() <= 2 * hf_err + 1e-2


@needs_bf16
@pytest.mark.real_auto_dtype  # "auto" is bf16 here where the CPU computes in it natively
def test_bf16_engine_greedy_tokens_match_transformers_bf16(tiny_hf_dir, tiny_hf_model):
    """A bf16 engine (dtype="auto" where the CPU has native bf16, else asked for): its
    greedy tokens agree with transformers' bf16 model on most steps (bf16 ties may flip a
    token; then the continuations part)."""
    prompt = [(5 * i + 3) % 500 for i in range(20)]
    llm = LLM(str(tiny_hf_dir), dtype="auto" if auto_dtype("cpu") == "bfloat16" else "bfloat16")
    assert llm.engine.config.dtype == "bfloat16" and llm.engine.model.dtype == torch.bfloat16
    route = cpu.cpu_linear_route(torch.bfloat16)
    assert llm.engine.runner.describe()["linear"].startswith(route)
    before = cpu.kernel_paths()
    out = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    ran = {k: n - before[k] for k, n in cpu.kernel_paths().items() if n > before[k]}
    if route == "cbatch":  # the bf16 tiles ran, and the screen took the greedy steps
        tiles = "linear.avx512" if "avx512bf16" in cpu.cpu_isa() else "linear.bf16.avx2"
        assert ran.get(tiles, 0) > 0, ran
        if cpu.screen_kind(torch.bfloat16) == "int8":  # vpdpwssd's tile, or vpmaddwd's
            int8 = "avx512vnni" if "avx512vnni" in cpu.cpu_isa() else "avx2"
            assert ran.get(f"greedy_head.int8.{int8}", 0) >= 7, ran
    hf_bf16 = copy.deepcopy(tiny_hf_model).to(torch.bfloat16)  # the fixture stays fp32
    with torch.no_grad():
        ids = hf_bf16.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                               eos_token_id=None, pad_token_id=511)[0, len(prompt):].tolist()
    assert out.token_ids[:4] == ids[:4]


@pytest.mark.real_auto_dtype
def test_auto_dtype():
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert auto_dtype("cpu") == ("bfloat16" if native else "float32")
    assert EngineConfig(dtype="auto").dtype == auto_dtype("cpu")
    # one default for LLM, Engine and the CLI: auto
    from cbatch.entrypoints.cli.engine_args import model_parser

    assert EngineConfig().dtype == auto_dtype("cpu")
    assert model_parser().parse_args([]).dtype == "auto"
    if torch.cuda.is_available():
        assert auto_dtype("cuda") == "float16"
