"""scripts/run.sh installs only when csrc/, setup.py, the requirements or the torch
requirement changed.  Run on a copy of those files with a stand-in virtualenv whose python
logs pip and pytest calls instead of running them (nothing is installed)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def checkout(tmp_path):
    for name in ("scripts", "csrc"):
        shutil.copytree(ROOT / name, tmp_path / name)
    for name in ("setup.py", "pyproject.toml", "requirements-dev.txt"):
        shutil.copy(ROOT / name, tmp_path / name)
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text(
        "#!/usr/bin/env bash\n"
        'echo "$*" >> "$PYTHON_LOG"\n'
        'case "$1 $2" in\n'
        '  "-m pip") [ -z "${FAIL_PIP:-}" ]; exit ;;\n'
        '  "-m pytest"|"-m cbatch") exit 0 ;;\n'
        "esac\n"
        f'exec "{sys.executable}" "$@"\n')
    (venv_bin / "python").chmod(0o755)
    return tmp_path


def run_sh(checkout: Path, *args: str, **env: str) -> tuple[str, list[str]]:
    """stdout of ``bash scripts/run.sh ARGS``, and the pip/pytest calls it made."""
    log = checkout / "python.log"
    log.unlink(missing_ok=True)
    result = subprocess.run(
        ["bash", str(checkout / "scripts" / "run.sh"), *args], capture_output=True,
        text=True, timeout=120,
        env={**os.environ, "VENV": str(checkout / "venv"), "PYTHON_LOG": str(log), **env})
    calls = [line for line in log.read_text().splitlines() if line.startswith("-m ")]
    if result.returncode:
        raise subprocess.CalledProcessError(result.returncode, args, result.stdout,
                                            result.stderr)
    return result.stdout, calls


def pip_installs(calls: list[str]) -> int:
    return sum(c.startswith("-m pip install") for c in calls)


def test_installs_once_then_only_when_an_input_changes(checkout):
    out, calls = run_sh(checkout, "test", "-k", "x")
    assert pip_installs(calls) == 3 and calls[-1] == "-m pytest -q -k x"
    assert "skipping pip" not in out
    # one line of its own per step, and pip's own output (progress) not silenced
    steps = [line for line in out.splitlines() if line.startswith("run.sh: [")]
    assert [line[:13] for line in steps] == ["run.sh: [1/3]", "run.sh: [2/3]", "run.sh: [3/3]"]
    assert not [c for c in calls if c.startswith("-m pip") and " -q" in c]
    assert "-m cbatch --version" in calls
    assert "source " + str(checkout / "venv") + "/bin/activate" in out

    out, calls = run_sh(checkout, "test")
    assert pip_installs(calls) == 0 and calls == ["-m pytest -q"]
    assert "up to date" in out and "skipping pip" in out

    out, calls = run_sh(checkout, "demo", "--scale", "0.5")
    assert pip_installs(calls) == 0
    assert calls == ["-m cbatch demo --scale 0.5"]

    _, calls = run_sh(checkout, "test", CBATCH_TORCH="torch==2.14.1")
    assert pip_installs(calls) == 3 and "-m pip install torch==2.14.1" in calls

    kernel = next(p for p in sorted((checkout / "csrc").rglob("*.cpp")))
    kernel.write_text(kernel.read_text() + "\n// changed\n")
    _, calls = run_sh(checkout, "test", CBATCH_TORCH="torch==2.14.1")
    assert pip_installs(calls) == 3

    (checkout / "requirements-dev.txt").write_text("pytest\n")
    _, calls = run_sh(checkout, "test", CBATCH_TORCH="torch==2.14.1")
    assert pip_installs(calls) == 3
    _, calls = run_sh(checkout, "test", CBATCH_TORCH="torch==2.14.1")
    assert pip_installs(calls) == 0


def test_a_failed_install_is_retried(checkout):
    with pytest.raises(subprocess.CalledProcessError):
        run_sh(checkout, "test", FAIL_PIP="1")
    _, calls = run_sh(checkout, "test")
    assert pip_installs(calls) == 3


def test_the_virtualenv_of_run_sh_carries_every_extra():
    """Every requirement of every extra in pyproject.toml is in requirements-dev.txt, which
    run.sh installs: its editable virtualenv needs no `pip install .[extra]` (which would
    replace the editable install with a copy)."""
    import re
    import tomllib

    def name(requirement: str) -> str:
        return re.match(r"[A-Za-z0-9_.-]+", requirement).group().lower().replace("_", "-")

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    lines = (ROOT / "requirements-dev.txt").read_text().splitlines()
    dev = {name(line) for line in lines if line.strip() and not line.startswith("#")}
    missing = {extra: sorted(name(r) for r in reqs if name(r) not in dev)
               for extra, reqs in extras.items()}
    assert not any(missing.values()), missing
