"""Every ```python example in the README runs as written."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 4


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, capsys):
    exec(compile(BLOCKS[index], f"README.md[python block {index}]", "exec"), {})
    assert capsys.readouterr().out  # every example prints what it computed


ROOT = README.parent


def test_design_references_name_the_design_page():
    """Docstrings that cite the design name docs/design.md, which is in the repository."""
    assert (ROOT / "docs" / "design.md").is_file()
    files = [p for d in ("cbatch", "benchmarks", "scripts", "kernels")
             for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".sh", ".md")]
    cited = []
    for path in files + [README]:
        for match in re.finditer(r"[\w./-]*design\.md", path.read_text(), flags=re.I):
            cited.append((path.relative_to(ROOT), match.group()))
    assert cited and all(name == "docs/design.md" for _, name in cited), cited


def test_readme_cli_commands_parse():
    """Every `cbatch ...` command line in the README is one the CLI accepts."""
    import shlex

    from cbatch.entrypoints.cli.main import build_parser

    text = README.read_text()
    commands = re.findall(r"`(cbatch (?:demo|generate|serve)[^`]*)`", text)
    # and the command lines of ```bash blocks
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        commands += [line.split("#")[0].strip() for line in block.splitlines()
                     if line.startswith("cbatch ") and "--version" not in line]
    assert any(c.startswith("cbatch serve") for c in commands)
    for command in commands:
        args = shlex.split(command)[1:]
        if "--help" not in args:
            build_parser().parse_args(args)


def test_readme_offline_server_answers_to_the_examples_model_name():
    """The offline `cbatch serve random:gpt2 ...` serves the model name that the curl and
    OpenAI-client examples ask for (a different name would get 404)."""
    import shlex

    from cbatch.entrypoints.cli.main import build_parser
    from cbatch.entrypoints.cli.serve import resolve_model

    text = README.read_text()
    (offline,) = re.findall(r"`(cbatch serve random:[^`]*)`", text)
    args = build_parser().parse_args(shlex.split(offline)[1:])
    resolve_model(args)
    served = set(args.served_model_name or [args.model])
    asked = set(re.findall(r'"model": "([^"]+)"', text)) | set(
        re.findall(r'model="([^"]+)"', text))
    assert asked == served, (asked, served)


def test_readme_holds_no_dated_timings_and_says_the_cpu_torch_step_first():
    """Timings depend on the machine and the day: they live in benchmarks/RESULTS.md with
    both, and the README points there.  A newcomer on a CPU machine reads the CPU torch step
    before the two commands."""
    text = README.read_text()
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text)
    assert "benchmarks/RESULTS.md" in text
    fresh = text.split("## Fresh machine", 1)[1].split("\n## ", 1)[0]
    cpu_torch = fresh.find("download.pytorch.org/whl/cpu")
    assert 0 <= cpu_torch < fresh.find("bash scripts/run.sh demo")


def test_readme_stays_a_guide():
    """The README is the first page, not the manual: 250 lines at most (the rest lives in
    docs/design.md, the docstrings and `--help`)."""
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail to docs/"

