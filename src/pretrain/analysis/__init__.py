"""Analysis of finished runs: scaling-law fits and their predictions (``scaling``), plots
(``scaling_plot``), and the hyperparameter laws fitted to a sweep (``hparam_fit``). Used by
tools/scaling_law.py; training never imports it (the import-linter contract in
pyproject.toml says so)."""
