"""README.md's two set-up commands stay true: CI runs exactly the test command."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    return [b.strip() for b in blocks[:2]]


def test_first_two_commands_set_up_then_train_and_test():
    train, test = readme_commands()
    for cmd in (train, test):
        assert cmd.startswith("python3 -m venv .venv") and "pip install torch==2.13.0" in cmd
        # torch is installed, pinned, before the project, so pip never resolves another one
        assert cmd.index("pip install torch==2.13.0") < cmd.index("pip install -e")
    assert train.endswith("python train.py")
    assert test.endswith("pytest -q")


def test_ci_runs_the_readme_test_command():
    _, test = readme_commands()
    ci = (REPO / ".ci" / "run").read_text()
    assert test in ci.splitlines()
