"""The README's test command is the one CI runs (so a green CI means the documented set-up works)."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = text.split("```")
    # the first two fenced blocks hold the two fresh-machine commands
    cmds = [b.split("\n", 1)[1].strip() for b in blocks[1:4:2]]
    return cmds


def test_readme_opens_with_two_commands():
    cmds = _readme_commands()
    assert len(cmds) == 2
    assert all(c.count("\n") == 0 for c in cmds), "each set-up command is one line"
    assert "torch==2.13.0" in cmds[0] and "torch==2.13.0" in cmds[1]


def test_ci_runs_the_readme_test_command():
    test_cmd = _readme_commands()[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd in ci.splitlines()
