"""Launching a recipe as a library: ``local`` (torchrun on this machine, as many processes
as the layout needs) and ``slurm`` (sbatch scripts, allocations, the data-preparation job
chain). Both ask parallel/layout.py for the world size; the tools in src/pretrain/tools are
thin command lines over them."""

from pretrain.errors import UserError


class LaunchError(UserError, ValueError):
    """The recipe's layout and the requested processes or allocation disagree."""
