"""Train a recipe: ``python train.py +recipe=NAME key=value ...`` (see README.md).

Several processes: ``torchrun --nproc_per_node=N train.py +recipe=NAME`` (N = tp*pp*dp), or
``python tools/run_local.py +recipe=NAME``, which works N out from the recipe.
"""

import gc
import os
import sys
from contextlib import nullcontext

from pretrain.launch.lifeline import tie_rank_to_agent

tie_rank_to_agent()  # under torchrun: this rank dies with its agent, first thing

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from pretrain.config.naming import (  # noqa: E402
    check_override_keys,
    check_override_values,
    check_recipe_overrides,
    register_resolvers,
)
from pretrain.config.structured import register_configs, to_config  # noqa: E402
from pretrain.errors import exit_on_user_error  # noqa: E402

register_configs()
register_resolvers()
with exit_on_user_error():  # before Hydra reads a file or makes a directory
    check_recipe_overrides(sys.argv[1:])
    check_override_keys(sys.argv[1:])
    check_override_values(sys.argv[1:])  # Hydra's own errors (a missing option, a bad value)

if int(os.environ.get("RANK", "0")) > 0:
    # Under torchrun every rank composes the same config and the same run directory; only
    # rank 0 lets Hydra write there (.hydra/, train.log). The others log warnings to stderr.
    sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=none",
                 "hydra/hydra_logging=none"]


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from pretrain.train.fault_tolerant import run

    # What the imports made (torch's and the project's modules: some 300,000 objects, a full
    # collection 0.13 s) lives as long as the process: out of the collector's sight, no full
    # collection during the run walks it again, nor the one at exit (a 2-step run 7.3 ->
    # 5.8 s, docs/benchmarks.md "Garbage collection"). torchtitan's gc_freq and Megatron's
    # --manual-gc take the same cost out of the steps.
    gc.freeze()

    # The project's own errors (ConfigError, DataError, ...): one line each, exit 2; the
    # traceback with HYDRA_FULL_ERROR=1 (pretrain/errors.py). A sweep (-m) leaves a failed
    # point to Hydra, which runs the others of the batch and then names the failed job.
    single = HydraConfig.get().mode != RunMode.MULTIRUN
    with exit_on_user_error() if single else nullcontext():
        result = run(to_config(cfg), HydraConfig.get().runtime.output_dir)
    if result and result.get("exit_code"):
        # 75 (EX_TEMPFAIL): stopped by a signal or the time limit after saving a
        # checkpoint; slurm/train.sbatch requeues the job and the run resumes from it.
        sys.exit(result["exit_code"])


if __name__ == "__main__":
    main()
