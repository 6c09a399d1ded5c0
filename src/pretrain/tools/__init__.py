"""The command-line tools, one module each, installed as ``pretrain-*`` commands
(pyproject.toml ``[project.scripts]``); ``python tools/X.py`` runs the same ``main``.

They need the repository checkout (conf/, slurm/, train.py), so the package is installed
editable from it: ``pip install -e .``.
"""
