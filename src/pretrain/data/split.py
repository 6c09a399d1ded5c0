"""Which documents are validation: a rule per piece, so it cannot depend on the workers.

Within piece i, document j (counting non-empty documents) is validation when
floor((j + 1) f + phase_i) > floor(j f + phase_i): evenly spaced, a fraction f of them, with
a phase seeded by (data.seed, i). The first piece's phase puts its first document in
validation, so even a tiny corpus has a validation document whenever f > 0.
"""

from __future__ import annotations

import math

import numpy as np


class ValidationRule:
    def __init__(self, fraction: float, seed: int, piece: int):
        self.fraction = fraction
        u = float(np.random.default_rng([seed, piece]).random())  # [0, 1)
        self.phase = 1.0 - fraction * (1.0 - u) if piece == 0 else u
        self.j = 0

    def next(self) -> bool:
        """Is the next document of the piece a validation one?"""
        if self.fraction <= 0:
            return False
        j, f, p = self.j, self.fraction, self.phase
        self.j += 1
        return math.floor((j + 1) * f + p) > math.floor(j * f + p)
