"""Time a checkpoint's save, its checksums and its load, on a real model size.

    python tools/bench_checkpoint.py                       # gpt2-124m, fp32 AdamW state
    python tools/bench_checkpoint.py model=gpt3-350m --dir /scratch/ckpt --repeat 3

Builds the model (one process, CPU) with AdamW state from one step, then times, best of
``--repeat``: ``dcp.save`` alone, the sha256 of the written files (what a save adds; an
async save does it in a worker thread, off the training thread), ``verify_checksums`` (what
a resume adds) and ``dcp.load``. Prints one JSON line; the size is the checkpoint's bytes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from pretrain.checkpoint.folder import own_checksums, verify_checksums
from pretrain.checkpoint.model_state import ModelOptimizer
from pretrain.config.compose import compose_config
from pretrain.errors import cli
from pretrain.model.gpt import build_model


def best_of(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=2)
    args, overrides = ap.parse_known_args(argv)
    cfg = compose_config(["model=gpt2-124m", "precision=fp32", *overrides])
    model = build_model(cfg, torch.device("cpu"), "sdpa", cfg.train.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    root = Path(tempfile.mkdtemp(dir=args.dir))
    path = root / "step_0000001"
    try:
        state = {"model_optim": ModelOptimizer(model, opt)}

        def save() -> None:
            shutil.rmtree(path, ignore_errors=True)
            dcp.save(state, checkpoint_id=str(path))

        save_s = best_of(args.repeat, save)
        sums: dict[str, str] = {}
        hash_s = best_of(args.repeat, lambda: sums.update(own_checksums(path, 0)))
        (path / "meta.json").write_text(json.dumps({"sha256": sums}))
        verify_s = best_of(args.repeat, lambda: verify_checksums(path))
        load_s = best_of(args.repeat, lambda: dcp.load(state, checkpoint_id=str(path)))
        size = sum(f.stat().st_size for f in path.iterdir() if f.name != "meta.json")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({
        "model": cfg.model.name, "checkpoint_gb": round(size / 1e9, 3),
        "save_s": round(save_s, 3), "checksum_s": round(hash_s, 3),
        "checksum_gb_per_s": round(size / 1e9 / hash_s, 2),
        "save_overhead": round(hash_s / save_s, 3), "verify_s": round(verify_s, 3),
        "load_s": round(load_s, 3), "load_overhead": round(verify_s / load_s, 3),
        "repeat": args.repeat}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
