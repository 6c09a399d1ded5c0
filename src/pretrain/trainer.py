"""The one training loop every recipe runs, on one process or many.

A linear story: check the config, resolve the plan (budget, layout, device, precision,
attention), join the process group and build the device mesh (when launched by torchrun),
check the data is prepared (one process prepares it on first use; several processes never
tokenise), build the model on the meta device, parallelise and
materialise it, build optimizer and schedule, then loop: batch -> forward/backward
-> clip -> step -> log -> eval. The forward/backward and the evaluation forwards belong to
the step strategy chosen once at setup (src/pretrain/steps.py: gradient accumulation, or a
pipeline schedule), so nothing below asks which layout runs. Rank 0 alone logs and writes
files. Nothing here is specific to one recipe or one layout.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from omegaconf import OmegaConf

from pretrain.attention import resolve_backend
from pretrain.budget import Budget, resolve_budget
from pretrain.checkpoint import (
    CheckpointError,
    CheckpointManager,
    ModelOptimizer,
    describe_policy,
    newest_checkpoint,
    on_rank0,
    read_meta,
    resolve_checkpoint,
)
from pretrain.config import Config
from pretrain.data.epochs import check_epochs
from pretrain.data.loader import TokenWindows
from pretrain.data.prefetch import Prefetcher
from pretrain.data.prepare import DataError, data_dir, load_index, needs_preparation, prepare
from pretrain.device import (
    cpu_native_matmul,
    gpu_peak_flops,
    keep_freed_memory,
    measure_matmul_flops,
    peak_memory_bytes,
    peak_reserved_bytes,
    peak_rss_bytes,
    pick_device,
)
from pretrain.fp8 import after_optimizer_step, fp8_all_gather
from pretrain.garbage import GarbageCollection
from pretrain.hparams import apply_rules, describe, hparam_compute
from pretrain.initialization import local_region
from pretrain.metrics import MetricsLogger
from pretrain.model import GPT, set_attention_backend
from pretrain.noise_scale import SPIKE, NoiseScale, compare_batch
from pretrain.nonfinite import NonFiniteSteps, device_skip_supported, step_unless
from pretrain.optim import build_optimizer, build_scheduler, scaled_lr
from pretrain.parallel import mesh as dist_env
from pretrain.parallel.activation_checkpoint import describe as describe_checkpointing
from pretrain.parallel.apply import ParallelModel, materialize, parallelize_gpt
from pretrain.parallel.grad_clip import clip_grad_norm, global_grad_norm
from pretrain.parallel.layout import (
    Layout,
    declared_world_size,
    resolve_layout,
    world_size_from_env,
)
from pretrain.precision import Policy, choose_auto, resolve_auto_precision, resolve_policy
from pretrain.preemption import EXIT_REQUEUE, StopRequest
from pretrain.run_lock import RunLock
from pretrain.steps import ScaledLoss, step_strategy
from pretrain.validate import check

log = logging.getLogger("pretrain")
# The measured CPU peak per (dtype, threads), for the life of the process.
_CPU_PEAKS: dict[tuple[torch.dtype, int], float] = {}
# Written by rank 0 when a run stops early to be requeued (signal, time limit, exit_interval).
STOPPED = "stopped.json"


def require_prepared(cfg: Config) -> None:
    """A multi-process run reads prepared data and never tokenises: DataError, naming the
    command that prepares it, when there is none for this data config (with
    ``data.auto_prepare=false`` any prepared index at the path will do)."""
    path = data_dir(cfg.data)
    if not needs_preparation(cfg.data) and (path / "index.json").exists():
        return
    what = ("was prepared with other settings" if (path / "index.json").exists()
            else "holds no prepared data")
    raise DataError(
        f"{path} {what} (data.name={cfg.data.name}), and a multi-process run does not "
        f"prepare data: prepare it first with `python tools/prepare_data.py <the same "
        f"overrides>`, or start the run with `python tools/run_local.py` / "
        f"`tools/launch.py`, which prepare first")


def resolve_plan(cfg: Config, world_size: int | None = None
                 ) -> tuple[dict, Budget, torch.device, Policy]:
    """Everything a run decides before it starts, without touching data, weights or a
    process group. ``world_size`` None: the layout as declared (see validate.check)."""
    if world_size is None:
        world_size = declared_world_size(cfg)
    check(cfg, world_size)
    device = pick_device(cfg.train.device)
    cfg, auto_precision = resolve_auto_precision(cfg, device)
    policy = resolve_policy(cfg.precision, device)
    attention = resolve_backend(cfg.model.attention, device, policy.compute_dtype)
    budget = resolve_budget(cfg.model, cfg.budget, cfg.train.global_batch_size)
    plan = {
        **budget.as_dict(),
        "attention": attention,
        "precision": cfg.precision.name,
        "compile": cfg.train.compile,
        "layout": resolve_layout(cfg, world_size).as_dict(),
        "activation_checkpointing": describe_checkpointing(
            cfg.model, cfg.parallel.activation_checkpointing, cfg.parallel.ac_every_n_layers),
        "model": cfg.model.name,
        "data": cfg.data.name,
        **check_epochs(cfg.data, budget.tokens),
        "device": str(device),
        "lr": scaled_lr(cfg.optim, budget.global_batch_tokens),
        "checkpoint": describe_policy(cfg.checkpoint),
        "global_batch_size": cfg.train.global_batch_size,
        # C in DeepSeek's convention (non-embedding FLOPs/token x tokens), the x of the
        # hyperparameter rules (src/pretrain/hparams.py); tools/scaling_law.py --hparams
        # groups a sweep's runs by it
        "hparam_compute": hparam_compute(cfg)[0],
    }
    if auto_precision:
        plan["precision_auto"] = auto_precision
    if policy.fp8:
        plan["fp8"] = cfg.precision.fp8_recipe + (" (emulated)" if policy.fp8_emulate else "")
        if not cfg.train.compile and not policy.fp8_emulate:
            log.warning("precision=fp8 with train.compile=false: torchao's float8 casts run "
                        "as separate eager kernels, usually slower than bf16; set "
                        "train.compile=true (torchao's and torchtitan's advice)")
    if device.type == "cuda":
        plan["tf32"] = cfg.train.tf32
    return plan, budget, device, policy


def resolve_auto(cfg: Config, world_size: int) -> tuple[Config, dict]:
    """``cfg`` with every ``auto`` setting decided (precision from the device, then the
    layout, whose memory depends on it), and what was decided, for the plan. Deterministic
    per machine kind, so every rank decides the same."""
    notes: dict = {}
    cfg, why = resolve_auto_precision(cfg, pick_device(cfg.train.device))
    if why:
        notes["precision_auto"] = why
    # LR and batch from their rules before the layout: parallel=auto then lays out the
    # batch the rule gave (rounded to the declared micro batch x dp)
    cfg, rules = apply_rules(cfg, world_size)
    if rules:
        notes["hparam_rules"] = rules
    cfg, candidates = resolve_auto_layout(cfg, world_size)
    if candidates:
        notes["parallel_auto"] = [c.summary() for c in candidates[:5]]
    return cfg, notes


def resolve_auto_layout(cfg: Config, world_size: int) -> tuple[Config, list]:
    """``parallel=auto``: the layout chosen for this world size and device (unchanged
    otherwise). Deterministic, so every rank chooses the same one."""
    if cfg.parallel.name != "auto":
        return cfg, []
    from pretrain.planning.autolayout import resolve_auto
    from pretrain.planning.gpus import local_gpu

    return resolve_auto(cfg, world_size,
                        local_gpu(pick_device(cfg.train.device).type, world_size))


def build_model(cfg: Config, device: torch.device, attention: str, seed: int) -> GPT:
    """The whole model, initialised with ``seed``: constructed on the meta device (no
    memory), then materialised on ``device``. Every layout starts from these weights."""
    with torch.device("meta"):
        model = GPT(cfg.model)
    model.to_empty(device=device)
    model.tie_weights()
    model.init_weights(seed)
    set_attention_backend(model, attention, device)
    return model


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


class Throughput:
    """Training steps and seconds since the last log line, for its tokens/s; time spent
    evaluating is not training throughput and is left out (``paused``)."""

    def __init__(self):
        self.restart()

    def restart(self) -> None:
        self.start, self.steps = time.perf_counter(), 0

    def rate(self, tokens_per_step: int) -> float:
        return self.steps * tokens_per_step / (time.perf_counter() - self.start)

    @contextmanager
    def paused(self) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.start += time.perf_counter() - t0


class Trainer:
    """Runs one recipe. Also a DCP ``Stateful``: its progress (step, data position, LR
    schedule, loss scale, RNG) is saved and restored with the model and optimizer."""

    def __init__(self, cfg: Config, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.world_size = world_size_from_env()
        cfg, notes = resolve_auto(cfg, self.world_size)
        self.cfg = cfg
        self.plan, self.budget, self.device, self.policy = resolve_plan(cfg, self.world_size)
        self.plan.update(notes)
        self.layout: Layout = resolve_layout(cfg, self.world_size)
        self.step = 0
        self.samples_seen = 0
        self.nonfinite_in_a_row = 0
        self.skipped_steps = 0
        # the pipeline schedule's loss (fp16-scaled during its training steps): the
        # pipeline split is built around it, before the step strategy exists
        self.pipeline_loss = ScaledLoss()
        self.first_val_loss: float | None = None
        self.last_val_loss: float | None = None
        self.exit_code = 0
        self.noise = NoiseScale(cfg.train.noise_scale_ema)
        # Sequences per DP rank in the small batch of the noise scale (None: not measured),
        # and why not; the squared norms of a measuring step, kept on the device until the
        # logging step reads them.
        self.noise_small_seqs, self.noise_why_not = self.noise_scale_support()
        self._noise_sq: tuple[torch.Tensor, torch.Tensor] | None = None
        self.measuring = False  # the step now running measures the noise scale

    # -- setup ---------------------------------------------------------------------------

    def setup(self) -> None:
        """Everything before the first step, in order: join the process group, say what
        will run, read the data, build model, optimizer and step strategy, then continue
        from a checkpoint (or start afresh) and open the metrics."""
        self._join()
        self._describe_plan()
        self._load_data()
        self._build_training()
        self._start_run()

    def _join(self) -> None:
        """The process group and device mesh (several processes), this rank's place in
        them, and rank 0 as the one voice of the log."""
        lay = self.layout
        self.mesh = None
        if self.world_size > 1:
            require_prepared(self.cfg)  # before the process group: every rank fails at once
        # Mixed precision on one process too: FSDP2 over a DP group of one casts the
        # parameters (parallel/data_parallel.needs_wrapper), so it needs a group and mesh.
        if self.world_size > 1 or self.policy.mixed:
            self.device = dist_env.init_distributed(self.device)
            self.mesh = dist_env.build_mesh(lay, self.device)
        self.rank0 = dist_env.is_rank0()
        if not self.rank0:  # one voice: the other ranks report only warnings and errors
            log.setLevel(logging.WARNING)
        self.dp_rank = self.mesh.dp.get_local_rank() if self.mesh is not None else 0
        self.pp_group = self.mesh.pp.get_group() if self.mesh is not None and lay.pp > 1 else None
        if self.device.type == "cuda":
            # TF32 tensor cores for fp32 matmuls (10-bit mantissa products, fp32 accumulate),
            # as torchtitan and Megatron-LM do; train.tf32=false keeps full fp32.
            torch.set_float32_matmul_precision("high" if self.cfg.train.tf32 else "highest")

    def _describe_plan(self) -> None:
        """The plan, the decisions taken for ``auto`` settings and the run in one line."""
        cfg, budget, plan = self.cfg, self.budget, self.plan
        log.info("plan: %s", json.dumps(plan))
        if "precision_auto" in plan:
            log.info("precision=auto -> %s", plan["precision_auto"])
        if "hparam_rules" in plan:
            log.info(describe(plan["hparam_rules"]))
        self._describe_noise_scale()
        log.info(
            "model %s: %s params (%s non-embedding%s), %s FLOPs/token | budget %s -> %s tokens "
            "in %d steps of %s tokens | precision %s | attention %s%s | layout %s | device %s",
            cfg.model.name, f"{budget.n_params:,}", f"{budget.n_params_non_embedding:,}",
            f"; + {budget.n_params_padding:,} in the vocabulary padded to "
            f"{cfg.model.pad_vocab_to}" if budget.n_params_padding else "",
            f"{budget.flops_per_token:,}", budget.rule, f"{budget.tokens:,}",
            budget.steps, f"{budget.global_batch_tokens:,}",
            " ".join(filter(None, [plan["precision"], plan.get("fp8"),
                                   "(auto)" if "precision_auto" in plan else None])),
            plan["attention"], " | compile (per block)" if cfg.train.compile else "",
            self.layout.describe(), self.device,
        )

    def _load_data(self) -> None:
        """The training and (when prepared) validation windows."""
        cfg = self.cfg
        path = self._data()
        self.train_data = TokenWindows(path, "train", cfg.model.seq_len, seed=cfg.data.seed)
        self.val_data = (TokenWindows(path, "validation", cfg.model.seq_len, shuffle=False)
                         if "validation" in self.train_data.index["splits"] else None)
        # the next batches read on a thread while a step runs, pinned for async copies
        self.prefetch = Prefetcher(self.train_data, self.layout.local_batch_size,
                                   cfg.train.global_batch_size, pin=self.device.type == "cuda")
        if self.device.type == "cpu":
            keep_freed_memory()

    def _build_training(self) -> None:
        """Model, optimizer, schedule, loss scaler and the step strategy that drives them."""
        cfg = self.cfg
        # Checkpoints are found before the model exists: a resumed run skips initialising.
        self.ckpt = CheckpointManager(self.run_dir / "checkpoints", cfg.checkpoint, self.device)
        self.parallel = self._build_model(initialise=self.resume_path() is None)
        self.optimizer = build_optimizer(
            torch.nn.ModuleList(self.parallel.parts), cfg.optim, self.plan["lr"], self.device,
            also_embeddings=self.parallel.tied.params if self.parallel.tied is not None else (),
        )
        self.scheduler = build_scheduler(self.optimizer, cfg.schedule, self.budget.steps,
                                         self.budget.global_batch_tokens)
        self.scaler = self._grad_scaler()
        self.skips = NonFiniteSteps(self.device, self.skipped_steps)
        self.strategy = step_strategy(
            self.parallel, self.layout, self.policy, self.device, self.scaler,
            loss=self.pipeline_loss, optimizer=self.optimizer,
            small_seqs=self.noise_small_seqs, grad_sq_norm=self._grad_sq_norm)
        self._log_startup_memory()
        # FSDP fp8 all-gathers: weight scales precomputed once per step, in one all-reduce
        self.fp8_scales = self.policy.fp8 and any(fp8_all_gather(p) for p in self.model_parts)
        self.peak_flops = self._peak_flops() if self.rank0 else None
        # Every rank continues from the same RNG state (rank 0 alone drew random numbers to
        # time the peak), so dropout masks agree wherever activations are replicated (TP).
        torch.manual_seed(cfg.train.seed)

    def _start_run(self) -> None:
        """The run directory (this attempt not stopped, the tokenizer beside the
        checkpoints), the checkpoint resumed from, the stop request and the metrics."""
        cfg = self.cfg
        self.lock = RunLock(self.run_dir)
        on_rank0(self.lock.acquire)  # before anything in the directory is touched
        if self.rank0:
            (self.run_dir / STOPPED).unlink(missing_ok=True)  # this attempt is not stopped
        self._resume()
        self.stop = StopRequest(cfg.train.time_limit_minutes)
        if self.rank0:
            tok = self.train_data.path / "tokenizer.json"
            if tok.exists():  # beside the checkpoints, for tools/export_hf.py
                (self.run_dir / "tokenizer.json").write_bytes(tok.read_bytes())
        self.metrics = MetricsLogger(
            self.run_dir, OmegaConf.to_container(OmegaConf.structured(cfg)), self.budget.steps,
            self.step, cfg.logging.wandb, cfg.logging.wandb_project, cfg.logging.wandb_entity,
            cfg.logging.progress_bar, enabled=self.rank0,
        )

    def _log_startup_memory(self) -> None:
        """Peak host memory so far (model and optimizer state built, no step run): each
        rank holds O(its shard), never the whole model; the fullest rank is reported."""
        mine = float(peak_rss_bytes())
        most = dist_env.all_reduce(torch.tensor(mine, device=self.device), "max").item()
        log.info("start-up peak host memory: %.2f GB on rank 0, %.2f GB on the fullest rank",
                 mine / 1e9, most / 1e9)

    def _data(self) -> Path:
        """The prepared shards: one process prepares them on first use (auto_prepare); a
        multi-process run has checked before it started that they exist (preparing a real
        corpus is a job of its own, tools/prepare_data.py, not work for rank 0 while the
        other ranks wait on a collective's timeout)."""
        cfg = self.cfg
        path = data_dir(cfg.data)
        if self.world_size == 1 and cfg.data.auto_prepare:
            path = prepare(cfg.data)
        index = load_index(path)
        if index["max_token_id"] >= cfg.model.vocab_size:
            raise DataError(
                f"the data in {path} has token ids up to {index['max_token_id']} (tokenizer "
                f"vocabulary {index['vocab_size']}) but model.vocab_size={cfg.model.vocab_size}; "
                f"set model.vocab_size={index['vocab_size']} (or a larger padded size)"
            )
        self.plan.update(check_epochs(cfg.data, self.budget.tokens, index))
        log.info("data %s: %s training tokens, the budget is %.3g epochs of it", path,
                 f"{self.plan['data_tokens']:,}", self.plan["epochs"])
        return path

    def _build_model(self, initialise: bool = True) -> ParallelModel:
        """Meta-device GPT -> this rank's parallel share -> its shards allocated and (unless
        a checkpoint is about to overwrite them) initialised, each rank drawing only its own
        shards' values."""
        cfg = self.cfg
        pm = parallelize_gpt(cfg, self.layout, self.mesh, self.device, self.policy,
                             self.plan["attention"], loss_fn=self.pipeline_loss)
        t0 = time.perf_counter()
        materialize(pm, self.device, cfg.train.seed if initialise else None)
        if initialise:
            log.info("initialised this rank's shards in %.2f s (%.1f MB of parameters)",
                     time.perf_counter() - t0, sum(local_region(p)[0].nbytes
                                                   for p in pm.parameters()) / 1e6)
        return pm

    def _grad_scaler(self):
        if not self.policy.loss_scaling:
            return None
        if self.mesh is None:
            return self.policy.grad_scaler(self.device)
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        # found-inf must agree on every rank, or some would skip a step others take
        return ShardedGradScaler(self.device.type)

    def _peak_flops(self) -> float | None:
        """Denominator of MFU, per device: datasheet peak on a GPU, a measured large matmul
        on a CPU (one process's share of it when several share the CPU)."""
        dtype = self.policy.compute_dtype
        if self.device.type == "cuda":  # the compute dtype's peak (bf16 for fp8): mfu_peak
            return gpu_peak_flops(self.device, self.policy.peak_dtype)
        key = (dtype, torch.get_num_threads())
        if key not in _CPU_PEAKS:  # once per process: several runs in one (bench, tests)
            _CPU_PEAKS[key] = measure_matmul_flops(dtype, self.device)
        peak = _CPU_PEAKS[key]
        log.info("CPU peak (measured %s matmul, best of 3 layouts, %d threads): %.1f GFLOP/s",
                 dtype, torch.get_num_threads(), peak / 1e9)
        native, why = cpu_native_matmul(dtype)
        if not native:  # named explicitly: run as asked, but say what it costs, once
            fp32 = measure_matmul_flops(torch.float32, self.device, seconds=0.5)
            log.warning(
                "precision=%s on a CPU without native %s matmuls (%s): they run at %.1f "
                "GFLOP/s here against %.1f for fp32, %.0fx slower. Use precision=auto (%s on "
                "this CPU) or precision=fp32.", self.plan["precision"],
                str(dtype).removeprefix("torch."), why, peak / 1e9, fp32 / 1e9, fp32 / peak,
                choose_auto(self.device)[0])
        return peak

    def check_peak(self, achieved: float) -> None:
        """A CPU peak below what the run achieves per process was measured while the machine
        was busy (a shared host): measure again, and keep the higher. MFU is never clipped;
        its denominator is fixed."""
        if self.device.type != "cpu" or not self.peak_flops:
            return
        if achieved <= self.world_size * self.peak_flops:
            return
        again = measure_matmul_flops(self.policy.compute_dtype, self.device)
        log.warning("the CPU peak measured at start (%.1f GFLOP/s) is below the %.1f GFLOP/s "
                    "this run achieves per process: it was measured while the machine was "
                    "busy; measured again: %.1f GFLOP/s", self.peak_flops / 1e9,
                    achieved / self.world_size / 1e9, again / 1e9)
        self.peak_flops = max(self.peak_flops, again)
        key = (self.policy.compute_dtype, torch.get_num_threads())
        _CPU_PEAKS[key] = max(_CPU_PEAKS.get(key, 0.0), self.peak_flops)

    @property
    def model_parts(self) -> list[torch.nn.Module]:
        """This rank's model chunks: one module, or its pipeline stages."""
        return self.parallel.parts

    @property
    def model(self) -> torch.nn.Module:
        """This rank's model as one module: the whole GPT, or its pipeline stage (parameter
        names are the whole model's either way). A rank holding several stages
        (interleaved, ZBV) has no single module: use ``model_parts``."""
        if len(self.parallel.parts) != 1:
            raise AttributeError(f"this rank holds pipeline stages {self.parallel.stage_ids}; "
                                 "use Trainer.model_parts")
        return self.parallel.parts[0]

    # -- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "step": self.step, "samples_seen": self.samples_seen,
            "skipped_steps": self.skipped_steps, "first_val_loss": self.first_val_loss,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "rng": torch.get_rng_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.step, self.samples_seen = int(state["step"]), int(state["samples_seen"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.skips = NonFiniteSteps(self.device, self.skipped_steps)
        self.first_val_loss = state.get("first_val_loss")
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng"])

    def _checkpoint_state(self) -> dict:
        return {"model_optim": ModelOptimizer(self.model_parts, self.optimizer), "train": self}

    def _check_compatible(self, path: Path) -> None:
        """Refuse a checkpoint of another model before DCP reports a shape mismatch. Reads
        meta.json: call it on rank 0 only, inside ``on_rank0``, which gives every rank the
        same error."""
        saved = read_meta(path).get("config", {}).get("model", {})
        ignore = {"attention", "name", "dropout"}
        now = OmegaConf.to_container(OmegaConf.structured(self.cfg.model))
        diff = [f"model.{k}={now[k]!r} (checkpoint: {v!r})" for k, v in saved.items()
                if k not in ignore and k in now and now[k] != v]
        if diff:
            raise CheckpointError(
                f"{path} holds a different model: {'; '.join(diff)}. Use the same model "
                "settings, another run_name, or checkpoint.resume=false to start afresh.")
        self._check_precision(path, read_meta(path).get("config", {}).get("precision", {}))

    def _check_precision(self, path: Path, saved: dict) -> None:
        """Loss scaling is state the checkpoint holds or lacks (fp16's scaler): resuming
        across it would fail inside DCP with a message about param_groups. Other precision
        changes (bf16 <-> fp32) resume fine: the weights and AdamW state are fp32 either way."""
        if not saved or bool(saved.get("loss_scaling")) == self.cfg.precision.loss_scaling:
            return
        raise CheckpointError(
            f"{path} was saved with precision={saved.get('name')} "
            f"(loss_scaling={saved.get('loss_scaling')}) and this run is "
            f"precision={self.cfg.precision.name} (loss_scaling="
            f"{self.cfg.precision.loss_scaling}): fp16's loss-scaler state is in one and not "
            "the other. Resume with the checkpoint's precision, or start afresh from its "
            f"weights: checkpoint.load_weights_only={path} checkpoint.resume=false.")

    def resume_path(self) -> Path | None:
        """The checkpoint this run continues from: resume_from, else (checkpoint.resume) the
        newest complete one of this run; None for a new run. Rank 0 alone looks at the disk
        and checks the model; every rank gets its answer or raises its error, so every rank
        calls this, once the process group exists. It needs the config only, so it runs
        before the model is built (a resumed run skips initialising); decided once."""
        if not hasattr(self, "_resume_decision"):
            self._resume_decision = on_rank0(self._choose_resume)
        return self._resume_decision

    def _choose_resume(self) -> Path | None:
        """``resume_path`` in this process alone (rank 0's side of it)."""
        ck = self.cfg.checkpoint
        if ck.resume_from:
            path = resolve_checkpoint(ck.resume_from)
        elif ck.resume:
            path = newest_checkpoint(self.run_dir / "checkpoints")
        else:
            return None
        if path is not None:
            self._check_compatible(path)
        return path

    def _resume(self) -> None:
        """Continue from ``resume_path()``; else start a new run, from load_weights_only's
        weights when given."""
        path = self.resume_path()
        if path is not None:
            meta = CheckpointManager.load(path, self._checkpoint_state())
            log.info("resumed from %s: step %d, %s tokens seen (saved with layout %s)",
                     path, self.step, f"{self.step * self.budget.global_batch_tokens:,}",
                     meta.get("layout"))
            return
        if self.cfg.checkpoint.load_weights_only:
            self._load_weights(self.cfg.checkpoint.load_weights_only)

    def _load_weights(self, source: str) -> None:
        """Weights only (new optimizer, new schedule): a checkpoint of ours, or a
        transformers model directory."""
        src = Path(source)
        path = on_rank0(lambda: self._weights_checkpoint(src))
        if path is None:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
            )

            from pretrain.hf import load_hf_weights

            full = build_model(self.cfg, torch.device("cpu"), self.plan["attention"],
                               self.cfg.train.seed)
            load_hf_weights(full, self.cfg.model, str(src))
            for part in self.model_parts:
                set_model_state_dict(part, full.state_dict(),
                                     options=StateDictOptions(full_state_dict=True, strict=False))
            log.info("initialised from the transformers model in %s", src)
            return
        CheckpointManager.load(path, {"model_optim": ModelOptimizer(self.model_parts, None)})
        log.info("initialised from the weights of %s (new optimizer and schedule)", path)

    def _weights_checkpoint(self, src: Path) -> Path | None:
        """Rank 0: None for a transformers model directory, else the complete checkpoint of
        ours that ``src`` names, checked against the model config."""
        if (src / "config.json").exists() and not (src / ".metadata").exists():
            return None
        path = resolve_checkpoint(src)
        self._check_compatible(path)
        return path

    def save_checkpoint(self, block: bool = False) -> None:
        meta = {"step": self.step, "tokens": self.step * self.budget.global_batch_tokens,
                "samples_seen": self.samples_seen, "layout": self.plan["layout"],
                "world_size": self.world_size,
                "config": OmegaConf.to_container(OmegaConf.structured(self.cfg))}
        self.ckpt.save(self.step, self._checkpoint_state(), meta, block=block)

    # -- steps ---------------------------------------------------------------------------

    @property
    def micro_batches(self) -> int:
        """Microbatches per step on one DP rank (accumulation or pipeline)."""
        return self.layout.microbatches

    def _local_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This DP rank's slice of the global batch: samples are read by global index, so
        the union over ranks is exactly the batch one process would read."""
        n = self.layout.local_batch_size
        x, y = self.prefetch.get(self.samples_seen + self.dp_rank * n)  # read ahead
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _sum_over_dp(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over DP ranks of a value the last pipeline stage holds (each TP rank holds the
        same), onto every rank: one all-reduce over the world, other ranks adding zero."""
        if self.mesh is None:
            return value
        share = value.float() / self.layout.tp if self.parallel.has_last_stage else \
            torch.zeros(value.shape, device=self.device)
        return dist_env.all_reduce(share.clone())

    def global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean over DP ranks of ``loss`` as train_step_local returns it (any shape: a
        stack of losses takes one all-reduce), the same on every rank. Every rank must call
        it, at the same point."""
        return self._sum_over_dp(loss) / self.layout.dp

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Gradients of the mean loss over this rank's batch, by the step strategy chosen at
        setup; returns that loss (zero on pipeline ranks without the last stage). On a step
        that measures the noise scale (``self.measuring``, set by train_step_local) it also
        keeps the squared norm of the first micro batch's gradient (see
        noise_scale_support and AccumulationStep)."""
        loss, small_sq = self.strategy.forward_backward(x, y, self.measuring)
        if small_sq is not None:
            self._noise_sq = (small_sq, None)
        return loss

    def train_step(self) -> tuple[float, float]:
        """One optimizer step over the global batch; returns (mean loss, grad norm), both
        global: the same on every rank. Reducing the loss costs an all-reduce and a host
        sync each step: for tests and tools that want every step's loss. fit() calls
        train_step_local and reduces the loss on logging steps only."""
        loss, norm = self.train_step_local()
        self._check_nonfinite()
        return self.global_loss(loss).item(), norm.item()

    def train_step_local(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over the global batch; returns (this rank's share of the loss,
        a detached device tensor, not reduced: see global_loss; the global grad norm, on the
        device).

        No host sync with a fused optimizer (the GPU default): the grad norm is reduced over
        the whole model inside clip_grad_norm, and it is not finite whenever the loss is not
        (a NaN or inf loss back-propagates into the gradients, and every rank's norm covers
        every gradient), so every rank skips a non-finite step on the device
        (pretrain/nonfinite.py). A non-fused optimizer reads the decision on the host."""
        self.parallel.train()
        x, y = self._local_batch()
        measure = self.noise_small_seqs is not None and self.logging_step(self.step + 1)
        self.measuring = measure
        try:
            loss = self.forward_backward(x, y).detach()
        finally:
            self.measuring = False
        grad_norm = self._clipped_grad_norm().detach()
        if measure and self._noise_sq is not None:  # the whole step's raw (unclipped) norm
            self._noise_sq = (self._noise_sq[0], grad_norm.float() ** 2)
        self._update(grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.samples_seen += self.cfg.train.global_batch_size
        self.step += 1
        return loss, grad_norm

    def _clipped_grad_norm(self) -> torch.Tensor:
        """The whole model's gradients made whole (tied embeddings summed, fp16 unscaled)
        and clipped; returns their global norm before clipping, on the device."""
        grad_clip = self.cfg.optim.grad_clip
        if self.parallel.tied is not None:
            self.parallel.tied.sync_grads()
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        return clip_grad_norm(self.parallel.parameters(),
                              grad_clip if grad_clip > 0 else math.inf,
                              self.pp_group, self.parallel.duplicate_params)

    def _update(self, grad_norm: torch.Tensor) -> None:
        """The optimizer step, unless the gradients are not finite: fp16's scaler skips
        such a step itself (and lowers the scale); otherwise a fused optimizer skips it on
        the device, and a non-fused one here, after reading the decision."""
        if self.scaler:  # fp16: the scaler skips steps with inf/nan gradients itself
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if self.scaler.get_scale() < scale:  # the documented sign of a skipped step
                self.skipped_steps += 1
                log.warning("step %d: fp16 gradients overflowed (inf/nan), step skipped on "
                            "every rank; loss scale %g -> %g (%d skipped in all)",
                            self.step + 1, scale, self.scaler.get_scale(), self.skipped_steps)
            return
        finite = torch.isfinite(grad_norm)
        on_host = None if device_skip_supported(self.optimizer) else bool(finite.item())
        if on_host is None:
            step_unless(self.optimizer, finite)
        elif on_host:
            self.optimizer.step()
        self.skips.add(finite)
        if self.fp8_scales:
            after_optimizer_step(self.model_parts)
        if on_host is False:
            self._check_nonfinite()  # read on the host already: warn at once

    def _check_nonfinite(self) -> None:
        """Read the device-side skip counts (a host sync: on steps that sync anyway), warn
        about skipped steps, and stop after ``train.max_nonfinite_steps`` in a row."""
        if self.scaler:  # fp16: counted by the scaler's path, on the host
            return
        limit = self.cfg.train.max_nonfinite_steps
        longest = self.skips.settle(self.step, limit)
        self.skipped_steps, self.nonfinite_in_a_row = self.skips.skipped, self.skips.in_a_row
        if longest >= limit:
            self.optimizer.zero_grad(set_to_none=True)
            last = self.ckpt.latest() if self.cfg.checkpoint.enabled else None
            raise FloatingPointError(
                f"{longest} steps in a row had a non-finite loss or gradient "
                f"(train.max_nonfinite_steps={limit}); stopping. The last good checkpoint "
                f"{last or '(none saved)'} is intact: lower optim.lr, raise warmup, or use "
                "bf16 instead of fp16, then resume.")

    def eval_batch_count(self) -> int:
        """How many validation batches (of micro_batch_size sequences) an evaluation
        averages over: ``train.eval_batches``, rounded up to whole pipeline steps under PP
        (see _eval_batches_wanted), capped at the distinct batches the split holds."""
        return min(self._eval_batches_wanted(), self._val_batches_available())

    def _eval_batches_wanted(self) -> int:
        """``train.eval_batches``, rounded up to the batches one evaluation call computes
        over every DP rank anyway (the step strategy's ``eval_round``: 1 under
        accumulation; dp x microbatches under pipeline parallelism, whose every computed
        microbatch is then a distinct batch that counts)."""
        n, per_step = self.cfg.train.eval_batches, self.strategy.eval_round
        return math.ceil(n / per_step) * per_step

    def _val_batches_available(self) -> int:
        """Distinct validation batches in the split (at least one, which then wraps)."""
        return max(1, self.val_data.n_windows // self.layout.micro_batch_size)

    def _describe_eval(self) -> None:
        """Say once, before the first evaluation, when it averages over another number of
        batches than ``train.eval_batches`` asks, and why (rank 0: once in the log)."""
        if self.val_data is None or not self.rank0:
            return
        asked, wanted = self.cfg.train.eval_batches, self._eval_batches_wanted()
        count = self.eval_batch_count()
        rounded = f", {wanted} in whole pipeline steps" if wanted != asked else ""
        if count < wanted:
            log.warning("the validation split holds %d windows of %d tokens, %d distinct "
                        "batch(es) of %d sequences: each evaluation averages those %d "
                        "(train.eval_batches=%d%s)", self.val_data.n_windows,
                        self.cfg.model.seq_len + 1, count, self.layout.micro_batch_size,
                        count, asked, rounded)
        elif count != asked:
            log.info("evaluation: %d validation batches (train.eval_batches=%d rounded up to "
                     "whole pipeline steps of dp x microbatches = %d batches, which the "
                     "pipeline computes anyway)", count, asked, self.strategy.eval_round)

    def _eval_assignment(self) -> list[tuple[int, float]]:
        """(validation batch, weight) pairs this DP rank evaluates: batch i of
        eval_batch_count() goes to rank i % dp; ranks pad with weight-0 repeats so all run
        the same number of forwards (FSDP and pipelines need every rank in every
        collective), in whole evaluation calls of the step strategy (``eval_chunk``: whole
        pipeline steps under PP). Under PP the count is whole pipeline steps already, so
        there is no padding unless the split is smaller."""
        n, dp, chunk = self.eval_batch_count(), self.layout.dp, self.strategy.eval_chunk
        rounds = math.ceil(math.ceil(n / dp) / chunk) * chunk
        mine = [k * dp + self.dp_rank for k in range(rounds)]
        return [(i, 1.0) if i < n else (0, 0.0) for i in mine]

    def evaluate(self) -> float | None:
        """Mean loss over the first eval_batch_count() micro-batches of the validation
        split, each counted once: the same batches, so the same mean (up to reduction
        order), for every layout that evaluates the same number."""
        if self.val_data is None:
            return None
        self.parallel.train(False)
        work, chunk = self._eval_assignment(), self.strategy.eval_chunk
        total = torch.zeros((), device=self.device)
        for j in range(0, len(work), chunk):
            part = work[j: j + chunk]
            losses = self.strategy.eval_losses(*self._val_batch([i for i, _ in part]))
            if losses is None:  # a pipeline rank without the last stage
                continue
            for (_, weight), loss in zip(part, losses, strict=True):
                total += weight * loss.float()
        return (self._sum_over_dp(total) / self.eval_batch_count()).item()

    def _val_batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Validation batches ``indices`` (of micro_batch_size sequences), concatenated."""
        mbs = self.layout.micro_batch_size
        batches = [self.val_data.batch(i * mbs, mbs) for i in indices]
        x = torch.cat([b[0] for b in batches]).to(self.device)
        y = torch.cat([b[1] for b in batches]).to(self.device)
        return x, y

    def sample(self) -> str | None:
        cfg = self.cfg.train
        if cfg.sample_tokens <= 0:
            return None
        if self.layout.pp > 1 or self.layout.tp > 1:
            log.info("sampling skipped: generation runs on unsplit models (tp=1, pp=1) only")
            return None
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast(tokenizer_file=str(self.train_data.path / "tokenizer.json"))
        prompt = tok(cfg.sample_prompt, add_special_tokens=False)["input_ids"] or [0]
        model = self.model
        model.eval()
        # Same seed on every rank: data-parallel replicas draw the same tokens in lockstep.
        gen = torch.Generator(device=self.device).manual_seed(cfg.seed)
        out = model.generate(
            torch.tensor([prompt], device=self.device), cfg.sample_tokens,
            temperature=cfg.sample_temperature, top_k=cfg.sample_top_k, generator=gen,
        )
        return tok.decode(out[0].tolist())

    # -- gradient noise scale ------------------------------------------------------------

    def noise_scale_support(self) -> tuple[int | None, str | None]:
        """(sequences per DP rank in the small batch, None), or (None, why not measured).

        B_big is the global batch; B_small is the first micro batch over every DP rank,
        dp x micro_batch_size sequences, whose gradient the layout holds after that micro
        batch's backward: one process and ZeRO-3 (reduce-scattered every micro batch)
        as they run; DDP and ZeRO-2 (which defer the reduction to the last micro batch)
        reduce the first micro batch's gradients at once on measuring steps, one more
        gradient reduction then. A step of one micro batch per rank runs it as two halves
        on measuring steps (same samples, same update), B_small = dp x half of it. A rank's
        own unreduced gradient would be a smaller batch, but FSDP2 and replicate reduce
        inside backward, where it cannot be read without a hook into their internals.
        Pipelines run every micro batch's backward inside the schedule: not measured."""
        lay = self.layout
        if not self.cfg.train.noise_scale:
            return None, "train.noise_scale=false"
        if lay.pp > 1:
            return None, ("not measured under pipeline parallelism: the schedule runs every "
                          "micro batch's backward in one call, so no smaller batch's gradient "
                          "is ever whole without an extra backward")
        if lay.microbatches >= 2:
            return lay.micro_batch_size, None
        if self.cfg.train.compile:
            return None, ("not measured: with one micro batch per step the measuring step "
                          "runs two half batches, a new shape torch.compile would compile "
                          "the blocks again for (use 2 or more micro batches)")
        if lay.micro_batch_size >= 2:
            return lay.micro_batch_size // 2, None
        return None, ("not measured: one sequence per rank and step leaves no smaller batch "
                      "(raise parallel.micro_batch_size or train.global_batch_size)")

    def logging_step(self, step: int) -> bool:
        """Whether fit() logs after optimizer step ``step`` (1-based): the noise scale is
        measured on those steps only, whose host syncs and collectives are there anyway."""
        return step % self.cfg.logging.log_interval == 0 or step == self.budget.steps or \
            step == 1

    def _describe_noise_scale(self) -> None:
        if self.noise_small_seqs is None:
            log.info("gradient noise scale: %s", self.noise_why_not)
            return
        seq = self.cfg.model.seq_len
        small = self.noise_small_seqs * self.layout.dp
        how = "first micro batch" if self.layout.microbatches >= 2 else \
            "first half of the batch (one micro batch, run as two halves on logging steps)"
        log.info("gradient noise scale (McCandlish et al. 2018): on logging steps, B_small = "
                 "each rank's %s x dp=%d = %d sequences = %s tokens, B_big = the global "
                 "batch, %s tokens; EMA %.2f", how, self.layout.dp, small, f"{small * seq:,}",
                 f"{self.budget.global_batch_tokens:,}", self.noise.beta)

    def _grad_sq_norm(self) -> torch.Tensor:
        """Squared norm of the gradients held now, global (every DP and TP shard), unscaled
        from fp16 loss scaling; a device tensor (no host sync)."""
        pm = self.parallel
        sq = global_grad_norm([p for p in pm.parameters() if id(p) not in pm.duplicate_params],
                              self.pp_group).float() ** 2
        if self.scaler is not None:
            sq = sq / self.scaler._get_scale_async().float() ** 2
        return sq

    def _update_noise_scale(self) -> float | None:
        """On a logging step: fold the step's two squared norms into the EMAs (one host
        sync) and return B_simple in tokens (None until it is defined)."""
        if self._noise_sq is None or self._noise_sq[1] is None:
            return self.noise.value
        small_sq, big_sq = torch.stack(self._noise_sq).double().tolist()
        self._noise_sq = None
        seq = self.cfg.model.seq_len
        spikes = self.noise.spikes
        self.noise.update(small_sq, big_sq, self.noise_small_seqs * self.layout.dp * seq,
                          self.budget.global_batch_tokens)
        if self.noise.spikes > spikes:
            log.info("noise scale: step %d's squared gradient norm %.4g is over %gx its "
                     "average, a spike: left out of the averages", self.step, big_sq, SPIKE)
        return self.noise.value

    # -- loop ----------------------------------------------------------------------------

    def fit(self) -> dict:
        """The run: evaluate the starting model, then step after step: train, log (on
        logging steps), evaluate (when due), stop on a request or save (when due), until
        the budget is spent; then the final checkpoint, a sample and the result."""
        if self.step >= self.budget.steps:  # resumed from the final checkpoint
            return self._already_finished()
        self._describe_eval()
        self._evaluate_at_start()
        window, clock = LossWindow(self.device), Throughput()
        stopped = None
        collector = GarbageCollection(self.cfg.train.gc_interval)
        try:
            while self.step < self.budget.steps and stopped is None:
                stopped = self._train_one(window, clock, collector)
        finally:
            collector.close()
        if stopped is not None:
            return self._exit_stopped(stopped)
        return self._finish(window.final)

    def _train_one(self, window: LossWindow, clock: Throughput,
                   collector: GarbageCollection) -> str | None:
        """One step of fit's loop: train, log, evaluate, collect garbage, stop or save."""
        loss, grad_norm = self.train_step_local()
        window.add(loss, counted=torch.isfinite(grad_norm))
        clock.steps += 1
        self.metrics.advance()
        if self.logging_step(self.step):
            self._log_step(window, grad_norm, clock)
        if self._eval_due():
            with clock.paused():  # eval time is not training throughput
                self._evaluate_and_log()
        collector.step(self.step)
        return self._stop_or_save()

    def _evaluate_at_start(self) -> None:
        """The untrained model's validation loss, logged at step 0; a resumed run measured
        it before it stopped (its checkpoint holds it)."""
        if self.step == 0:
            self._evaluate_and_log()
            self.first_val_loss = self.last_val_loss
        self.last_val_loss = self.first_val_loss

    def _log_step(self, window: LossWindow, grad_norm: torch.Tensor, clock: Throughput) -> None:
        """The log line of a logging step: the mean loss since the last one, throughput,
        and the noise scale (when measured and defined)."""
        tps = clock.rate(self.budget.global_batch_tokens)
        self._check_nonfinite()
        mean_loss, window.final = self._reduce_window(window)
        noise = self._update_noise_scale()  # None: not measured, or not yet defined
        self.metrics.log({**self._step_metrics(mean_loss, grad_norm.item(), tps),
                          **({"noise_scale": noise} if noise is not None else {})})
        clock.restart()

    def _step_metrics(self, loss: float, grad_norm: float, tokens_per_s: float) -> dict:
        reserved = peak_reserved_bytes(self.device)
        peak_mem = torch.tensor([float(peak_memory_bytes(self.device)), float(reserved or 0)],
                                device=self.device)
        dist_env.all_reduce(peak_mem, "max")  # the fullest rank is the one that matters
        peak_mem, reserved_max = peak_mem.tolist()
        achieved = tokens_per_s * self.budget.flops_per_token
        self.check_peak(achieved)
        return {
            "step": self.step, "loss": loss, "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
            # per device: global throughput shared by world_size devices of that peak
            "mfu": achieved / (self.world_size * self.peak_flops) if self.peak_flops else None,
            "memory_gb": peak_mem / 1e9,  # allocated (CUDA) or peak RSS (CPU)
            "memory_reserved_gb": reserved_max / 1e9 if reserved is not None else None,
            "tokens": self.step * self.budget.global_batch_tokens,
            "loss_scale": self.scaler.get_scale() if self.scaler else None,
            "skipped_steps": self.skipped_steps,
        }

    def _reduce_window(self, window: LossWindow) -> tuple[float, float]:
        """(mean loss over the window's counted steps, the last step's loss), both global:
        one all-reduce and one host sync, on logging steps (every rank logs at the same
        steps). Starts a new window."""
        # every rank counted the same steps (the skip decision is global): not reduced
        total, last, counted = torch.cat([
            self.global_loss(torch.stack([window.total, window.last])),
            window.counted[None]]).tolist()
        mean = total / counted if counted else math.nan
        window.reset()
        return mean, last

    def _eval_due(self) -> bool:
        """Every ``train.eval_interval`` steps, and after the last."""
        return self.step % self.cfg.train.eval_interval == 0 or self.step == self.budget.steps

    def _evaluate_and_log(self) -> None:
        self.last_val_loss = self.evaluate()
        if self.last_val_loss is not None:
            self.metrics.log({"step": self.step, "val_loss": self.last_val_loss,
                              "tokens": self.step * self.budget.global_batch_tokens})

    def _stop_or_save(self) -> str | None:
        """After a step other than the last: why every rank stops now, having saved a
        checkpoint (blocking), or None, having saved a periodic one if it is due."""
        if self.step == self.budget.steps:  # the end of fit saves
            return None
        stopped, save_due = self._between_steps()
        if stopped is not None:
            log.warning("stopping at step %d (%s): saving a checkpoint, then exiting with "
                        "status %d so the launcher requeues the run", self.step, stopped,
                        EXIT_REQUEUE)
            self.save_checkpoint(block=True)
        elif save_due and self.nonfinite_in_a_row:
            log.warning("step %d: no checkpoint while steps are being skipped for a "
                        "non-finite loss or gradient (%d in a row): the newest one stays the "
                        "last good one", self.step, self.nonfinite_in_a_row)
        elif save_due:
            self.save_checkpoint()
        return stopped

    def _between_steps(self) -> tuple[str | None, bool]:
        """After a step other than the last: (why every rank stops now, or None; whether a
        periodic checkpoint is due). The agreement collectives (the stop request's
        all-reduce, the async save's poll) run on stop-check steps only: every
        ``train.stop_check_interval`` steps, on ``train.exit_interval`` steps, and on steps
        with a checkpoint due (a stop then saves once, blocking). The steps are a function
        of the step number, so every rank calls them at the same steps and stops at the
        same step."""
        train = self.cfg.train
        exit_now = bool(train.exit_interval) and self.step % train.exit_interval == 0
        sync_step = exit_now or self.step % train.stop_check_interval == 0
        save_due = self._save_due(sync_step)
        if not (sync_step or save_due):
            return None, False
        self.ckpt.poll()
        self._check_nonfinite()
        stopped = self.stop.check(self.device)
        if stopped is None and exit_now:
            stopped = f"train.exit_interval={train.exit_interval}"
        return stopped, save_due

    def _save_due(self, sync_step: bool) -> bool:
        """Whether a periodic checkpoint is due after this step. A step interval is decided
        locally; a minute interval needs rank 0's clock (``CheckpointManager.due``
        broadcasts it), so it is asked on stop-check steps only: such a save comes at most
        ``train.stop_check_interval - 1`` steps late."""
        every = self.cfg.checkpoint.interval_steps
        if sync_step or (every and self.step % every == 0):
            return self.ckpt.due(self.step)
        return False

    def _exit_stopped(self, stopped: str) -> dict:
        """A run stopped early, to be requeued. One process exits 75 itself. Under torchrun
        a non-zero exit of one rank makes torchrun kill the others and return 1, so ranks
        exit 0 there and the launcher (tools/run_local.py, slurm/train.sbatch) reads
        stopped.json instead."""
        if self.rank0:
            (self.run_dir / STOPPED).write_text(json.dumps(
                {"step": self.step, "reason": stopped, "exit_code": EXIT_REQUEUE}))
        self.exit_code = 0 if "TORCHELASTIC_RUN_ID" in os.environ else EXIT_REQUEUE
        self.ckpt.close()
        self.metrics.close()
        return {"steps": self.step, "stopped": stopped}

    def _already_finished(self) -> dict:
        """A finished run started again: nothing to train, and result.json (the sweep
        fits read it) stays exactly as the run wrote it."""
        path = self.run_dir / "result.json"
        log.info("this run finished already (step %d of %d, resumed from its final "
                 "checkpoint): nothing to train; %s is left as it was", self.step,
                 self.budget.steps, path)
        self.ckpt.close()
        self.metrics.close()
        if path.exists():
            return {**json.loads(path.read_text()), "already_finished": True}
        return {"steps": self.step, "already_finished": True}

    def _finish(self, final_loss: float) -> dict:
        """The budget is spent: the final checkpoint, what the noise scale says of the
        batch, a sample, and result.json."""
        self._check_nonfinite()
        if self.cfg.checkpoint.enabled:
            self.save_checkpoint(block=True)
        self.ckpt.close()
        tokens_per_step = self.budget.global_batch_tokens
        result = {"steps": self.step, "final_loss": final_loss,
                  "first_val_loss": self.first_val_loss, "final_val_loss": self.last_val_loss,
                  "tokens": self.step * tokens_per_step, "skipped_steps": self.skipped_steps,
                  "val_batches": self.eval_batch_count() if self.val_data is not None else None,
                  "noise_scale": self.noise.value}
        if self.noise.value is not None:
            log.info(compare_batch(tokens_per_step, self.noise.value))
        text = self.sample()
        if text is not None:
            log.info("sample from the trained model:\n%s\n%s\n%s", "-" * 60, text, "-" * 60)
            result["sample"] = text
        if self.rank0:
            (self.run_dir / "result.json").write_text(json.dumps(result, indent=2))
        self.metrics.close()
        return result


def run(cfg: Config, run_dir: Path) -> dict | None:
    """Entry point shared by train.py and the tools: dry run or train (one process, or one
    of the processes torchrun started)."""
    if cfg.dry_run:
        cfg, notes = resolve_auto(cfg, declared_world_size(cfg))
        plan, *_ = resolve_plan(cfg)
        plan.update(notes)
        if dist_env.env_rank() == 0:
            if "hparam_rules" in plan:  # the JSON line alone goes to stdout
                print(describe(plan["hparam_rules"]), file=sys.stderr, flush=True)
            print(json.dumps(plan), flush=True)
        return plan
    trainer = Trainer(cfg, run_dir)
    try:
        trainer.setup()
        if trainer.rank0:
            (Path(run_dir) / "plan.json").write_text(json.dumps(trainer.plan, indent=2))
        result = trainer.fit()
        result["exit_code"] = trainer.exit_code
        return result
    finally:
        if getattr(trainer, "stop", None) is not None:
            trainer.stop.restore()
        if getattr(trainer, "prefetch", None) is not None:
            trainer.prefetch.close()
        if getattr(trainer, "lock", None) is not None:
            trainer.lock.release()
        dist_env.destroy()
