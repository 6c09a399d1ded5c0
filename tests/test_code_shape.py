"""The shape rules of src/: no function over 60 lines, none nesting blocks more than three deep.

Long functions and deep nesting are where a rule gets copied instead of named; these limits
keep every step of the code readable top to bottom (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "pretrain"
MAX_LINES = 60
MAX_DEPTH = 3
BLOCKS = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try,
          ast.Match)
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


def nesting(node: ast.AST, depth: int = 0) -> int:
    """The deepest block nesting inside ``node``, not counting nested functions or classes
    (they are measured on their own); ``elif`` is the same level as its ``if``."""
    deepest = depth
    for child in ast.iter_child_nodes(node):
        if isinstance(child, SCOPES):
            continue
        is_elif = (isinstance(node, ast.If) and isinstance(child, ast.If)
                   and node.orelse == [child])
        inner = depth + 1 if isinstance(child, BLOCKS) and not is_elif else depth
        deepest = max(deepest, nesting(child, inner))
    return deepest


def functions() -> list[tuple[str, ast.FunctionDef]]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((f"{path.relative_to(SRC.parent)}:{node.lineno} {node.name}", node))
    return found


def test_the_checker_counts_nesting_and_elif_as_it_should():
    tree = ast.parse(
        "def f(x):\n"
        "    for a in x:\n"
        "        if a:\n"
        "            pass\n"
        "        elif not a:\n"
        "            with open(a):\n"
        "                pass\n")
    assert nesting(tree.body[0]) == 3
    deeper = ast.parse("def g(x):\n    if x:\n        if x:\n            if x:\n"
                       "                if x:\n                    pass\n")
    assert nesting(deeper.body[0]) == 4


def test_no_function_in_src_is_over_60_lines():
    long = [f"{name}: {node.end_lineno - node.lineno + 1} lines" for name, node in functions()
            if node.end_lineno - node.lineno + 1 > MAX_LINES]
    assert not long, "split these into named steps:\n" + "\n".join(long)


def test_no_function_in_src_nests_more_than_three_blocks():
    deep = [f"{name}: {nesting(node)} levels" for name, node in functions()
            if nesting(node) > MAX_DEPTH]
    assert not deep, "flatten these (early returns, helpers):\n" + "\n".join(deep)


@pytest.mark.parametrize("tool", sorted((SRC.parents[1] / "tools").glob("*.py")),
                         ids=lambda p: p.name)
def test_tools_do_not_reach_into_src_with_sys_path(tool):
    assert "sys.path.insert" not in tool.read_text(), (
        f"{tool.name}: the package is installed (pip install -e .); import pretrain directly")


def continued_lines(source: str) -> list[int]:
    """Lines that end in a backslash continuation (not inside a string or a comment)."""
    import io
    import tokenize

    in_string = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.STRING:
            in_string.update(range(tok.start[0], tok.end[0]))
    return [n for n, line in enumerate(source.split("\n"), 1)
            if line.rstrip().endswith("\\") and n not in in_string
            and not line.lstrip().startswith("#")]


def test_the_continuation_finder_sees_a_backslash_and_not_one_in_a_string():
    assert continued_lines('x = 1 + \\\n    2\ns = """a \\\nb"""\n') == [1]


def test_no_backslash_continuations_in_src():
    """Brackets wrap a long line: a backslash breaks on a trailing space, and tools that
    follow a name through the code (and ruff's formatter) stop at it."""
    found = [f"{p.relative_to(SRC)}:{n}" for p in sorted(SRC.rglob("*.py"))
             for n in continued_lines(p.read_text())]
    assert not found, "wrap these in brackets:\n" + "\n".join(found)
