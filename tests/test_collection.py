"""The gpu tier collects on a machine that lacks the container tools: a GPU machine ships
its own torch and no ``docker`` (issue 49: collecting ``pytest -m gpu`` failed on
tests/test_container.py's module-level ``import docker``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# None in sys.modules makes `import docker` raise ImportError, as on a machine without it
WITHOUT = """
import sys
for name in ("docker", "docker.utils", "docker.utils.build", "dockerfile_parse"):
    sys.modules[name] = None
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""


def run_pytest(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT, "-q", "-p", "no:cacheprovider",
                           "tests/test_container.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_container_tests_collect_and_skip_without_docker():
    collected = run_pytest("--collect-only")
    assert collected.returncode == 0, collected.stdout[-2000:] + collected.stderr[-2000:]
    assert "error" not in collected.stdout.lower(), collected.stdout[-2000:]
    assert "test_build_context_has_the_code" in collected.stdout
    ran = run_pytest("-rs")
    assert ran.returncode == 0, ran.stdout[-2000:]
    assert "could not import 'docker.utils.build'" in ran.stdout, ran.stdout[-2000:]
    assert "failed" not in ran.stdout and "error" not in ran.stdout.lower()
