"""The shape of the package: the layer order (import-linter's contract in pyproject.toml, the
one docs/architecture.md draws), a loop that cannot see the layout, and rules that live in
one module each, compared across their users."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from helpers import REPO

SRC = REPO / "src" / "pretrain"
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())"]


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def lint(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*LINT, "--no-cache"], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(cwd / "src")})


def test_the_layer_contract_is_kept():
    out = lint(REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 kept, 0 broken" in out.stdout


def test_every_module_has_a_layer():
    """A module outside the contract could import anything: each top-level module and
    package of src/pretrain is in one layer."""
    layers = tomllib.loads((REPO / "pyproject.toml").read_text())
    named = {m.strip() for layer in layers["tool"]["importlinter"]["contracts"][0]["layers"]
             for m in layer.split("|")}
    present = {f"pretrain.{p.stem}" for p in SRC.iterdir()
               if p.name != "__init__.py" and (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert present - named == set(), "give these a layer in pyproject.toml"
    assert named - present == set(), "the contract names modules that do not exist"
    wing = layers["tool"]["importlinter"]["contracts"][1]
    assert wing["containers"] == ["pretrain.train"]
    inner = {m.strip() for layer in wing["layers"] for m in layer.split("|")}
    assert inner == {p.stem for p in (SRC / "train").iterdir()
                     if (p.suffix == ".py" and p.name != "__init__.py")
                     or (p / "__init__.py").exists()}
    data = layers["tool"]["importlinter"]["contracts"][2]
    assert data["containers"] == ["pretrain.data"]
    inner = {m.strip() for layer in data["layers"] for m in layer.split("|")}
    assert inner == {p.stem for p in (SRC / "data").glob("*.py") if p.name != "__init__.py"}


def test_the_package_is_wings_not_a_flat_list():
    """At most 6 top-level modules beside the packages (issue 41): a newcomer meets the
    wings (config, model, optim, train, ...), not 32 files."""
    modules = [p.name for p in SRC.glob("*.py") if p.name != "__init__.py"]
    assert len(modules) <= 6, modules


def test_an_upward_import_breaks_the_contract(tmp_path):
    """The contract bites: a copy of the package where the model imports the trainer (a
    floor reaching up to the loop) fails lint-imports, naming the import."""
    shutil.copytree(SRC, tmp_path / "src" / "pretrain")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    model = tmp_path / "src" / "pretrain" / "model" / "gpt.py"
    model.write_text(model.read_text() + "\nfrom pretrain.train.trainer import Trainer  # noqa\n")
    out = lint(tmp_path)
    assert out.returncode == 1, out.stdout
    assert "Wings" in out.stdout and "pretrain.model.gpt -> pretrain.train.trainer" in out.stdout


def test_an_upward_import_inside_the_training_wing_breaks_its_contract(tmp_path):
    """The second contract bites too: the train module reaching up to the loop."""
    shutil.copytree(SRC, tmp_path / "src" / "pretrain")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    module = tmp_path / "src" / "pretrain" / "train" / "train_module.py"
    module.write_text(module.read_text() + "\nfrom pretrain.train.trainer import Trainer  # noqa\n")
    out = lint(tmp_path)
    assert out.returncode == 1, out.stdout
    assert "pretrain.train.train_module -> pretrain.train.trainer" in out.stdout


def test_an_upward_import_inside_the_data_wing_breaks_its_contract(tmp_path):
    """The data wing's contract bites: the mixer (the counting, below the windows) reaching
    up to the windows that read it fails lint-imports, naming the contract and the import;
    the real tree keeps it (test_the_layer_contract_is_kept)."""
    shutil.copytree(SRC, tmp_path / "src" / "pretrain")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    module = tmp_path / "src" / "pretrain" / "data" / "mixer.py"
    module.write_text(module.read_text()
                      + "\nfrom pretrain.data.mixture_windows import MixtureWindows  # noqa\n")
    out = lint(tmp_path)
    assert out.returncode == 1, out.stdout
    assert "Data wing" in out.stdout and "BROKEN" in out.stdout
    assert "pretrain.data.mixer -> pretrain.data.mixture_windows" in out.stdout


def test_the_data_wing_has_no_import_circle_and_no_hidden_import():
    """No module of data/ imports another of data/ inside a function (the way an import
    circle is kept from failing at import time): every one is at the top of its module,
    where the contract sees it."""
    hidden = []
    for path in (SRC / "data").glob("*.py"):
        tree = ast.parse(path.read_text())
        top = set(map(id, tree.body))
        hidden += [f"{path.name}: {node.module}" for node in ast.walk(tree)
                   if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                       "pretrain.data") and id(node) not in top]
    assert hidden == []


def test_no_module_imports_a_private_name_of_the_data_wing():
    """data/'s private (underscore) names stay in their module: what another module needs
    is public (prepare.config_dict, not _config_dict)."""
    private = [f"{path.relative_to(SRC)}: {node.module}.{a.name}"
               for path in SRC.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                   "pretrain.data") for a in node.names if a.name.startswith("_")]
    assert private == []


def test_a_hook_module_reaching_up_to_the_loop_breaks_the_contract(tmp_path):
    """The services package is one layer as a whole: a hook module (any, a new one too)
    importing the loop fails lint-imports with no edit to pyproject.toml."""
    shutil.copytree(SRC, tmp_path / "src" / "pretrain")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    hook = tmp_path / "src" / "pretrain" / "train" / "services" / "brand_new.py"
    hook.write_text("from pretrain.train.trainer import Trainer  # noqa\n")
    out = lint(tmp_path)
    assert out.returncode == 1, out.stdout
    assert "pretrain.train.services.brand_new -> pretrain.train.trainer" in out.stdout


def test_the_loop_imports_nothing_from_parallel():
    """trainer.py reaches the layout only through the train module's interface."""
    assert not {
        m for m in imports_of(SRC / "train" / "trainer.py") if m.startswith("pretrain.parallel")
    }


