"""The training loader's throughput and host memory, as the trainer reads a recipe's data.

    python tools/bench_loader.py +recipe=mixture-local data.root=/work/data-shared \
        --batches 10000 --every 1000

It opens the recipe's prepared data the way the trainer does (a mixture: open_mixture with
the run's decided weights over steps; one corpus: TokenWindows) and reads ``--batches`` consecutive
batches of
the run's shape (train.global_batch_size samples of model.seq_len tokens, one process)
through the trainer's Prefetcher (a reader thread ``depth`` batches ahead), consuming each
batch as the trainer's step would receive it. Every ``--every`` batches it prints the
samples/s and tokens/s so far and the process's host memory: VmRSS, and its parts RssAnon
(heap: must stay flat) and RssFile (the memory-mapped shards' pages that were touched:
page cache, bounded by the shards' size, given back under memory pressure). With
``--trainer-tokens-per-s`` (the trainer's tokens/s, e.g. from tools/bench.py) it prints the
ratio. It prepares nothing (tools/prepare_data.py does). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from pretrain.config.compose import compose_config
from pretrain.data.errors import DataError
from pretrain.errors import cli, report


def memory() -> dict[str, float]:
    """This process's VmRSS, RssAnon and RssFile in MB (/proc/self/status)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = round(int(value.split()[0]) / 1024, 1)
    return out


def open_data(cfg):
    """The training windows the trainer would read (nothing is prepared here)."""
    if cfg.data.mixture:
        from pretrain.data.mixture_windows import open_mixture
        from pretrain.decision.resolve import resolve_plan

        return open_mixture(cfg, resolve_plan(cfg, world_size=1).decision.mixture_stages)
    from pretrain.data.loader import TokenWindows
    from pretrain.data.prepare import data_dir

    return TokenWindows(data_dir(cfg.data), "train", cfg.model.seq_len, seed=cfg.data.seed)


def run(cfg, batches: int, every: int, depth: int) -> dict:
    from pretrain.data.prefetch import Prefetcher

    data = open_data(cfg)
    batch, seq = cfg.train.global_batch_size, cfg.model.seq_len
    reader = Prefetcher(data, batch, batch, pin=False, depth=depth)
    rows = [{"batches": 0, **memory()}]
    print(json.dumps(rows[0]), file=sys.stderr)
    t0, checksum = time.perf_counter(), 0
    try:
        for b in range(batches):
            x, _ = reader.get(b * batch)
            checksum += int(x[0, 0])  # the batch is read and used
            if (b + 1) % every == 0 or b + 1 == batches:
                dt = time.perf_counter() - t0
                rows.append({"batches": b + 1, "s": round(dt, 2),
                             "samples_per_s": round((b + 1) * batch / dt),
                             "tokens_per_s": round((b + 1) * batch * seq / dt), **memory()})
                print(json.dumps(rows[-1]), file=sys.stderr)
    finally:
        reader.close()
    return {"batch": [batch, seq], "depth": depth, "rows": rows, "checksum": checksum,
            "loadavg": os.getloadavg()}


@cli
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools/bench_loader.py", description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=10_000)
    p.add_argument("--every", type=int, default=1000)
    p.add_argument("--depth", type=int, default=2, help="batches read ahead (the trainer's 2)")
    p.add_argument("--trainer-tokens-per-s", type=float, default=None)
    args, overrides = p.parse_known_args(argv)
    try:
        out = run(compose_config(overrides), args.batches, max(1, args.every), args.depth)
    except DataError as e:
        return report(e)
    last = out["rows"][-1]
    if args.trainer_tokens_per_s:
        out["ratio_to_trainer"] = round(last["tokens_per_s"] / args.trainer_tokens_per_s, 1)
    first_anon = out["rows"][0].get("RssAnon", 0)
    out["rss_anon_growth_mb"] = round(last.get("RssAnon", 0) - first_anon, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
