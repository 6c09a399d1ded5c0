"""What a run measures and where it goes: the training loss between log lines
(``LossWindow``), throughput (``Throughput``), the MFU denominator (``PeakFlops``), memory,
and the sinks: the console (or a progress bar), metrics.jsonl and wandb."""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import string
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from pretrain.hardware.device import (
    cpu_native_matmul,
    gpu_peak_flops,
    measure_matmul_flops,
    peak_memory_bytes,
    peak_reserved_bytes,
    peak_rss_bytes,
)
from pretrain.precision.policy import choose_auto

log = logging.getLogger("pretrain")
# The measured CPU peak per (dtype, threads), for the life of the process.
_CPU_PEAKS: dict[tuple[torch.dtype, int], float] = {}
# CPU peaks a parent process measured already, handed down to the runs it starts: JSON
# {"float32/1": FLOP/s, ...} (dtype, "/", intra-op threads). A run finds its own there
# instead of timing matmuls for about 2 s of CPU at every start (the test session measures
# once for every process it starts, tests/conftest.py; issue 69). Unset, each process
# measures.
CPU_PEAKS_ENV = "PRETRAIN_CPU_PEAKS"


def peak_key(dtype: torch.dtype, threads: int) -> str:
    return f"{str(dtype).removeprefix('torch.')}/{threads}"


def inherited_peak(dtype: torch.dtype, threads: int) -> float | None:
    """The peak of ``dtype`` at ``threads`` threads that CPU_PEAKS_ENV hands down, if any."""
    handed = os.environ.get(CPU_PEAKS_ENV)
    return json.loads(handed).get(peak_key(dtype, threads)) if handed else None


