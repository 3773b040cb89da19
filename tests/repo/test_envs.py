"""cbatch/envs.py is the one list of cbatch's environment variables, and the one reader."""

import os
import re
import subprocess
import sys
import warnings
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


def test_a_bad_value_is_warned_about_once_and_the_default_used(monkeypatch):
    monkeypatch.setattr(envs, "_warned", set())
    monkeypatch.setenv("CBATCH_CPU_LINEAR", "mkl")
    with pytest.warns(RuntimeWarning, match="CBATCH_CPU_LINEAR='mkl'.*cbatch, onednn, torch"):
        assert envs.CBATCH_CPU_LINEAR == ""
    for raw, want in (("2", True), ("false", False), ("0", False), ("", True), ("On", True)):
        monkeypatch.setenv("CBATCH_HUGE_PAGES", raw)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert envs.CBATCH_HUGE_PAGES is want, raw
    monkeypatch.setenv("CBATCH_LOGGING_LEVEL", "info")  # levels in any case, as vLLM's
    assert envs.CBATCH_LOGGING_LEVEL == "INFO"
    monkeypatch.setenv("CBATCH_API_KEY", " k ")  # a key is taken as it is
    assert envs.CBATCH_API_KEY == " k "
    with pytest.raises(AttributeError):
        envs.CBATCH_NOT_A_VARIABLE


def test_a_bad_value_never_stops_an_import_or_the_version_report():
    env = {**os.environ, "CBATCH_CPU_ISA": "avx512", "CBATCH_NO_EXT": "2",
           "CBATCH_LOGGING_LEVEL": "loud", "CBATCH_DEBUG": "maybe"}
    out = subprocess.run([sys.executable, "-m", "cbatch", "--version"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    for name in ("CBATCH_CPU_ISA='avx512'", "CBATCH_NO_EXT='2'"):
        assert name in out.stderr, out.stderr
    assert "cpu fast paths:" in out.stdout
    out = subprocess.run([sys.executable, "-c", "import cbatch.logger"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0 and "CBATCH_LOGGING_LEVEL='loud'" in out.stderr, out.stderr


def test_the_scripts_defaults_are_the_listed_ones():
    """scripts/*.sh read their variables as ${NAME:-default}: the default is envs.py's."""
    defaults = {v.name: v.default for v in envs.VARIABLES}
    found = {}
    for script in (ROOT / "scripts").glob("*.sh"):
        for name, default in re.findall(r"\$\{(CBATCH_[A-Z0-9_]+):-([^}]*)\}",
                                        script.read_text()):
            found[name] = default
    assert found and all(defaults[name] == default for name, default in found.items()), found


def test_readme_table_is_generated_from_envs():
    readme = (ROOT / "README.md").read_text()
    assert envs.markdown_table() in readme, "regenerate it: python -m cbatch.envs"


def test_module_entry_point_checks_values():
    run = subprocess.run([sys.executable, "-m", "cbatch.envs", "--check"], capture_output=True,
                         text=True, env={"CBATCH_CPU_ISA": "avx3", "PATH": "/usr/bin"})
    assert run.returncode == 1 and "CBATCH_CPU_ISA='avx3'" in run.stdout
