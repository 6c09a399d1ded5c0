"""One spec per choice (issue 41): each optimizer is one OptimizerSpec (a module of
optim/optimizers/, registered where it is defined; optim/specs.py holds them all) and
each data-parallel mode one DpModeSpec (parallel/dp_modes.py); every user reads the spec,
and no module outside the spec modules and the config schema compares a name."""

from __future__ import annotations

import ast

import pytest
from helpers import REPO

from pretrain.config.schema import Config, ConfigError, DpMode
from pretrain.decision.checks import check
from pretrain.optim.specs import OPTIMIZERS, spec
from pretrain.parallel.dp_modes import DP_MODES

SRC = REPO / "src" / "pretrain"
OWNERS = {SRC / "optim" / "specs.py", SRC / "parallel" / "dp_modes.py",
          SRC / "config" / "schema.py"}


def name_comparisons(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every comparison (==, !=, in, not in) with a string constant in
    ``names``, or a tuple/list/set of such constants."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            consts = side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side]
            found += [(node.lineno, c.value) for c in consts
                      if isinstance(c, ast.Constant) and c.value in names]
    return found


def test_no_optimizer_or_dp_mode_name_is_compared_outside_its_spec():
    names = set(OPTIMIZERS) | set(DP_MODES)
    bad = [f"{path.relative_to(REPO)}:{line}: {name!r}"
           for path in sorted(SRC.rglob("*.py")) if path not in OWNERS
           for line, name in name_comparisons(ast.parse(path.read_text()), names)]
    assert bad == [], "read the spec (optim/specs.py, parallel/dp_modes.py) instead:\n" + \
        "\n".join(bad)


def test_the_grep_bites():
    tree = ast.parse('if cfg.optim.name == "lamb" or mode in ("zero2", "x"): pass')
    assert name_comparisons(tree, set(OPTIMIZERS) | set(DP_MODES)) == [
        (1, "lamb"), (1, "zero2")]


def test_every_dp_mode_of_the_schema_has_a_spec():
    assert list(DP_MODES) == [m.value for m in DpMode]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_has_its_recipe(name):
    """optim=<name> composes: each spec has its conf/optim YAML naming it."""
    text = (REPO / "conf" / "optim" / f"{name}.yaml").read_text()
    assert f"\nname: {name}\n" in f"\n{text}"
    lo, hi = spec(name).lr_range
    assert 0 < lo < hi


def test_an_unknown_optimizer_name_is_refused_naming_the_choices():
    cfg = Config()
    cfg.optim.name = "adam"
    with pytest.raises(ConfigError) as e:
        check(cfg, world_size=1)
    assert e.value.problems == [
        f"optim.name=adam is no optimizer here: use optim={'|'.join(OPTIMIZERS)} "
        "(src/pretrain/optim/specs.py OPTIMIZERS)"]
