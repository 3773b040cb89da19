"""cbatch/envs.py is the one list of cbatch's environment variables, and the one reader."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from cbatch import envs

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [p for d in ("cbatch", "kernels", "csrc", "scripts", "benchmarks", ".ci")
           for p in (ROOT / d).rglob("*")
           if p.is_file() and p.suffix in (".py", ".cpp", ".h", ".cu", ".sh", "")
           and "__pycache__" not in p.parts] + [ROOT / "setup.py"]
# C/C++ macros that share the prefix: compile-time names (#define, or setup.py's -D), not
# the environment's
MACROS = {name for p in SOURCES
          for name in re.findall(r"(?:#define\s+|-D)(CBATCH_[A-Z0-9_]+)", p.read_text())}


def test_no_python_file_but_envs_reads_a_cbatch_variable():
    reads = re.compile(r"(environ|getenv)\b[^\n]*CBATCH_")
    offenders = [str(p.relative_to(ROOT)) for p in SOURCES
                 if p.suffix == ".py" and p.name != "envs.py"
                 and p.relative_to(ROOT) != Path("setup.py") and reads.search(p.read_text())]
    assert offenders == []


def test_the_kernels_read_no_environment():
    offenders = [str(p.relative_to(ROOT)) for p in SOURCES if p.suffix in (".cpp", ".h", ".cu")
                 and "getenv" in p.read_text()]
    assert offenders == []


def test_every_cbatch_name_in_the_code_is_listed():
    declared = {v.name for v in envs.VARIABLES}
    named = set()
    for path in SOURCES:
        if path.name == "envs.py":
            continue
        for name in re.findall(r"\bCBATCH_[A-Z0-9_]+", path.read_text(errors="replace")):
            named.add(name)
    assert named - MACROS - declared == set()
    assert declared <= named  # every variable listed is used somewhere


def test_values_are_checked_by_name(monkeypatch):
    monkeypatch.setenv("CBATCH_CPU_LINEAR", "mkl")
    with pytest.raises(ValueError, match="CBATCH_CPU_LINEAR='mkl'.*cbatch, onednn, torch"):
        envs.CBATCH_CPU_LINEAR
    monkeypatch.setenv("CBATCH_HUGE_PAGES", "maybe")
    with pytest.raises(ValueError, match="CBATCH_HUGE_PAGES='maybe': expected 1 or 0"):
        envs.CBATCH_HUGE_PAGES
    monkeypatch.setenv("CBATCH_HUGE_PAGES", "0")
    assert envs.CBATCH_HUGE_PAGES is False
    monkeypatch.delenv("CBATCH_HUGE_PAGES")
    assert envs.CBATCH_HUGE_PAGES is True
    with pytest.raises(AttributeError):
        envs.CBATCH_NOT_A_VARIABLE


def test_readme_table_is_generated_from_envs():
    readme = (ROOT / "README.md").read_text()
    assert envs.markdown_table() in readme, "regenerate it: python -m cbatch.envs"


def test_module_entry_point_checks_values():
    run = subprocess.run([sys.executable, "-m", "cbatch.envs", "--check"], capture_output=True,
                         text=True, env={"CBATCH_CPU_ISA": "avx3", "PATH": "/usr/bin"})
    assert run.returncode == 1 and "CBATCH_CPU_ISA='avx3'" in run.stdout
