"""Where metrics go: the console (or a progress bar), metrics.jsonl and wandb."""

from __future__ import annotations

import json
import logging
import secrets
import string
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("pretrain")

# The run directory's wandb run id, kept beside metrics.jsonl.
WANDB_ID = "wandb_id"


def wandb_run_id(run_dir: Path, fresh: bool) -> str:
    """The wandb run id of ``run_dir``: made on a fresh start (step 0) and kept in
    ``<run_dir>/wandb_id``, read back by every later attempt (a resumed or requeued run), so
    one training run is one wandb run however often its job restarts. A fresh start in an
    existing run directory is a new training run and gets a new id, as its metrics.jsonl
    starts afresh: its steps would restart below the old run's, which wandb drops."""
    path = run_dir / WANDB_ID
    if not fresh and path.exists():
        run_id = path.read_text().strip()
        if run_id:
            return run_id
    # wandb's own form: 8 characters of [a-z0-9]
    run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    tmp = path.with_name(WANDB_ID + ".tmp")
    tmp.write_text(run_id + "\n")
    tmp.replace(path)
    return run_id


def format_metrics(m: dict[str, Any]) -> str:
    parts = [f"step {m['step']}/{m['total_steps']}"]
    fmt = {
        "loss": "loss {:.4f}", "val_loss": "val_loss {:.4f}", "lr": "lr {:.2e}",
        "grad_norm": "gnorm {:.3f}", "tokens_per_s": "{:,.0f} tok/s", "mfu": "MFU {:.1%}",
        "memory_gb": "mem {:.2f} GB", "memory_reserved_gb": "reserved {:.2f} GB",
        "loss_scale": "scale {:g}",
        "noise_scale": "noise scale {:,.0f} tok",
    }
    for key, f in fmt.items():
        if m.get(key) is not None:
            parts.append(f.format(m[key]))
    if m.get("skipped_steps"):
        parts.append(f"{m['skipped_steps']} skipped")
    return " | ".join(parts)


class MetricsLogger:
    """Only rank 0 creates one with ``enabled=True``; the others log nothing."""

    def __init__(self, run_dir: Path, config: dict, total_steps: int, start_step: int,
                 wandb_mode: str, project: str, entity: str | None,
                 progress_bar: bool | None, enabled: bool = True):
        self.enabled = enabled
        self.total_steps = total_steps
        self.wandb = None
        self.bar = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        if start_step == 0 and self.path.exists():
            # A fresh start in an existing run directory: keep the old metrics, aside.
            n = 1
            while (run_dir / f"metrics.{n}.jsonl").exists():
                n += 1
            self.path.rename(run_dir / f"metrics.{n}.jsonl")
        self.file = self.path.open("a")
        if wandb_mode != "disabled":
            import wandb

            # resume="allow": the first attempt creates the run, the later ones continue it
            self.wandb = wandb.init(project=project, entity=entity, dir=str(run_dir),
                                    mode=wandb_mode, name=run_dir.name, config=config,
                                    id=wandb_run_id(run_dir, fresh=start_step == 0),
                                    resume="allow")
        if progress_bar is None:
            progress_bar = sys.stderr.isatty()
        if progress_bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def log(self, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        metrics = {"total_steps": self.total_steps, **metrics}
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in metrics.items() if k != "step"},
                           step=metrics["step"])
        line = format_metrics(metrics)
        if self.bar is not None:
            from tqdm.contrib.logging import logging_redirect_tqdm

            # The console handler writes through tqdm so the bar stays at the bottom; the
            # log file (Hydra's train.log) still gets the line.
            with logging_redirect_tqdm(loggers=[logging.getLogger()]):
                log.info(line)
        else:
            log.info(line)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()
