"""$CBATCH_CPU_ISA=avx2 (handed to torch.ops.cbatch.set_cpu_options when the extension
loads): on a CPU with AVX-512, the CPU kernels take the paths of a CPU without it, so that
those (cbatch's AVX2 linear kernel, the greedy screen's AVX2 twin) are tested here too: this
file runs their test files again in a process with the variable set."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cbatch.ops import compiled
from tests.helpers import CPU_FLAGS as FLAGS

HERE = Path(__file__).parent


pytestmark = [
    pytest.mark.slow,  # each test starts a Python process that imports torch
    pytest.mark.skipif("cpu" not in compiled.compiled_backends(),
                       reason="cbatch's C++ CPU kernels are not built"),
    pytest.mark.skipif(not {"avx512f", "avx2", "fma"} <= FLAGS,
                       reason="the AVX2 paths run in the main suite here (no AVX-512)"),
]


def _run(code_or_args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "CBATCH_CPU_ISA": "avx2"}
    return subprocess.run([sys.executable, *code_or_args], env=env, capture_output=True,
                          text=True, timeout=600, cwd=HERE.parents[1])


def test_the_variable_caps_the_kernels_at_avx2():
    probe = ("import torch; from cbatch.ops import cpu; "
             "print(torch.ops.cbatch.cpu_linear_supported(torch.float32), "
             "torch.ops.cbatch.cpu_linear_supported(torch.bfloat16), "
             "cpu.screen_available(torch.float32), "
             "cpu.screen_available(torch.bfloat16), torch.ops.cbatch.cpu_isa())")
    out = _run(["-c", probe])
    assert out.returncode == 0, out.stderr
    # fp32 and bf16 linears and their lm_heads' screens, on the AVX2 paths alone
    assert out.stdout.split() == ["True", "True", "True", "True", "avx2"]


def test_linear_and_greedy_screen_tests_pass_on_the_avx2_paths():
    out = _run(["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                str(HERE / "test_cpu_linear.py"), str(HERE / "test_greedy_head.py")])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    summary = out.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary, summary
    skipped_screen = [line for line in out.stdout.splitlines()
                      if line.startswith("SKIPPED") and "test_greedy_head" in line]
    assert not skipped_screen, skipped_screen  # every screen's tests ran on the AVX2 paths
