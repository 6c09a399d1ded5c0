"""The Dockerfile, checked without Docker (no daemon here): what it copies is in the build
context and what it must not copy is not, its entry point exists, the extras and versions it
installs agree with pyproject.toml, its torch is README's, and pip is kept off torch.

``docker`` and ``dockerfile_parse`` are imported inside the fixtures that use them, so the
file collects (and its tests skip) on a machine without them: a GPU machine collecting
``pytest -m gpu`` (issue 49)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

if TYPE_CHECKING:
    from dockerfile_parse import DockerfileParser

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def dockerfile() -> DockerfileParser:
    parser = pytest.importorskip("dockerfile_parse").DockerfileParser
    return parser(path=str(REPO / "Dockerfile"))


def instructions(df: DockerfileParser, name: str) -> list[str]:
    return [i["value"] for i in df.structure if i["instruction"] == name]


def global_args(df: DockerfileParser) -> dict[str, str]:
    """ARG defaults before the first FROM (they may name the base image)."""
    out = {}
    for i in df.structure:
        if i["instruction"] == "FROM":
            break
        if i["instruction"] == "ARG" and "=" in i["value"]:
            key, value = i["value"].split("=", 1)
            out[key] = value.strip('"')
    return out


def stage_args(df: DockerfileParser) -> dict[str, str]:
    return {k: v.strip('"') for k, v in df.args.items()}


def dockerignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


@pytest.fixture(scope="module")
def build_context(tmp_path_factory) -> set[str]:
    """The files `docker build .` would send for a checkout holding the repository's files
    plus what a user's checkout also has (run outputs, data, a venv, caches, .git)."""
    exclude_paths = pytest.importorskip("docker.utils.build").exclude_paths
    root = tmp_path_factory.mktemp("context")
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    junk = ["runs/tiny/metrics.jsonl", "data/stdlib/index.json", ".venv/bin/python",
            "wandb/run-1/files", "outputs/2024/x.log", ".git/HEAD",
            "src/pretrain/__pycache__/model.cpython-311.pyc", "tests/__pycache__/t.pyc",
            "src/pretrain_recipes.egg-info/PKG-INFO", ".pytest_cache/README.md",
            ".ruff_cache/CACHEDIR.TAG"]
    for name in files + junk:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    return set(exclude_paths(str(root), dockerignore_patterns()))


def test_build_context_has_the_code_and_leaves_out_outputs_and_caches(build_context):
    for needed in ("train.py", "pyproject.toml", "README.md", "conf/config.yaml",
                   "recipes/gpt3-1.3b.yaml", "src/pretrain/train/trainer.py",
                   "src/pretrain/data/loader.py",  # a package named data: not the data/ dir
                   "src/pretrain/parallel/apply.py", "tools/bench.py", "slurm/train.sbatch"):
        assert needed in build_context, f"{needed} is missing from the image"
    top_level = ("runs", "data", ".venv", "wandb", "outputs", ".git", ".pytest_cache",
                 ".ruff_cache")
    leaked = [p for p in build_context if Path(p).parts[0] in top_level
              or any(part == "__pycache__" or part.endswith(".egg-info")
                     for part in Path(p).parts)]
    assert not leaked, f".dockerignore lets {sorted(leaked)[:5]} into the image"


def test_every_copy_source_exists_and_is_in_the_context(dockerfile, build_context):
    copies = instructions(dockerfile, "COPY")
    assert copies, "the Dockerfile copies nothing"
    for value in copies:
        *sources, _dest = value.split()
        for src in sources:
            if src == ".":
                continue
            assert (REPO / src).exists(), f"COPY {src}: no such file"
            assert src in build_context, f"COPY {src}: excluded by .dockerignore"


def test_entrypoint_runs_train_py_from_the_workdir(dockerfile):
    (entry,) = instructions(dockerfile, "ENTRYPOINT")
    argv = json.loads(entry)  # exec form, so signals reach python (PID 1) directly
    assert argv[0] == "python" and len(argv) == 2
    workdir = instructions(dockerfile, "WORKDIR")[-1]
    # `COPY . .` puts the repository root at WORKDIR, so the script is that path there
    assert ". ." in [v.strip() for v in instructions(dockerfile, "COPY")]
    assert (REPO / argv[1]).is_file(), f"ENTRYPOINT runs {workdir}/{argv[1]}: not in the repo"