@pytest.mark.parametrize("name", ["pp_group", "tied", "duplicate_params", "has_last_stage",
                                  ".schedule", "ScaledLoss", "layout.tp", "layout.pp",
                                  "stage_ids", "sync_grads"])
def test_the_loop_asks_nothing_about_the_layout(name):
    assert name not in (SRC / "train" / "trainer.py").read_text()


def test_the_loop_is_short():
    """Services attach on the hook seam (train/hooks.py, train/services/), not inside
    the loop (issue 41); setup's steps and close are train/lifecycle.py's (issue 62)."""
    assert len((SRC / "train" / "trainer.py").read_text().splitlines()) <= 320


def test_no_source_file_is_over_450_lines():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 450}
    assert long == {}, "split these by what they hold"


def test_training_never_imports_the_analysis_package():
    users = [p.relative_to(SRC) for p in SRC.rglob("*.py")
             if any(m.startswith("pretrain.analysis") for m in imports_of(p))
             and p.parts[len(SRC.parts)] not in ("analysis", "tools")]
    assert users == []


# -- rules that live once ---------------------------------------------------------------------


def calls_of(name: str) -> list[str]:
    """Modules of src/pretrain that call ``name`` (a function), by the AST."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
                if called == name:
                    found.append(str(path.relative_to(SRC)))
                    break
    return found


@pytest.mark.parametrize("decision", ["resolve_auto_precision", "apply_rules", "choose_layout"])
def test_the_auto_decisions_are_taken_in_one_module(decision):
    """precision, then hyperparameter rules, then the layout: resolve.resolve_auto takes
    them in that order for the run, the dry run and tools/plan.py alike."""
    assert calls_of(decision) == ["decision/resolve.py"]


def test_the_checkout_root_is_computed_once():
    users = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
             if "__file__" in p.read_text()]
    assert users == ["config/paths.py"]


LAYOUTS = [(tp, pp, dp) for tp in (1, 2, 4) for pp in (1, 2) for dp in (None, 1, 3)]


@pytest.mark.parametrize(("tp", "pp", "dp"), LAYOUTS)
def test_world_size_one_rule_for_checks_local_and_slurm_launch(compose, tp, pp, dp):
    """tp x pp x dp (dp=null: the world / (tp x pp)) in parallel/layout.py; the config
    check, the run's layout, run_local and the Slurm allocation all agree with it on
    which process counts a layout runs on, and with what dp."""
    from pretrain.launch import LaunchError, local, slurm
    from pretrain.parallel.layout import derived_dp, layout_world_size, resolve_layout
    from pretrain.parallel.rules import world_problems

    cfg = compose(["model=nano", "model.n_layer=4", "train.global_batch_size=48",
                   f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={dp or 'null'}",
                   "parallel.micro_batch_size=1", "cluster=local"])
    par = cfg.parallel
    for world in range(1, 17):
        want, problems = world_problems(par, world)
        runs = not problems
        assert runs == (world % (tp * pp) == 0 and (dp is None or world == tp * pp * dp))
        try:
            local_ok = local.world_size(par, world if dp is None else None) == world
        except LaunchError:
            local_ok = False
        assert local_ok == runs, world
        if runs:
            assert want == derived_dp(cfg, world) == resolve_layout(cfg, world).dp
    for nodes, gpus in [(1, 2), (1, 4), (2, 4), (3, 4), (1, 8), (2, 8), (3, 8)]:
        world = nodes * gpus  # Slurm adds one rule of its own: TP inside a node
        try:
            slurm_ok = slurm.allocation(cfg, nodes, gpus).world_size == world
        except LaunchError:
            slurm_ok = False
        assert slurm_ok == (not world_problems(par, world)[1] and gpus % tp == 0), world
    if dp is not None:
        assert slurm.allocation(cfg).world_size == layout_world_size(par) == tp * pp * dp


def test_one_plan_for_the_run_the_dry_run_and_the_planner(compose, prepared, tmp_path,
                                                          capsys):
    """The plan's facts are stated once (resolve.describe_run): the trainer's plan is the
    dry run's, and tools/plan.py's JSON extends it with the same values."""
    from pretrain.budget.compute import resolve_budget
    from pretrain.decision.resolve import describe_run
    from pretrain.tools.plan import main as plan_main
    from pretrain.train.trainer import Trainer, run

    overrides = ["model=nano", "model.vocab_size=300", "model.seq_len=32", "precision=fp32",
                 "data.name=tinytext", f"data.root={prepared.parent}", "data.auto_prepare=false",
                 "data.tokenizer_vocab_size=300", "train.global_batch_size=8",
                 "parallel.micro_batch_size=2", "budget=steps", "budget.steps=3",
                 "optim.lr_rule=deepseek", "logging=quiet"]
    dry = run(compose([*overrides, "dry_run=true"]), tmp_path / "dry")
    cfg = compose(overrides)
    assert Trainer(cfg, tmp_path / "run").plan == dry
    capsys.readouterr()
    assert plan_main(["--json", "--gpu", "a100-80gb", *overrides]) == 0
    planned = json.loads(capsys.readouterr().out)
    facts = describe_run(cfg, 1, resolve_budget(cfg.model, cfg.budget, 8))
    assert "hparam_rules" in planned and planned["hparam_rules"] == dry["hparam_rules"]
    for key in facts:
        if key != "lr":  # the rule's LR: compared through hparam_rules above
            assert planned[key] == dry[key], key
    assert planned["lr"] == dry["lr"] != facts["lr"]


def test_the_run_reads_a_typed_decision_and_the_plan_is_its_serialised_form(compose):
    """decision/resolve returns a frozen RunDecision (config/decision.py) that the trainer
    and data/ read; plan.json holds its serialised form (as_plan) among the report's
    extras, and nothing in the package reads a plan dict back as input (issue 50)."""
    import dataclasses

    from pretrain.config.decision import RunDecision
    from pretrain.decision.resolve import resolve_run

    run = resolve_run(compose(["model=nano", "checkpoint.branch_tokens_per_param=[0.5]",
                               "schedule=wsd", "budget=steps", "budget.steps=400"]))
    assert isinstance(run.decision, RunDecision)
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.decision.lr = 1.0  # type: ignore[misc]
    own = run.decision.as_plan()
    assert {"lr", "attention", "precision", "branch_points"} <= own.keys()
    assert {k: run.plan[k] for k in own} == json.loads(json.dumps(own))
    assert own["branch_points"] == list(run.decision.branch_points) != []
    readers = re.compile(r"\b(self|trainer|run)\.plan(\[|\.get\()|plan\[\"(lr|attention|"
                         r"layout|branch_points|mixture_stages|data_sources)\"\]")
    found = [f"{p.relative_to(SRC)}: {m.group(0)}" for p in SRC.rglob("*.py")
             if p.relative_to(SRC).parts[0] in ("train", "data", "checkpoint", "decision")
             for m in readers.finditer(p.read_text())]
    assert found == []


def test_every_module_is_named_in_the_docs():
    """docs/architecture.md names every module of the package, and its map of the files
    every top-level module and wing (package)."""
    arch = (REPO / "docs" / "architecture.md").read_text()
    layout = arch[arch.index("## The files"):arch.index("## Who decides what")]
    # optim/optimizers/ holds one module per optimizer, named there as a folder; each
    # optimizer is named in docs/optimizers.md instead (tests/test_optimizer_docs.py)
    files = [p.relative_to(SRC) for p in SRC.rglob("*.py") if p.name != "__init__.py"
             and p.parent != SRC / "optim" / "optimizers"]
    unnamed = [str(f) for f in files if not re.search(rf"\b{f.stem}\b", arch)]
    assert unnamed == [], "name these in docs/architecture.md"
    tops = {f.parts[0].removesuffix(".py") for f in files}
    assert [t for t in sorted(tops) if not re.search(rf"\b{t}\b", layout)] == []


def _private_torch_names(path: Path) -> list[str]:
    """Private torch names ``path`` spells: an import of a torch module with a ``_`` part
    or of a ``_`` name from one, or an attribute chain ``torch....._x`` (ATen operator
    overloads under ``torch.ops`` are the dispatcher's names, not Python API)."""
    def private(dotted: str) -> bool:
        return any(p.startswith("_") and not p.startswith("__") for p in dotted.split("."))

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names = [f"{node.module}.{a.name}" for a in node.names]
            found += [n for n in names if private(n)]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names
                      if a.name.split(".")[0] == "torch" and private(a.name)]
        elif isinstance(node, ast.Attribute):
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            dotted = ".".join([getattr(inner, "id", ""), *reversed(chain)])
            if dotted.startswith("torch.") and not dotted.startswith("torch.ops.") and private(
                    dotted):
                found.append(dotted)
    return found


def test_only_torch_compat_spells_a_private_torch_name():
    """Every private torch name goes through pretrain.torch_compat (looked up on use,
    checked against the torch it was written for), so the package and the tools import on
    any torch and one module says what a new torch broke."""
    files = [*SRC.rglob("*.py"), *(REPO / "tools").glob("*.py")]
    spelled = {str(p.relative_to(REPO)): names for p in files
               if p.name != "torch_compat.py" and (names := _private_torch_names(p))}
    assert spelled == {}


def test_every_private_name_listed_is_used_and_every_one_used_is_listed():
    from pretrain.torch_compat import PRIVATE

    text = "\n".join(p.read_text() for p in SRC.rglob("*.py") if p.name != "torch_compat.py")
    called = set(re.findall(r"torch_compat\.\w+\(\s*\"(\w+)\"", text))
    assert called and called - set(PRIVATE) == set(), "not in torch_compat.PRIVATE"
    assert [k for k in PRIVATE if f'"{k}"' not in text] == [], "listed but unused"
