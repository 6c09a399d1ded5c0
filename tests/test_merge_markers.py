"""No merge-conflict markers in tracked files: a merge once left one in docs/architecture.md
and every other check still passed (both sides named the same modules)."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_tracked_file_holds_a_conflict_marker():
    found = subprocess.run(
        ["git", "grep", "-n", "-I", "-E", "^(<<<<<<< |>>>>>>> |=======$)"],
        cwd=ROOT, capture_output=True, text=True,
    )
    if found.returncode == 128:  # not a git checkout (an sdist): nothing to read
        return
    assert found.stdout == "", f"conflict markers left by a merge:\n{found.stdout}"
