"""Slurm launching as a library: the allocation a recipe's layout needs (nodes x GPUs per
node = the world size of parallel/layout.py, tensor parallelism inside a node), the sbatch
script rendered from slurm/train.sbatch, and the data-preparation job chain submitted before
training when the data is not prepared. ``tools/launch.py`` (``pretrain-launch``) is the
command line over it; see its docstring for the whole story.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from pretrain.config.paths import REPO
from pretrain.config.schema import Config
from pretrain.errors import UserError
from pretrain.launch import LaunchError
from pretrain.parallel.layout import layout_world_size, model_parallel_size

TEMPLATE = REPO / "slurm" / "train.sbatch"
PREPARE_TEMPLATE = REPO / "slurm" / "prepare.sbatch"
PREPARE_PY = REPO / "tools" / "prepare_data.py"


@dataclass(frozen=True)
class Allocation:
    nodes: int
    procs_per_node: int
    gpus_per_node: int  # 0 on CPU nodes

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


def allocation(cfg: Config, nodes: int | None = None, gpus_per_node: int | None = None
               ) -> Allocation:
    """Nodes and processes per node for the recipe's layout; LaunchError on a mismatch."""
    cl, par = cfg.cluster, cfg.parallel
    nodes = nodes if nodes is not None else cl.nodes
    gpn = gpus_per_node if gpus_per_node is not None else cl.gpus_per_node
    model_parallel = model_parallel_size(par)
    if nodes is not None and nodes < 1:
        raise LaunchError(f"--nodes {nodes}: need at least one node")
    if gpn < 0:
        raise LaunchError(f"--gpus-per-node {gpn} is negative")
    layout = f"tp={par.tp} x pp={par.pp} x dp={par.dp}"
    if gpn > 0:
        if gpn % par.tp:
            raise LaunchError(
                f"{gpn} GPUs per node is not a multiple of parallel.tp={par.tp}: tensor "
                f"parallelism must stay inside a node (its all-reduces need NVLink); use "
                f"--gpus-per-node {par.tp * max(gpn // par.tp, 1)} or a smaller tp")
        if par.dp is None:  # data parallel over whatever the allocation holds
            nodes = nodes or 1
            world = nodes * gpn
            if world % model_parallel:
                raise LaunchError(
                    f"{nodes} node(s) x {gpn} GPUs = {world} is not a multiple of tp x pp = "
                    f"{model_parallel} (parallel.dp=null takes dp = world / (tp x pp))")
            return Allocation(nodes, gpn, gpn)
        world = layout_world_size(par)
        if nodes is None:
            if world <= gpn:  # a job smaller than one node
                return Allocation(1, world, world)
            if world % gpn:
                raise LaunchError(
                    f"the layout {layout} needs {world} GPUs, not a multiple of {gpn} GPUs "
                    f"per node; change --gpus-per-node or parallel.dp")
            return Allocation(world // gpn, gpn, gpn)
        if nodes * gpn != world:
            raise LaunchError(
                f"--nodes {nodes} x --gpus-per-node {gpn} = {nodes * gpn} GPUs, but the "
                f"layout {layout} needs {world} (one process per GPU): "
                + (f"use --nodes {world // gpn}" if world % gpn == 0 else
                   f"{world} is not a multiple of {gpn}, change parallel.dp"))
        return Allocation(nodes, gpn, gpn)
    # CPU nodes: processes with gloo, as many as the layout (or procs_per_node) says
    nodes = nodes or 1
    if par.dp is None:
        if not cl.procs_per_node:
            raise LaunchError("parallel.dp=null on CPU nodes: set cluster.procs_per_node")
        world = nodes * cl.procs_per_node
        if world % model_parallel:
            raise LaunchError(f"{world} processes are not a multiple of tp x pp = {model_parallel}")
        return Allocation(nodes, cl.procs_per_node, 0)
    world = layout_world_size(par)
    if world % nodes:
        raise LaunchError(f"the layout {layout} has {world} processes, which {nodes} nodes "
                          "cannot share evenly")
    per_node = world // nodes
    if cl.procs_per_node and cl.procs_per_node != per_node:
        raise LaunchError(f"cluster.procs_per_node={cl.procs_per_node} but the layout {layout} "
                          f"on {nodes} node(s) needs {per_node}")
    return Allocation(nodes, per_node, 0)


def whole_nodes(cfg: Config, alloc: Allocation) -> bool:
    """Whether the job takes its nodes whole: every GPU of each (cluster.gpus_per_node), or
    CPU nodes. A job smaller than a GPU node shares it, with the CPUs Slurm gives it there
    (the site's DefCpuPerGPU, or cluster.cpus_per_task)."""
    return not alloc.gpus_per_node or alloc.gpus_per_node >= cfg.cluster.gpus_per_node


def cpus_per_task(cfg: Config) -> str:
    """torchrun's CPUs on each node, for srun (train.sbatch's CPUS_PER_TASK): the number
    asked for, else all the job has on the node (every core, with --exclusive)."""
    cpus = cfg.cluster.cpus_per_task
    return str(cpus) if cpus else "${SLURM_CPUS_ON_NODE:-1}"


def sbatch_lines(cfg: Config, alloc: Allocation, run_dir: Path, workdir: Path) -> list[str]:
    cl = cfg.cluster
    opts = [f"--job-name={cfg.run_name[:60]}", f"--nodes={alloc.nodes}",
            f"--time={cl.time}", f"--signal=B:USR1@{cl.signal_seconds}",
            f"--output={run_dir}/slurm-%j.out", f"--chdir={workdir}"]
    if alloc.gpus_per_node:
        opts.append(f"--gpus-per-node={alloc.gpus_per_node}")
    if cl.cpus_per_task:
        opts.append(f"--cpus-per-task={cl.cpus_per_task}")
    elif whole_nodes(cfg, alloc):
        opts.append("--exclusive")  # every core of each node (srun: SLURM_CPUS_ON_NODE)
    for key in ("partition", "account", "qos", "mem"):
        value = getattr(cl, key)
        if value is not None:
            opts.append(f"--{key}={value}")
    opts += list(cl.sbatch_extra)
    return [f"#SBATCH {o}" for o in opts]


@dataclass(frozen=True)
class Container:
    """The image each node's torchrun runs in (slurm/train.sbatch's variables of that name)."""

    image: str | None = None  # pyxis/enroot: srun --container-image
    apptainer_image: str | None = None  # Apptainer/Singularity .sif: apptainer exec --nv
    mounts: str | None = None  # more SRC:DST[:FLAGS],... besides the work, code and run dirs

    def __post_init__(self):
        if self.image and self.apptainer_image:
            raise LaunchError("--container-image (pyxis) and --apptainer-image exclude each "
                              "other: pick one")
        if self.mounts and not (self.image or self.apptainer_image):
            raise LaunchError("--container-mounts needs --container-image or --apptainer-image")

    def __bool__(self) -> bool:
        return bool(self.image or self.apptainer_image)

    def lines(self) -> list[str]:
        q = shlex.quote
        return [f"{var}={q(value)}" for var, value in (
            ("CONTAINER_IMAGE", self.image), ("APPTAINER_IMAGE", self.apptainer_image),
            ("CONTAINER_MOUNTS", self.mounts)) if value]


def settings_lines(cfg: Config, alloc: Allocation, run_dir: Path, overrides: list[str],
                   container: Container = Container()) -> list[str]:
    cl = cfg.cluster
    q = shlex.quote
    # In a container the image's interpreter runs, not the one running this tool.
    python = cl.python or ("python" if container else sys.executable)
    lines = [
        f"RUN_DIR={q(str(run_dir))}",
        f"NPROC_PER_NODE={alloc.procs_per_node}",
        f"CPUS_PER_TASK={cpus_per_task(cfg)}",
        f"PYTHON={q(python)}",
        f"TRAIN_PY={q(str(REPO / 'train.py'))}",
        f"SHUTDOWN_TIMEOUT={cl.shutdown_timeout_s}",
        f"MAX_REQUEUES={cl.max_requeues}",
        f"MAX_NODE_LOSSES={cl.max_node_losses}",
        # dp=null: the world size follows the nodes, so a run that lost one goes on without it
        f"ELASTIC={int(cfg.parallel.dp is None)}",
        "TRAIN_ARGS=(" + " ".join(q(o) for o in overrides) + ")",
    ]
    if cl.rdzv_port:
        lines.append(f"RDZV_PORT={cl.rdzv_port}")
    lines += container.lines()
    lines += [f"export {k}={q(str(v))}" for k, v in cl.env.items()]
    lines += list(cl.setup)
    return lines


def fill(template: Path, sbatch: list[str], settings: list[str]) -> str:
    """``template`` with its #SBATCH lines and settings filled in."""
    text = template.read_text()
    for marker, lines in (("#@SBATCH_LINES@", sbatch), ("#@SETTINGS@", settings)):
        if marker not in text:
            raise RuntimeError(f"{template} lost its {marker} line")
        text = text.replace(marker, "\n".join(lines))
    return text


def render(cfg: Config, alloc: Allocation, run_dir: Path, overrides: list[str],
           workdir: Path, container: Container = Container()) -> str:
    """slurm/train.sbatch with its #SBATCH lines and settings filled in."""
    return fill(TEMPLATE, sbatch_lines(cfg, alloc, run_dir, workdir),
                settings_lines(cfg, alloc, run_dir, overrides, container))


# -- data preparation as jobs the training job depends on ----------------------------------

def data_prepared(cfg: Config) -> bool:
    """Whether the training job can start without preparation jobs before it (seen from
    here: the jobs run in this directory, on shared storage)."""
    from pretrain.data.prepare import needs_preparation

    return not needs_preparation(cfg.data)


def prepare_script(cfg: Config, overrides: list[str], workdir: Path) -> str:
    """slurm/prepare.sbatch filled in: one script, submitted once per stage."""
    cl = cfg.cluster
    q = shlex.quote
    opts = [f"--chdir={workdir}", f"--time={cl.prepare_time or cl.time}",
            f"--cpus-per-task={cl.prepare_cpus_per_task}"]
    for key, value in (("partition", cl.prepare_partition or cl.partition),
                       ("account", cl.account), ("qos", cl.qos), ("mem", cl.prepare_mem)):
        if value is not None:
            opts.append(f"--{key}={value}")
    settings = [f"PYTHON={q(cl.python or sys.executable)}", f"PREPARE_PY={q(str(PREPARE_PY))}",
                "PREPARE_ARGS=(" + " ".join(q(o) for o in overrides) + ")"]
    settings += [f"export {k}={q(str(v))}" for k, v in cl.env.items()]
    settings += list(cl.setup)
    return fill(PREPARE_TEMPLATE, [f"#SBATCH {o}" for o in opts], settings)


def prepare_jobs(cfg: Config, run_dir: Path, script: Path) -> list[tuple[str, list[str]]]:
    """(stage, its sbatch arguments) in order: plan, an encode array, merge."""
    if cfg.cluster.prepare_tasks < 1:
        raise LaunchError(f"cluster.prepare_tasks={cfg.cluster.prepare_tasks}: need at least 1")
    name = cfg.run_name[:50]
    tasks = cfg.cluster.prepare_tasks
    return [
        ("plan", [f"--job-name=prep-plan-{name}",
                  f"--output={run_dir}/prepare-plan-%j.out", str(script), "plan"]),
        ("encode", [f"--job-name=prep-encode-{name}", f"--array=0-{tasks - 1}",
                    f"--output={run_dir}/prepare-encode-%A_%a.out", str(script), "encode"]),
        ("merge", [f"--job-name=prep-merge-{name}",
                   f"--output={run_dir}/prepare-merge-%j.out", str(script), "merge"]),
    ]


def after(job: str | None) -> list[str]:
    """sbatch options to start after ``job`` succeeded, and to be cancelled if it fails
    (without --kill-on-invalid-dep the job would wait forever: DependencyNeverSatisfied)."""
    return [f"--dependency=afterok:{job}", "--kill-on-invalid-dep=yes"] if job else []


class SubmitError(UserError, RuntimeError):
    pass


def sbatch(args: list[str]) -> str:
    """Submit; the job id (sbatch --parsable prints ``id`` or ``id;cluster``)."""
    proc = subprocess.run(["sbatch", "--parsable", *args], stdout=subprocess.PIPE, text=True,
                          env=os.environ)
    job = proc.stdout.strip().split(";")[0]
    if proc.returncode or not job:
        raise SubmitError(f"sbatch {' '.join(args)} failed (exit {proc.returncode})")
    return job


def submit_preparation(jobs: list[tuple[str, list[str]]]) -> list[str]:
    """Submit the chain; on a failed submission cancel what was submitted, and raise."""
    ids: list[str] = []
    try:
        for _, args in jobs:
            ids.append(sbatch([*after(ids[-1] if ids else None), *args]))
    except SubmitError:
        if ids:
            subprocess.run(["scancel", *ids], env=os.environ)
        raise
    return ids


def describe_preparation(jobs: list[tuple[str, list[str]]], train_script: Path) -> str:
    """What the chain would submit, as shell lines (for --dry-run)."""
    def line(args: list[str]) -> str:  # the dependency names a shell variable: unquoted
        return " ".join(a if a.startswith("--dependency=") else shlex.quote(a)
                        for a in ["sbatch", "--parsable", *args])

    lines, prev = [], None
    for stage, args in jobs:
        lines.append(f"{stage}=$({line([*after(prev), *args])})")
        prev = f"${stage}"
    lines.append(line([*after(prev), str(train_script)]))
    return "\n".join(lines)


def submit(cfg: Config, run_dir: Path, path: Path, prep_jobs: list[tuple[str, list[str]]],
           summary: str, wait: bool) -> int:
    """Submit the preparation chain (if any), then the training job after it; the
    training job's sbatch exit code."""
    where = Path(cfg.data.root) / cfg.data.name
    depend: list[str] = []
    if prep_jobs:
        try:
            plan, encode, merge = submit_preparation(prep_jobs)
        except SubmitError as e:
            print(f"launch: {e}; nothing is queued", file=sys.stderr)
            return 1
        print(f"{where} is not prepared: preparation jobs plan {plan}, encode {encode} "
              f"(array of {cfg.cluster.prepare_tasks}), merge {merge}\n"
              f"  logs   {run_dir}/prepare-*.out")
        depend = after(merge)
    cmd = ["sbatch", "--parsable", *depend, *(["--wait"] if wait else []), str(path)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=os.environ)
    job = proc.stdout.strip().split(";")[0]
    if job:
        print(f"submitted job {job}: {summary}"
              + (f", after preparation job {merge}" if prep_jobs else "")
              + f"\n  script {path}\n  log    {run_dir}/slurm-{job}.out")
    elif prep_jobs:  # the training job was refused: its preparation is of no use queued
        subprocess.run(["scancel", plan, encode, merge], env=os.environ)
    return proc.returncode