class LossWindow:
    """The training loss since the last log line, kept on the device, so that steps between
    logs need neither an all-reduce nor a host sync for it: this rank's share summed over
    the steps whose update was taken (a step skipped for a non-finite gradient would turn
    the whole mean into NaN), and the last step's (the run's final loss)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.last = torch.full((), math.nan, device=device)
        self.final = math.nan  # the last step's global loss, as last reduced
        self.reset()

    def reset(self) -> None:
        self.total = torch.zeros((), device=self.device)
        self.counted = torch.zeros((), device=self.device)  # steps taken, on the device

    def add(self, loss: torch.Tensor, counted: torch.Tensor) -> None:
        """``counted``: a device bool, so that no step reads it on the host."""
        self.last = loss.float()
        self.total = self.total + torch.where(counted, self.last, 0.0)
        self.counted = self.counted + counted.float()

    def reduce(self, global_loss) -> float:
        """The mean loss over the window's counted steps, global (``global_loss``: the
        train module's all-reduce over the ranks); ``final`` becomes the last step's. One
        all-reduce and one host sync, on logging steps (every rank logs at the same steps).
        Starts a new window."""
        # every rank counted the same steps (the skip decision is global): not reduced
        total, self.final, counted = torch.cat([
            global_loss(torch.stack([self.total, self.last])), self.counted[None]]).tolist()
        self.reset()
        return total / counted if counted else math.nan


class Throughput:
    """Training steps and seconds since the last log line, for its tokens/s; time spent
    evaluating is not training throughput and is left out (``paused``)."""

    def __init__(self):
        self.restart()

    def restart(self) -> None:
        self.start, self.steps, self.tokens = time.perf_counter(), 0, 0

    def rate(self, tokens_per_step: int) -> float:
        """Tokens/s: ``tokens`` when the loop counts them (steps of changing size, a batch
        ramp), else ``steps`` of ``tokens_per_step``."""
        tokens = self.tokens or self.steps * tokens_per_step
        return tokens / (time.perf_counter() - self.start)

    @contextmanager
    def paused(self) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.start += time.perf_counter() - t0


def emulated_warning(name: str, dtype: torch.dtype, why: str, peak: float, fp32: float,
                     auto: str) -> str:
    """What running ``dtype`` matmuls without hardware support costs here, from the two
    measured rates (the same measurement for both)."""
    kind = str(dtype).removeprefix("torch.")
    if fp32 >= peak:
        cost = f"{fp32 / peak:.1f}x slower"
    else:  # emulation beat fp32 here: say so instead of a ratio below one
        cost = f"faster than fp32 here all the same ({peak / fp32:.1f}x)"
    return (f"precision={name} on a CPU without native {kind} matmuls ({why}): they run at "
            f"{peak / 1e9:.1f} GFLOP/s here against {fp32 / 1e9:.1f} for fp32, {cost}. Use "
            f"precision=auto ({auto} on this CPU) or precision=fp32.")


class PeakFlops:
    """The MFU denominator, per device: the datasheet peak of the compute dtype on a GPU
    (bf16's for fp8: ``GpuSpec.mfu_peak``), a measured large matmul on a CPU (one
    process's share of it when several share the CPU). Measured on rank 0 only
    (``measure``); ``value`` None elsewhere."""

    def __init__(self, device: torch.device, policy, world_size: int, measure: bool,
                 kept: Path | None = None):
        self.device, self.policy, self.world_size = device, policy, world_size
        self.kept = kept  # a file keeping the CPU peak for the run's later starts, or None
        self.value = self._measure() if measure else None

    def _kept(self) -> dict[str, float]:
        """The CPU peaks an earlier start of this run measured (``kept``): a torchft group
        coming back starts under nice (slurm/ft_group.sbatch), where a timing measures the
        leftovers (and a low peak is measured again later, at full priority, mid-run)."""
        return json.loads(self.kept.read_text()) if self.kept and self.kept.exists() else {}

    def _keep(self, key: tuple[torch.dtype, int]) -> None:
        if self.kept is not None:
            self.kept.parent.mkdir(parents=True, exist_ok=True)
            self.kept.write_text(json.dumps({**self._kept(), peak_key(*key): _CPU_PEAKS[key]}))

    def _measure(self) -> float | None:
        dtype = self.policy.compute_dtype
        if self.device.type == "cuda":
            return gpu_peak_flops(self.device, self.policy.peak_dtype)
        key = (dtype, torch.get_num_threads())
        kept = None
        if key not in _CPU_PEAKS:  # once per process: several runs in one (bench, tests)
            kept = inherited_peak(*key) or self._kept().get(peak_key(*key))
            _CPU_PEAKS[key] = kept or measure_matmul_flops(dtype, self.device)
        peak = _CPU_PEAKS[key]
        if kept is None:
            self._keep(key)
        log.info("CPU peak (measured %s matmul, best of 3 layouts, %d threads%s): %.1f GFLOP/s",
                 dtype, torch.get_num_threads(),
                 ", handed down or kept by an earlier start" if kept else "", peak / 1e9)
        native, why = cpu_native_matmul(dtype)
        if not native:  # named explicitly: run as asked, but say what it costs, once
            fp32_key = (torch.float32, torch.get_num_threads())
            if fp32_key not in _CPU_PEAKS:  # measured as the peak is, not a quicker probe
                _CPU_PEAKS[fp32_key] = (inherited_peak(*fp32_key)
                                        or measure_matmul_flops(torch.float32, self.device))
            log.warning(emulated_warning(self.policy.name, dtype, why, peak,
                                         _CPU_PEAKS[fp32_key], choose_auto(self.device)[0]))
        return peak

    def check(self, achieved: float) -> None:
        """A CPU peak below what the run achieves per process was measured while the machine
        was busy (a shared host): measure again, and keep the higher. MFU is never clipped;
        its denominator is fixed."""
        if self.device.type != "cpu" or not self.value:
            return
        if achieved <= self.world_size * self.value:
            return
        again = measure_matmul_flops(self.policy.compute_dtype, self.device)
        log.warning("the CPU peak measured at start (%.1f GFLOP/s) is below the %.1f GFLOP/s "
                    "this run achieves per process: it was measured while the machine was "
                    "busy; measured again: %.1f GFLOP/s", self.value / 1e9,
                    achieved / self.world_size / 1e9, again / 1e9)
        self.value = max(self.value, again)
        key = (self.policy.compute_dtype, torch.get_num_threads())
        _CPU_PEAKS[key] = max(_CPU_PEAKS.get(key, 0.0), self.value)
        self._keep(key)

    def mfu(self, achieved: float) -> float | None:
        """Model FLOPs utilisation of ``achieved`` FLOP/s over the whole run, per device:
        global throughput shared by world_size devices of this peak."""
        self.check(achieved)
        return achieved / (self.world_size * self.value) if self.value else None


def memory_metrics(device: torch.device, max_over_ranks) -> dict[str, float | None]:
    """Peak memory of the fullest rank (``max_over_ranks``: an in-place max all-reduce):
    allocated (CUDA) or peak RSS (CPU), and reserved by the caching allocator (CUDA)."""
    reserved = peak_reserved_bytes(device)
    cuda = device.type == "cuda"
    # the caching allocator's retries (a full cache freed and the allocation tried again: a
    # sign of fragmentation near the memory limit) and out-of-memory errors, since start
    stats = torch.cuda.memory_stats(device) if cuda else {}
    peak = torch.tensor([float(peak_memory_bytes(device)), float(reserved or 0),
                         float(stats.get("num_alloc_retries", 0)),
                         float(stats.get("num_ooms", 0))], device=device)
    allocated, reserved_max, retries, ooms = max_over_ranks(peak).tolist()
    return {"memory_gb": allocated / 1e9,
            "memory_reserved_gb": reserved_max / 1e9 if reserved is not None else None,
            **({"alloc_retries": int(retries), "ooms": int(ooms)} if cuda else {})}

# The run directory's wandb run id, kept beside metrics.jsonl.
WANDB_ID = "wandb_id"


def log_startup_memory(device: torch.device, max_over_ranks) -> None:
    """Peak host memory so far (model and optimizer state built, no step run): each rank
    holds O(its shard), never the whole model; the fullest rank is reported."""
    mine = float(peak_rss_bytes())
    most = max_over_ranks(torch.tensor(mine, device=device)).item()
    log.info("start-up peak host memory: %.2f GB on rank 0, %.2f GB on the fullest rank",
             mine / 1e9, most / 1e9)


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
        "step_time_s": "step {:.3f} s", "data_wait_share": "data wait {:.0%}",
    }
    for key, f in fmt.items():
        if m.get(key) is not None:
            parts.append(f.format(m[key]))
    for key, loss in m.items():  # validation per source: its loss, and bits per byte
        if key.startswith("val_loss/") and loss is not None:
            name = key.removeprefix("val_loss/")
            bpb = m.get(f"val_bpb/{name}")
            parts.append(f"val/{name} {loss:.4f}" + (f" ({bpb:.3f} bpb)" if bpb is not None
                                                       else ""))
    for key, acc in m.items():  # downstream tasks: accuracy (normalised) and answer bpb
        if key.startswith("task/") and key.endswith("/acc") and acc is not None:
            name = key.removeprefix("task/").removesuffix("/acc")
            norm, bpb = m.get(f"task/{name}/acc_norm"), m.get(f"task/{name}/bpb")
            parts.append(f"{name} acc {acc:.3f}" + (f" ({norm:.3f} norm)" if norm is not None
                                                    else "")
                         + (f" {bpb:.3f} bpb" if bpb is not None else ""))
    if m.get("slowest_rank") is not None:  # a straggler (train/services/step_monitor.py)
        parts.append(f"slowest rank {m['slowest_rank']} ({m['step_time_max_s']:.3f} s)")
    if m.get("alloc_retries"):
        parts.append(f"{m['alloc_retries']} alloc retries")
    if m.get("ooms"):
        parts.append(f"{m['ooms']} OOMs")
    if m.get("z_loss") is not None:
        parts.append(f"z_loss {m['z_loss']:.2e}")
    if m.get("skipped_steps"):
        parts.append(f"{m['skipped_steps']} skipped")
    if m.get("spike_skipped_steps"):
        parts.append(f"{m['spike_skipped_steps']} spikes skipped")
    loads = [v for k, v in m.items() if k.startswith("moe/max_load")]
    if loads:  # a mixture of experts: the busiest expert over the mean, worst layer
        parts.append(f"expert load {max(loads):.2f}x")
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
            # wandb's own name for the run (Run.id), which its folders need not spell out
            log.info("wandb run %s (%s) in %s", self.wandb.id, wandb_mode, self.wandb.dir)
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
