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
    assert test.endswith("pytest -q -n auto")


def test_ci_runs_the_readme_test_command():
    _, test = readme_commands()
    ci = (REPO / ".ci" / "run").read_text()
    assert test in ci.splitlines()


def test_the_gpu_tier_runs_in_one_process_and_the_suite_one_worker_a_core(monkeypatch):
    """README's ``-n auto``: one worker per core up to conftest.MAX_WORKERS, and none under
    ``-m gpu`` (those tests share one GPU and some of them time it)."""
    import os
    from types import SimpleNamespace

    import conftest

    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    config = SimpleNamespace(option=SimpleNamespace(markexpr="gpu"))
    assert conftest.pytest_xdist_auto_num_workers(config) == 0
    config.option.markexpr = "not gpu"
    cores = len(os.sched_getaffinity(0))
    assert conftest.pytest_xdist_auto_num_workers(config) == min(cores, conftest.MAX_WORKERS)
    config.option.markexpr = "not slow"
    cores = len(os.sched_getaffinity(0))
    assert conftest.pytest_xdist_auto_num_workers(config) == min(cores, conftest.MAX_WORKERS)
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "3")
    assert conftest.pytest_xdist_auto_num_workers(config) == 3


def test_the_tests_run_without_pytest_xdist():
    """The GPU box has its own packages and no index: ``pytest -m gpu`` there must not need
    pytest-xdist (conftest's xdist hook is optional)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-q",
                           "-p", "no:cacheprovider", "--collect-only", "tests/test_readme.py"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_ci_stops_at_a_failing_pip_inside_an_and_list(tmp_path):
    """Under ``set -e`` bash goes on past a failure inside an ``&&`` list (but for its last
    command), and README's test line is such a list: .ci/run's wrappers make a pip or venv
    failure there end the script with pip's status (a CI once ran out of disk in ``pip install``
    and failed two stages later)."""
    import os
    import subprocess

    ci = (REPO / ".ci" / "run").read_text().splitlines()
    wrapper = r'\w+\(\) \{ command \w+ "\$@" \|\| exit "\$\?"; \}'
    wrappers = [line for line in ci if re.fullmatch(wrapper, line)]
    assert {w.split("(")[0] for w in wrappers} >= {"pip", "python3"}
    assert ci.index(wrappers[-1]) < ci.index(readme_commands()[1])
    stub = tmp_path / "pip"
    stub.write_text("#!/bin/sh\necho 'No space left on device' >&2\nexit 3\n")
    stub.chmod(0o755)
    script = "\n".join([*wrappers, "set -e", "true && pip install x && echo tests-ran",
                        "echo went-on"])
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"})
    assert proc.returncode == 3, (proc.returncode, proc.stdout, proc.stderr)
    assert "tests-ran" not in proc.stdout and "went-on" not in proc.stdout
