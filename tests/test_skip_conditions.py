"""A skip condition never reads the project's own source text (issue 56): the Slurm
checkpoint and preemption tests once skipped while ``"CheckpointManager"`` did not appear in
train/trainer.py, which stopped being true when the trainer was split, and so they stopped
running, in CI too, without anyone seeing it. A skip may depend on the machine (a GPU, a
package, Slurm), never on how the code is spelt."""

from __future__ import annotations

import ast
from pathlib import Path

HERE = Path(__file__).resolve().parent
READERS = {"read_text", "read_bytes", "open", "getsource", "read"}
PROJECT = ("src", "pretrain", "train", "trainer", "tools", "conf", "recipes", ".py", "REPO",
           "SRC")


def _mentions_project(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and any(
                p in sub.value for p in PROJECT):
            return True
        if isinstance(sub, ast.Name) and sub.id in PROJECT:
            return True
    return False


def _reads_source(node: ast.AST) -> bool:
    """``node`` calls a file reader (``.read_text()``, ``open(...)``, ``inspect.getsource``)
    on something that names the project's files."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            f = sub.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in READERS and _mentions_project(sub):
                return True
    return False


def source_reading_skips(text: str) -> list[str]:
    """The skip conditions of a test module (``skipif`` decorators and marks, ``pytest.skip``
    under an ``if``) that read the project's source, directly or through a function of the
    module they call."""
    tree = ast.parse(text)
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    conditions: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "skipif" and node.args:
                conditions.append(node.args[0])
        if isinstance(node, ast.If) and any(
                isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                and c.func.attr == "skip" for c in ast.walk(node)):
            conditions.append(node.test)
    bad = []
    for cond in conditions:
        called = {c.func.id for c in ast.walk(cond)
                  if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
        if _reads_source(cond) or any(_reads_source(functions[n]) for n in called
                                      if n in functions):
            bad.append(ast.unparse(cond))
    return bad


def test_no_skip_condition_reads_the_projects_source():
    found = {p.name: bad for p in sorted(HERE.glob("*.py"))
             if (bad := source_reading_skips(p.read_text()))}
    assert found == {}


def test_the_check_catches_the_stale_guard():
    stale = '''
import pytest
def trainer_checkpoints():
    return "CheckpointManager" in (REPO / "src" / "pretrain" / "train" / "trainer.py").read_text()
@pytest.mark.skipif(not trainer_checkpoints(), reason="no checkpoints yet")
def test_x():
    pass
def test_y():
    if "Muon" not in open("src/pretrain/optim/muon.py").read():
        pytest.skip("later")
'''
    assert source_reading_skips(stale) == [
        "not trainer_checkpoints()",
        "'Muon' not in open('src/pretrain/optim/muon.py').read()",
    ]
    machine = '''
import pytest, torch, shutil
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_x():
    if shutil.which("sbatch") is None:
        pytest.skip("no Slurm")
'''
    assert source_reading_skips(machine) == []
