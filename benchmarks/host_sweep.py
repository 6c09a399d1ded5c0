"""Steps of GPT variants at tools/host_time.py's shape, all built in this one process, their
blocks interleaved: how a step's host time on this CPU moves with the depth, the heads and
the channels a head, and with how many trainers were built before it (docs/planning.md,
"Host time outside the forward/backward region", says what it found).

    flock /tmp/pretrain-cpu.lock python benchmarks/host_sweep.py h2L2w8 h5L8w8 h2L16w2c

Each name is ``h<heads>L<layers>w<channels a head>``, ``c`` at the end for compiled; built in
the order given. Prints, per variant, ms a step and of it the forward/backward region,
clipping, the optimizer step and the rest (the fastest of ``--blocks`` blocks).
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path

import torch

from pretrain.config.compose import compose_config
from pretrain.planning.host_check import SHAPE
from pretrain.tools.host_time import QUIET, _timed


def overrides(name: str) -> list[str]:
    heads, layers, channels, compiled = re.fullmatch(r"h(\d+)L(\d+)w(\d+)(c?)", name).groups()
    return ["+recipe=tiny", f"model.n_layer={layers}", f"model.n_head={heads}", *SHAPE,
            f"model.d_model={int(heads) * int(channels)}",
            f"train.compile={str(bool(compiled)).lower()}"]


class Variant:
    def __init__(self, name: str, folder: Path, warmup: int):
        from pretrain.train.trainer import Trainer

        self.name = name
        self.trainer = Trainer(compose_config([*overrides(name), *QUIET]), folder)
        self.trainer.setup()
        for _ in range(warmup):
            self.trainer.train_step_local()
        module = self.trainer.module
        self.parts = {"region": _timed(module.strategy, "forward_backward"),
                      "clip": _timed(module, "_clipped_grad_norm"),
                      "update": _timed(module, "_update")}

    def block(self, steps: int) -> dict[str, float]:
        for seconds in self.parts.values():
            seconds[0] = 0.0
        t0 = time.perf_counter()
        for _ in range(steps):
            self.trainer.train_step_local()
        out = {"step": (time.perf_counter() - t0) / steps}
        out.update({k: v[0] / steps for k, v in self.parts.items()})
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="+")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        variants = [Variant(n, Path(tmp) / f"{i}-{n}", args.warmup)
                    for i, n in enumerate(args.names)]
        rounds = [[v.block(args.steps) for v in variants] for _ in range(args.blocks)]
    print("| variant | step ms | region | clip | update | rest |\n|---|---|---|---|---|---|")
    for v, blocks in zip(variants, zip(*rounds, strict=True), strict=True):
        b = min(blocks, key=lambda b: b["step"])
        rest = b["step"] - b["region"] - b["clip"] - b["update"]
        print(f"| {v.name} | " + " | ".join(f"{1e3 * x:.3f}" for x in (
            b["step"], b["region"], b["clip"], b["update"], rest)) + " |")


if __name__ == "__main__":
    main()
