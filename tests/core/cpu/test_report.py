"""What cbatch says about the CPU fast paths: `cbatch --version` (the machine's), a CPU
runner's describe() (its engine's), and the kernels' own path counters (what ran)."""

import subprocess
import sys

import pytest
import torch

from cbatch import LLM, SamplingParams
from cbatch.core.cpu.model_runner import CPUModelRunner
from cbatch.core.cpu.report import cpu_paths
from cbatch.core.worker import model_runner_class
from cbatch.core.model_runner import ModelRunner
from cbatch.ops import backends, compiled, cpu
from cbatch.ops import quantized
from tests.helpers import needs_cpu_ext



def test_the_runner_is_chosen_by_device():
    assert model_runner_class("cpu") is CPUModelRunner
    assert model_runner_class("cuda:0") is ModelRunner


def test_version_lists_the_cpu_fast_paths():
    out = subprocess.run([sys.executable, "-m", "cbatch", "--version"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    section = out.stdout.split("cpu fast paths:\n", 1)[1].splitlines()
    names = [line.split("  ")[1].strip() for line in section]
    assert names == ["isa", "attention", "linear", "greedy screen", "quantized linear",
                     "loading", "decoder layers", "huge pages", "threads"]
    loading = section[names.index("loading")]
    assert ("cbatch's C++" in loading) == ("cpu" in compiled.compiled_backends())
    assert f"float32 {cpu.cpu_linear_route(torch.float32)}" in out.stdout
    line = section[names.index("quantized linear")]
    tiles = "; AMX-INT8 tiles from 8 rows" if quantized.amx_int8_tiles() else ""
    if quantized.available("w8a16"):  # each quantized kernel, by name and path
        assert f"int8, int4: cbatch's kernel ({quantized.isa('w8a16')})" in line
        assert f"w8a8: cbatch's kernel ({quantized.isa('w8a8')}{tiles})" in line
        assert f"w4a8: cbatch's kernel ({quantized.isa('w4a8')}{tiles})" in line
    else:
        assert "int8, int4, w8a8, w4a8: the pure-torch reference" in line
    if backends.triton_available():  # the Triton row names its quantized GEMMs
        assert "quantized GEMMs (W8A16, W4A16, W8A8) on CUDA" in out.stdout


@pytest.mark.skipif(quantized.isa("w8a8") != "avx512vnni", reason="no AVX512-VNNI")
def test_the_report_says_where_the_int8_kernels_take_amx_tiles():
    """The quantized linears' line names AMX-INT8 tiles while they run (here on their model)
    and not once set_cpu_options turns them off."""
    try:
        torch.ops.cbatch.set_cpu_options(*compiled._cpu_options(), "model")
        on = cpu_paths()["quantized linear"]
        torch.ops.cbatch.set_cpu_options(*compiled._cpu_options(), "off")
        off = cpu_paths()["quantized linear"]
    finally:
        torch.ops.cbatch.set_cpu_options(*compiled._cpu_options())
    for kernel in ("w8a8", "w4a8"):
        assert f"{kernel}: cbatch's kernel (avx512vnni; AMX-INT8 tiles from 8 rows)" in on
        assert f"{kernel}: cbatch's kernel (avx512vnni)" in off


def test_switches_show_in_the_report(monkeypatch):
    monkeypatch.setenv("CBATCH_GREEDY_SCREEN", "0")
    monkeypatch.setenv("CBATCH_HUGE_PAGES", "0")
    monkeypatch.setenv("CBATCH_CPU_LINEAR", "torch")
    monkeypatch.setenv("CBATCH_CPU_LAYERS", "0")
    paths = cpu_paths()
    assert paths["decoder layers"] == "op by op: off (CBATCH_CPU_LAYERS=0)"
    assert paths["greedy screen"] == \
        "float32 off (CBATCH_GREEDY_SCREEN=0), bfloat16 off (CBATCH_GREEDY_SCREEN=0)"
    assert paths["huge pages"] == "off (CBATCH_HUGE_PAGES=0)"
    assert paths["linear"] == "float32 torch, bfloat16 torch"


@needs_cpu_ext
def test_an_engine_describes_and_runs_its_paths():
    """The engine's description names the route its weights are packed for, and the kernel
    counters show that route's kernel ran in its steps."""
    llm = LLM("random:tiny", max_num_seqs=4)
    described = llm.engine.runner.describe()
    assert set(described) == {"isa", "attention", "linear", "greedy screen",
                              "quantized linear", "decoder layers", "huge pages", "threads"}
    assert described["quantized linear"] == "none"
    head_dim = llm.engine.model.config.head_dim
    step = cpu.attention_step(head_dim, llm.engine.model.dtype)
    assert described["attention"] == f"{step} (head dim {head_dim})"
    route = cpu.cpu_linear_route(torch.float32)
    assert described["linear"] == (f"{route} (float32, packed weights)" if route != "torch"
                                   else "torch (float32, dense weights)")
    before = cpu.kernel_paths()
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.5,
                                             seed=1), use_tqdm=False)
    ran = {k: n - before.get(k, 0) for k, n in cpu.kernel_paths().items() if n > before.get(k, 0)}
    isa = cpu.cpu_isa().split()
    if route == "cbatch":
        assert ran.get("linear.avx512" if "avx512" in isa else "linear.avx2", 0) > 0, ran
    assert ran.get(f"decode_attention.{step}", 0) > 0, ran
    assert not any(k.startswith("greedy_head.") for k in ran), ran  # sampled: logits


@needs_cpu_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 72, 36])
def test_the_reported_attention_step_is_the_one_that_runs(head_dim, dtype):
    """What cbatch --version and describe() say of attention (cpu.attention_step) is the path
    the kernel's counters see a call take."""
    from cbatch import ops
    from tests.helpers import paged_inputs

    q, kc, vc, tables, _, seq_lens = paged_inputs([5, 17], [1, 1], 2, head_dim, 16,
                                                  dtype, "cpu", head_dim)
    before = cpu.kernel_paths()
    ops.paged_decode_attention(q, kc, vc, tables, seq_lens, backend="cpu")
    after = cpu.kernel_paths()
    ran = [k for k in after if after[k] > before[k]]
    step = cpu.attention_step(head_dim, dtype)
    assert ran == [f"decode_attention.{step}"]
    assert step in cpu_paths()["attention"]
