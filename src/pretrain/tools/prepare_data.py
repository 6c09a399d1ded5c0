"""Tokenize a dataset into flat token shards once, ahead of training.

    python tools/prepare_data.py [overrides...] [--workers N]     the whole job, here
    python tools/prepare_data.py [overrides...] --stage plan      tokenizer + piece list
    python tools/prepare_data.py [overrides...] --stage encode --task K --of N
    python tools/prepare_data.py [overrides...] --stage merge     index.json, publish

With a mixture (data.mixture, e.g. +recipe=mixture-local) the whole job prepares every
source that says how it is built and is not prepared yet, with one tokenizer; the last
line is {"mixture": [per source: name, dir, bytes, seconds, tokens, prepared_now]}.

Overrides are train.py's (data=stdlib, data=local-text 'data.data_files=[corpus/*.jsonl]',
+recipe=gpt2-124m, ...); the output is <data.root>/<data.name>/, exactly what training would
prepare on first use. --workers defaults to data.num_proc. In the encode stage, --task and
--of default to SLURM_ARRAY_TASK_ID (minus SLURM_ARRAY_TASK_MIN) and SLURM_ARRAY_TASK_COUNT, so a
Slurm array runs it as

    sbatch --array=0-15 --wrap "python tools/prepare_data.py data=... --stage encode"

Task K encodes the pieces i with i % N == K; pieces already done are skipped, so a re-run
resumes. The output does not depend on N. Progress goes to stderr; the last line on stdout is
JSON. Exit code 2 with "error: ..." when the data or the settings are wrong; every stage is a
no-op when the data is already prepared with the same settings.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from pretrain.config.compose import compose_config
from pretrain.config.schema import DataConfig
from pretrain.data.mixture_prepare import prepare_mixture
from pretrain.data.prepare import (
    DataError,
    data_dir,
    encode,
    load_index,
    merge,
    plan,
    prepare,
)
from pretrain.errors import cli, report


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="tools/prepare_data.py", add_help=False)
    p.add_argument("-h", "--help", action="store_true")
    p.add_argument("--stage", choices=list(STAGES), default="all")
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--task", type=int, default=None)
    p.add_argument("--of", type=int, default=None)
    return p.parse_known_args(argv)


def env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def check_options(args: argparse.Namespace, overrides: list[str]) -> None:
    if args.stage != "encode" and (args.task is not None or args.of is not None):
        raise DataError("--task/--of belong to --stage encode")
    if args.workers is not None and (args.stage != "all" or args.workers < 1):
        raise DataError("--workers N (N >= 1) belongs to the whole job (no --stage)")
    unknown = [a for a in overrides if a.startswith("--")]
    if unknown:
        raise DataError(f"unknown option(s) {unknown}; see --help")


def array_task(args: argparse.Namespace) -> tuple[int, int]:
    """(K, N) of ``--stage encode``: --task/--of, else the Slurm array's."""
    task = args.task
    if task is None:  # an array may start at 1 (--array=1-16): count from its first id
        array_id = env_int("SLURM_ARRAY_TASK_ID")
        task = None if array_id is None else array_id - (env_int("SLURM_ARRAY_TASK_MIN") or 0)
    of = args.of if args.of is not None else env_int("SLURM_ARRAY_TASK_COUNT")
    if task is None or of is None:
        raise DataError("--stage encode needs --task K --of N (or SLURM_ARRAY_TASK_ID "
                        "and SLURM_ARRAY_TASK_COUNT in the environment)")
    return task, of


def print_prepared(cfg: DataConfig, out: Path | None) -> int:
    """The last stdout line of a finished job: where it is, its vocabulary and tokens."""
    index = load_index(out if out else data_dir(cfg))
    summary = {split: v["tokens"] for split, v in index["splits"].items()}
    print(json.dumps({"dir": str(out), "vocab_size": index["vocab_size"], "tokens": summary}))
    return 0


def run_all(cfg: DataConfig, args: argparse.Namespace) -> int:
    if cfg.mixture:  # every source not prepared yet, one tokenizer (data/mixture_prepare.py)
        sources = prepare_mixture(cfg, workers=args.workers)
        print(json.dumps({"mixture": sources}))
        return 0
    return print_prepared(cfg, prepare(cfg, workers=args.workers))


def run_plan(cfg: DataConfig, args: argparse.Namespace) -> int:
    staging = plan(cfg)
    print(json.dumps({"stage": "plan", "staging": str(staging) if staging else None,
                      "prepared": staging is None}))
    return 0


def run_encode(cfg: DataConfig, args: argparse.Namespace) -> int:
    summary = encode(cfg, *array_task(args))
    print(json.dumps({"stage": "encode", **(summary or {}), "prepared": summary is None}))
    return 0


def run_merge(cfg: DataConfig, args: argparse.Namespace) -> int:
    return print_prepared(cfg, merge(cfg))


STAGES = {"all": run_all, "plan": run_plan, "encode": run_encode, "merge": run_merge}


@cli
def main(argv: list[str] | None = None) -> int:
    args, overrides = parse(sys.argv[1:] if argv is None else argv)
    if args.help:
        print(__doc__)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        check_options(args, overrides)
        cfg = compose_config(overrides).data
        if cfg.mixture and args.stage != "all":
            raise DataError("a mixture is prepared as one job (no --stage); to prepare one "
                            "source by stages, give its own data settings (data=... "
                            "data.name=<source> data.tokenizer=<the shared tokenizer.json>)")
        return STAGES[args.stage](cfg, args)
    except DataError as e:
        return report(e)


if __name__ == "__main__":
    sys.exit(main())
