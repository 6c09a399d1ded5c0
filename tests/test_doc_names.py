"""The names docstrings and docs give for code resolve to real modules, attributes and files.

What is checked, in the docstrings of src/pretrain/**/*.py (bare or in backticks) and in the
inline code (backticks) of README.md and docs/*.md:

- ``pretrain.a.b``: the longest importable module, then each attribute (``getattr``);
- ``mod.attr`` whose first part is a module of src/pretrain by its file's stem
  (``specs.build_optimizer``) or a class or function defined at the top of one
  (``Trainer.save_checkpoint``, ``GPT.init_rule``): the attribute of one such (a dataclass
  field counts);
- ``mod.attr`` whose first part is no module of the package (nor an importable one, such as
  ``torch``) while ``attr`` is a name the package defines: a module that was renamed
  (``config_checks.check``, now ``decision/checks.py``'s ``check``);
- a path ``dir/file.ext`` whose first folder is one of the repository's or of the package's
  (``decision/checks.py``, ``src/pretrain/optim/specs.py``, ``tests/helpers.py``,
  ``conf/optim/adamw.yaml``): the file exists (from the repository, ``src/`` or
  ``src/pretrain/``), and ``dir/module.attr`` (``optim/factory.wsd_decay_start``) names an
  attribute of that module.

Not checked, to have no false positives: names whose first part is a config section or a
package that is also one (``optim.lr``, ``schedule.step`` are config keys or local objects
as often as modules), local names (``cfg.model``, ``self.plan``), file names without a
folder (``meta.json``), paths under folders the repository does not have (``runs/...``),
and anything with a placeholder (``<run>``, ``*``, ``{``).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import re
from functools import cache
from pathlib import Path

from helpers import REPO

SRC = REPO / "src" / "pretrain"
DOTTED = re.compile(r"(?<![\w./<*{-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?![\w/*{<-])")
PATH = re.compile(r"(?<![\w./<*{-])((?:[\w.-]+/)+[\w-]+\.[A-Za-z_]\w*)(?![\w/*{<-])")
SOURCE_SUFFIXES = {"py", "md", "yaml", "yml", "toml", "sh", "sbatch", "cfg", "ini", "txt"}
INLINE = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
FILE_SUFFIXES = {"py", "md", "yaml", "yml", "toml", "json", "jsonl", "txt", "sh", "cfg", "ini",
                 "csv", "png", "bin", "sbatch", "lock", "pt", "h", "cc", "io", "tmp", "gz"}


@cache
def package_names() -> dict[str, list[str]]:
    """Module stem -> the dotted modules of src/pretrain with that file name."""
    out: dict[str, list[str]] = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC.parent).with_suffix("")
        parts = rel.parts[:-1] if path.name == "__init__.py" else rel.parts
        out.setdefault(parts[-1], []).append(".".join(parts))
    return out


def module_tree(module: str) -> ast.Module:
    path = SRC.parent / Path(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    return ast.parse(path.read_text())


@cache
def top_level_names() -> dict[str, list[str]]:
    """Each class or function defined at the top of a module of src/pretrain -> modules."""
    out: dict[str, list[str]] = {}
    for modules in package_names().values():
        for module in modules:
            for node in module_tree(module).body:
                if isinstance(node, ast.ClassDef | ast.FunctionDef):
                    out.setdefault(node.name, []).append(module)
    return out


@cache
def instance_names(module: str) -> dict[str, set[str]]:
    """Each class of ``module`` -> the attributes its methods set (``self.x = ...``)."""
    out = {}
    for node in module_tree(module).body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
                              and isinstance(n.ctx, ast.Store)
                              and getattr(n.value, "id", None) == "self"}
    return out


def of_an_instance(module: str, attr: str) -> bool:
    """``attr`` is an attribute of one of ``module``'s classes (a class attribute, a
    dataclass field or one its methods set): ``trainer.step`` for a Trainer."""
    if any(attr in names for names in instance_names(module).values()):
        return True
    return any(resolves(module, [cls, attr]) for cls in instance_names(module))


@cache
def config_sections() -> frozenset[str]:
    from pretrain.config.schema import Config

    return frozenset(f.name for f in dataclasses.fields(Config))


def has(obj: object, name: str) -> bool:
    fields = getattr(obj, "__dataclass_fields__", {})
    return name in fields or hasattr(obj, name)


def resolves(module: str, attrs: list[str]) -> bool:
    """``module`` imports (or its longest importable prefix does) and ``attrs`` follow."""
    parts = [*module.split("."), *attrs]
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not has(obj, name):
                return False
            obj = getattr(obj, name, None)
        return True
    return False


def importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def dotted_problem(name: str) -> str | None:
    """Why the dotted ``name`` does not resolve (None: it does, or it is not checked)."""
    first, *rest = name.split(".")
    if rest[-1] in FILE_SUFFIXES:
        return None  # a file name: meta.json, train.py
    if first == "pretrain":
        return None if resolves(name, []) else "no such module or attribute"
    if first in config_sections():
        return None  # a config key, or a package of the same name: ambiguous
    if first in package_names():  # a module, or an instance of one of its classes
        ok = any(resolves(m, rest) or of_an_instance(m, rest[0])
                 for m in package_names()[first])
        return None if ok else f"{first} has no {'.'.join(rest)}"
    if first[0].isupper() and first in top_level_names():  # a class
        ok = any(resolves(m, [first, *rest]) or rest[0] in instance_names(m).get(first, ())
                 for m in top_level_names()[first])
        return None if ok else f"{first} has no {'.'.join(rest)}"
    if "_" in first and rest[0] in top_level_names() and not importable(first):
        return f"no module {first} (is it {' or '.join(top_level_names()[rest[0]])}?)"
    return None


def path_problem(name: str) -> str | None:
    """Why the path ``name`` (``dir/file.ext`` or ``dir/module.attr``) does not resolve."""
    first = name.split("/")[0]
    roots = [REPO, REPO / "src", SRC]
    if not any((root / first).is_dir() for root in roots) or first in {"runs"}:
        return None  # not a folder of this repository: a run's, a machine's
    head, _, tail = name.rpartition("/")
    stem, _, rest = tail.partition(".")
    if stem.isupper() or rest in FILE_SUFFIXES - SOURCE_SUFFIXES:
        return None  # a placeholder (recipes/NAME.yaml), or data a run or a tool writes
    if any((root / name).exists() for root in roots):
        return None
    for root in roots:
        module = root / head / f"{stem}.py"
        if module.exists() and rest not in FILE_SUFFIXES and module.is_relative_to(SRC):
            dotted = ".".join(module.relative_to(REPO / "src").with_suffix("").parts)
            return None if resolves(dotted, rest.split(".")) else f"{dotted} has no {rest}"
    return "no such file"


def problems_in(text: str, where: str) -> list[str]:
    found = []
    for name in dict.fromkeys(PATH.findall(text)):
        if why := path_problem(name):
            found.append(f"{where}: {name}: {why}")
    for name in dict.fromkeys(DOTTED.findall(PATH.sub(" ", text))):
        if why := dotted_problem(name):
            found.append(f"{where}: {name}: {why}")
    return found


def docstrings(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            text = ast.get_docstring(node, clean=False)
            if text:
                found.append((getattr(node, "lineno", 1), text))
    return found


def stale_names(repo: Path = REPO) -> list[str]:
    found = []
    for path in sorted((repo / "src" / "pretrain").rglob("*.py")):
        for line, text in docstrings(path):
            found += problems_in(text, f"{path.relative_to(repo)}:{line}")
    for page in [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]:
        code = " ".join(INLINE.findall(FENCE.sub("", page.read_text())))
        found += problems_in(code, str(page.relative_to(repo)))
    return found


def test_names_in_docstrings_and_docs_resolve():
    assert stale_names() == [], "fix these names (or the code they name)"


def test_the_check_finds_stale_names_and_lets_the_others_pass():
    text = ("``pretrain.optim.specs.build_optimizer`` and ``pretrain.optim.specs.gone``; "
            "config_checks.check, specs.spec, specs.nothing, Trainer.save_checkpoint, "
            "Trainer.nope, GPT.cfg; decision/checks.py, decision/gone.py, "
            "optim/factory.wsd_decay_start, optim/factory.nope, runs/x/plan.json, "
            "cfg.optim.name, optim.lr, schedule.step, meta.json, torch.optim.AdamW, e.g. this")
    assert problems_in(text, "t") == [
        "t: decision/gone.py: no such file",
        "t: optim/factory.nope: pretrain.optim.factory has no nope",
        "t: pretrain.optim.specs.gone: no such module or attribute",
        "t: config_checks.check: no module config_checks (is it pretrain.decision.checks?)",
        "t: specs.nothing: specs has no nothing",
        "t: Trainer.nope: Trainer has no nope"]
