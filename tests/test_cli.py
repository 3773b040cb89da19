"""The command line, on a tiny random model."""

from cbatch.entrypoints.cli import main


def test_demo_prints_table_and_writes_plot(tmp_path, capsys):
    plot = tmp_path / "occupancy.png"
    main(["demo", "--model", "random:tiny", "--scale", "0.5", "--plot", str(plot)])
    out = capsys.readouterr().out
    assert "| static " in out and "| continuous " in out
    assert "greedy outputs identical: True" in out
    assert plot.stat().st_size > 1000


def test_generate(capsys):
    main(["generate", "--model", "random:tiny", "--prompt", "hello", "--prompt", "a b",
          "--max-tokens", "3", "--temperature", "0.8", "--seed", "1"])
    out = capsys.readouterr().out
    assert out.count("---") == 2 and "3 tokens" in out
