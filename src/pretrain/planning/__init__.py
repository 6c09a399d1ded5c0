"""Plan before you spend: memory per GPU, time and cost to the token budget, and the choice
of a parallel layout (``parallel=auto``), all from the config alone, before any GPU is booked.

gpus (the GPU table), params (parameter shards per rank), activations (Korthikanti et al.
2022, itemised for this repository's model), memory (everything a rank holds), cost (step
time model), autolayout (the search), report (text for tools/plan.py).
"""
