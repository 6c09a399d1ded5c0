"""Submit a recipe to SLURM: nodes and GPUs from its layout, the sbatch script in its run dir.

    python tools/launch.py +recipe=gpt3-175b --dry-run          # print the script
    python tools/launch.py +recipe=ladder-chinchilla model=gpt3-1.3b --nodes 4
    python tools/launch.py +recipe=tiny-zero3 cluster=local      # CPU processes (gloo)
    python tools/launch.py +recipe=NAME --partition gpu --account proj --time 48:00:00
    python tools/launch.py +recipe=NAME --container-image nvcr.io#you/pretrain-recipes:tag
    python tools/launch.py +recipe=NAME --apptainer-image /shared/pretrain-recipes.sif

The config is composed exactly as train.py composes it (cluster defaults from
conf/cluster/, picked with ``cluster=NAME``). The layout decides the world size
tp * pp * dp; the cluster (or --nodes / --gpus-per-node) decides how it is spread, and the
two must agree: nodes x GPUs per node = world size, tensor parallelism inside a node.
A layout with ``parallel.dp=null`` takes its world size from --nodes x --gpus-per-node.
slurm/train.sbatch is rendered into ``<run dir>/train.sbatch`` with the settings filled in
and submitted with sbatch (``--dry-run`` prints it and writes nothing). With a container
image (pyxis or Apptainer, docs/docker.md) every node runs torchrun inside it, with the
image's ``python``.

Data first: when the recipe's data is not prepared yet (no index.json with its fingerprint
under ``<data.root>/<data.name>/``), slurm/prepare.sbatch is rendered beside it and
submitted as a chain the training job waits for (``--dependency=afterok``): a plan job, an
array of ``cluster.prepare_tasks`` encode tasks, a merge job (``cluster.prepare_*`` set the
partition, CPUs, time and memory). So one command still does everything, and the GPUs wait
in the queue, not idle in a job, while the CPUs tokenize. ``--no-prepare`` skips this (the
first rank then prepares on first use, as train.py does); prepared data submits nothing
extra. The preparation runs outside any container, with the interpreter running this tool
(or ``cluster.python``).
"""


from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pretrain.config.compose import compose_config
from pretrain.config.schema import ConfigError
from pretrain.decision.checks import check
from pretrain.errors import cli, report
from pretrain.launch.slurm import (
    Container,
    LaunchError,
    allocation,
    data_prepared,
    describe_preparation,
    prepare_jobs,
    prepare_script,
    render,
    submit,
)
from pretrain.parallel.layout import derived_dp


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    ap.add_argument("--nodes", type=int)
    ap.add_argument("--gpus-per-node", type=int)
    ap.add_argument("--partition")
    ap.add_argument("--account")
    ap.add_argument("--time")
    # Defaults from the environment: sbatch passes it on to the job, which would see them.
    ap.add_argument("--container-image", default=os.environ.get("CONTAINER_IMAGE") or None,
                    help="pyxis/enroot image for srun --container-image (an enroot URI such "
                         "as nvcr.io#org/image:tag, or a .sqsh file); $CONTAINER_IMAGE")
    ap.add_argument("--apptainer-image", default=os.environ.get("APPTAINER_IMAGE") or None,
                    help="Apptainer/Singularity .sif for apptainer exec --nv; $APPTAINER_IMAGE")
    ap.add_argument("--container-mounts", default=os.environ.get("CONTAINER_MOUNTS") or None,
                    help="more SRC:DST[:FLAGS],... mounts (data, caches); the work, code and "
                         "run directories are mounted at their own paths already")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the script (stdout) and any preparation jobs (stderr); submit "
                         "nothing")
    ap.add_argument("--no-prepare", action="store_true",
                    help="submit no preparation jobs even when the data is not prepared")
    ap.add_argument("--wait", action="store_true", help="sbatch --wait: return the job's exit code")
    return ap.parse_intermixed_args(argv)  # overrides before, between or after the flags


@cli
def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    overrides = list(args.overrides)
    for key in ("partition", "account", "time"):  # the flags are cluster.* overrides
        if getattr(args, key) is not None:
            overrides.append(f"cluster.{key}={getattr(args, key)}")
    cfg = compose_config(overrides)
    try:
        container = Container(args.container_image, args.apptainer_image, args.container_mounts)
        alloc = allocation(cfg, args.nodes, args.gpus_per_node)
        check(cfg, alloc.world_size)
    except (LaunchError, ConfigError) as e:
        return report(e)
    workdir = Path.cwd()
    run_dir = (workdir / cfg.runs_dir / cfg.run_name).resolve()
    script = render(cfg, alloc, run_dir, overrides, workdir, container)
    kind = (
        f"{alloc.gpus_per_node} GPUs"
        if alloc.gpus_per_node
        else f"{alloc.procs_per_node} CPU processes"
    )
    summary = (f"{cfg.run_name}: {alloc.nodes} node(s) x {kind} = world size "
               f"{alloc.world_size} (tp={cfg.parallel.tp}, pp={cfg.parallel.pp}, "
               f"dp={derived_dp(cfg, alloc.world_size)})"
               + (f", in {container.image or container.apptainer_image}" if container else ""))
    path, prep_path = run_dir / "train.sbatch", run_dir / "prepare.sbatch"
    prep_jobs = (
        [] if args.no_prepare or data_prepared(cfg) else prepare_jobs(cfg, run_dir, prep_path)
    )
    if args.dry_run:
        print(script)
        print(f"# {summary}", file=sys.stderr)
        if prep_jobs:
            print(
                f"# {Path(cfg.data.root) / cfg.data.name} is not prepared: preparation jobs "
                "first, then training\n"
                + describe_preparation(prep_jobs, path)
                + f"\n# ---- {prep_path} ----\n"
                + prepare_script(cfg, overrides, workdir),
                file=sys.stderr,
            )
        return 0
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    if prep_jobs:
        prep_path.write_text(prepare_script(cfg, overrides, workdir))
    return submit(cfg, run_dir, path, prep_jobs, summary, args.wait)


if __name__ == "__main__":
    sys.exit(main())