def test_installed_extras_exist_in_pyproject(dockerfile):
    extras = PYPROJECT["project"]["optional-dependencies"]
    named = [e for run in instructions(dockerfile, "RUN")
             for group in re.findall(r"\.\[([\w,-]+)\]", run) for e in group.split(",")]
    assert "gpu" in named, "the image must install the gpu extra (flash-attn, torchao)"
    for extra in named:
        assert extra in extras, (
            f"the Dockerfile installs .[{extra}], pyproject.toml has no such extra"
        )


def test_pinned_gpu_packages_satisfy_pyproject(dockerfile):
    """The versions the image pins must be ones pyproject accepts, or `pip install -e
    '.[gpu]'` would try to replace them (flash-attn then rebuilt in build isolation)."""
    args = stage_args(dockerfile)
    pins = {"flash-attn": args["FLASH_ATTN_VERSION"], "torchao": args["TORCHAO_VERSION"]}
    gpu = {
        Requirement(r).name: Requirement(r)
        for r in PYPROJECT["project"]["optional-dependencies"]["gpu"]
    }
    for name, version in pins.items():
        assert name in gpu, f"{name} is pinned in the Dockerfile but not in the gpu extra"
        assert gpu[name].specifier.contains(Version(version)), (name, version, str(gpu[name]))


def test_torch_pin_is_readmes_and_the_base_images(dockerfile):
    readme = (REPO / "README.md").read_text()
    readme_pins = set(re.findall(r"pip install torch==([\w.]+)", readme))
    assert len(readme_pins) == 1, readme_pins
    (readme_torch,) = readme_pins
    args = global_args(dockerfile)
    assert args["TORCH_VERSION"] == readme_torch
    base = args["BASE_IMAGE"].replace("${TORCH_VERSION}", args["TORCH_VERSION"])
    assert base.startswith(f"pytorch/pytorch:{readme_torch}-cuda") and base.endswith("-devel")
    assert instructions(dockerfile, "FROM") == ["${BASE_IMAGE}"]  # the image built FROM
    torch_req = next(Requirement(r) for r in PYPROJECT["project"]["dependencies"]
                     if r.startswith("torch"))
    assert torch_req.specifier.contains(Version(readme_torch))


def test_pip_is_constrained_to_the_base_torch_before_any_install(dockerfile):
    """PIP_CONSTRAINT is set before the first `pip install`, and the file it names is the
    one the check of the base image's torch writes."""
    steps = [(i["instruction"], i["value"]) for i in dockerfile.structure]
    env_at = next(n for n, (ins, value) in enumerate(steps)
                  if ins == "ENV" and value.startswith("PIP_CONSTRAINT="))
    installs = [n for n, (ins, value) in enumerate(steps)
                if ins == "RUN" and "pip install" in value]
    assert installs and env_at < min(installs)
    target = steps[env_at][1].split("=", 1)[1]
    assert any(f"> {target}" in value and "torch==" in value
               for ins, value in steps[:env_at] if ins == "RUN")


def test_flash_attn_builds_against_the_installed_torch(dockerfile):
    (run,) = [v for v in instructions(dockerfile, "RUN") if "flash-attn==" in v]
    assert "--no-build-isolation" in run and "MAX_JOBS=" in run
    # its build requirements are installed first, since build isolation is off
    assert run.index("ninja") < run.index("flash-attn==")


def test_gpu_environment_sets_the_allocator_and_the_flight_recorder(dockerfile):
    """expandable_segments in the image and the sbatch job (parallel=auto's headroom assumes
    it); the NCCL flight recorder dumps into the run directory when a collective times out."""
    assert dockerfile.envs.get("PYTORCH_CUDA_ALLOC_CONF") == "expandable_segments:True"
    sbatch = (REPO / "slurm" / "train.sbatch").read_text()
    for line in ("PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}",
                 "TORCH_NCCL_TRACE_BUFFER_SIZE=", "TORCH_NCCL_DUMP_ON_TIMEOUT=${",
                 "TORCH_FR_DUMP_TEMP_FILE=${TORCH_FR_DUMP_TEMP_FILE:-${RUN_DIR:-.}/"):
        assert f"export {line}" in sbatch, line
