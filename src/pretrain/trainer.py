"""The one training loop every recipe runs.

A linear story: check the config, resolve the plan (budget, device, precision, attention),
prepare data, build the model on the meta device and materialise it, build optimizer and
schedule, then loop: batch -> forward/backward with accumulation -> clip -> step -> log ->
eval. Nothing here is specific to one recipe.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from pretrain.attention import resolve_backend
from pretrain.budget import Budget, resolve_budget
from pretrain.config import Config
from pretrain.data.loader import TokenWindows
from pretrain.data.prepare import DataError, data_dir, load_index, prepare
from pretrain.device import (
    gpu_peak_flops,
    keep_freed_memory,
    measure_matmul_flops,
    peak_memory_bytes,
    pick_device,
)
from pretrain.loss import cross_entropy
from pretrain.metrics import MetricsLogger
from pretrain.model import GPT, set_attention_backend
from pretrain.optim import build_optimizer, build_scheduler, scaled_lr
from pretrain.precision import Policy, resolve_policy
from pretrain.validate import check

log = logging.getLogger("pretrain")


def layout(cfg: Config, world_size: int) -> dict:
    par = cfg.parallel
    dp = par.dp if par.dp is not None else world_size // (par.tp * par.pp)
    return {"tp": par.tp, "pp": par.pp, "dp": dp, "world_size": par.tp * par.pp * dp,
            "dp_shard": par.dp_shard, "dp_replicate": par.dp_replicate,
            "dp_mode": par.dp_mode, "micro_batch_size": par.micro_batch_size,
            "grad_accum": cfg.train.global_batch_size // (par.micro_batch_size * dp)}


def describe_layout(lay: dict) -> str:
    return (f"tp={lay['tp']} x pp={lay['pp']} x dp={lay['dp']} ({lay['dp_mode']}), "
            f"micro batch {lay['micro_batch_size']} x {lay['grad_accum']} accumulation")


def resolve_plan(cfg: Config, world_size: int = 1) -> tuple[dict, Budget, torch.device, Policy]:
    """Everything a run decides before it starts, without touching data or weights."""
    check(cfg, world_size)
    device = pick_device(cfg.train.device)
    policy = resolve_policy(cfg.precision, device)
    attention = resolve_backend(cfg.model.attention, device, policy.compute_dtype)
    budget = resolve_budget(cfg.model, cfg.budget, cfg.train.global_batch_size)
    plan = {
        **budget.as_dict(),
        "attention": attention,
        "precision": cfg.precision.name,
        "layout": layout(cfg, world_size),
        "model": cfg.model.name,
        "data": cfg.data.name,
        "device": str(device),
        "lr": scaled_lr(cfg.optim, budget.global_batch_tokens),
    }
    return plan, budget, device, policy


def build_model(cfg: Config, device: torch.device, attention: str, seed: int) -> GPT:
    """Construct on the meta device (no memory), then materialise and initialise on
    ``device``: the same path a sharded model takes."""
    with torch.device("meta"):
        model = GPT(cfg.model)
    model.to_empty(device=device)
    model.tie_weights()
    torch.manual_seed(seed)
    model.init_weights()
    set_attention_backend(model, attention)
    return model


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.plan, self.budget, self.device, self.policy = resolve_plan(cfg)
        self.step = 0
        self.samples_seen = 0

    # -- setup ---------------------------------------------------------------------------

    def setup(self) -> None:
        cfg = self.cfg
        log.info("plan: %s", json.dumps(self.plan))
        log.info(
            "model %s: %s params (%s non-embedding), %s FLOPs/token | budget %s -> %s tokens "
            "in %d steps of %s tokens | precision %s | attention %s | layout %s | device %s",
            cfg.model.name, f"{self.budget.n_params:,}", f"{self.budget.n_params_non_embedding:,}",
            f"{self.budget.flops_per_token:,}", self.budget.rule, f"{self.budget.tokens:,}",
            self.budget.steps, f"{self.budget.global_batch_tokens:,}", cfg.precision.name,
            self.plan["attention"], describe_layout(self.plan["layout"]), self.device,
        )
        path = self._data()
        self.train_data = TokenWindows(path, "train", cfg.model.seq_len, seed=cfg.data.seed)
        self.val_data = (TokenWindows(path, "validation", cfg.model.seq_len, shuffle=False)
                         if "validation" in self.train_data.index["splits"] else None)
        if self.device.type == "cpu":
            keep_freed_memory()
        self.model = build_model(cfg, self.device, self.plan["attention"], cfg.train.seed)
        if cfg.train.compile:
            for block in self.model.layers.values():
                block.compile()
        self.optimizer = build_optimizer(self.model, cfg.optim, self.plan["lr"], self.device)
        self.scheduler = build_scheduler(self.optimizer, cfg.schedule, self.budget.steps,
                                         self.budget.global_batch_tokens)
        self.scaler = self.policy.grad_scaler(self.device)
        self.peak_flops = self._peak_flops()
        self.metrics = MetricsLogger(
            self.run_dir, OmegaConf.to_container(OmegaConf.structured(cfg)), self.budget.steps,
            self.step, cfg.logging.wandb, cfg.logging.wandb_project, cfg.logging.wandb_entity,
            cfg.logging.progress_bar,
        )

    def _data(self) -> Path:
        cfg = self.cfg
        path = prepare(cfg.data) if cfg.data.auto_prepare else data_dir(cfg.data)
        index = load_index(path)
        if index["max_token_id"] >= cfg.model.vocab_size:
            raise DataError(
                f"the data in {path} has token ids up to {index['max_token_id']} (tokenizer "
                f"vocabulary {index['vocab_size']}) but model.vocab_size={cfg.model.vocab_size}; "
                f"set model.vocab_size={index['vocab_size']} (or a larger padded size)"
            )
        return path

    def _peak_flops(self) -> float | None:
        """Denominator of MFU: datasheet peak on a GPU, a measured large matmul on a CPU."""
        dtype = self.policy.compute_dtype
        if self.device.type == "cuda":
            return gpu_peak_flops(self.device, str(dtype).removeprefix("torch."))
        peak = measure_matmul_flops(dtype, self.device, seconds=0.5)
        log.info("CPU peak (measured %s matmul): %.1f GFLOP/s", dtype, peak / 1e9)
        return peak

    # -- steps ---------------------------------------------------------------------------

    @property
    def micro_batches(self) -> int:
        return self.cfg.train.global_batch_size // self.cfg.parallel.micro_batch_size

    def train_step(self) -> tuple[float, float]:
        """One optimizer step over the global batch; returns (mean loss, grad norm)."""
        cfg = self.cfg
        mbs = cfg.parallel.micro_batch_size
        self.model.train()
        total = torch.zeros((), device=self.device)
        for i in range(self.micro_batches):
            x, y = self.train_data.batch(self.samples_seen + i * mbs, mbs)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with self.policy.autocast(self.device):
                loss = cross_entropy(self.model(x), y) / self.micro_batches
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += loss.detach()
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
        )
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.samples_seen += cfg.train.global_batch_size
        self.step += 1
        return total.item(), grad_norm.item()

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean loss over the same first eval_batches windows of the validation split."""
        if self.val_data is None:
            return None
        self.model.eval()
        mbs = self.cfg.parallel.micro_batch_size
        losses = []
        for i in range(self.cfg.train.eval_batches):
            x, y = self.val_data.batch(i * mbs, mbs)
            with self.policy.autocast(self.device):
                losses.append(cross_entropy(self.model(x.to(self.device)), y.to(self.device)))
        return torch.stack(losses).mean().item()

    def sample(self) -> str | None:
        cfg = self.cfg.train
        if cfg.sample_tokens <= 0:
            return None
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast(tokenizer_file=str(self.train_data.path / "tokenizer.json"))
        prompt = tok(cfg.sample_prompt, add_special_tokens=False)["input_ids"] or [0]
        self.model.eval()
        gen = torch.Generator(device=self.device).manual_seed(cfg.seed)
        with self.policy.autocast(self.device):
            out = self.model.generate(
                torch.tensor([prompt], device=self.device), cfg.sample_tokens,
                temperature=cfg.sample_temperature, top_k=cfg.sample_top_k, generator=gen,
            )
        return tok.decode(out[0].tolist())

    # -- loop ----------------------------------------------------------------------------

    def fit(self) -> dict:
        cfg = self.cfg
        steps = self.budget.steps
        tokens_per_step = self.budget.global_batch_tokens
        first_val = self.evaluate()
        if first_val is not None:
            self.metrics.log({"step": 0, "val_loss": first_val, "tokens": 0})
        last_val = first_val
        t_last, steps_since = time.perf_counter(), 0
        loss = float("nan")
        while self.step < steps:
            loss, grad_norm = self.train_step()
            steps_since += 1
            self.metrics.advance()
            is_last = self.step == steps
            if self.step % cfg.logging.log_interval == 0 or is_last or self.step == 1:
                dt = time.perf_counter() - t_last
                tps = steps_since * tokens_per_step / dt
                achieved = tps * self.budget.flops_per_token
                self.metrics.log({
                    "step": self.step, "loss": loss, "lr": self.scheduler.get_last_lr()[0],
                    "grad_norm": grad_norm, "tokens_per_s": tps,
                    "mfu": achieved / self.peak_flops if self.peak_flops else None,
                    "memory_gb": peak_memory_bytes(self.device) / 1e9,
                    "tokens": self.step * tokens_per_step,
                    "loss_scale": self.scaler.get_scale() if self.scaler else None,
                })
                t_last, steps_since = time.perf_counter(), 0
            if self.step % cfg.train.eval_interval == 0 or is_last:
                t0 = time.perf_counter()
                last_val = self.evaluate()
                if last_val is not None:
                    self.metrics.log({"step": self.step, "val_loss": last_val,
                                      "tokens": self.step * tokens_per_step})
                t_last += time.perf_counter() - t0  # eval time is not training throughput
        result = {"steps": self.step, "final_loss": loss, "first_val_loss": first_val,
                  "final_val_loss": last_val, "tokens": self.step * tokens_per_step}
        text = self.sample()
        if text is not None:
            log.info("sample from the trained model:\n%s\n%s\n%s", "-" * 60, text, "-" * 60)
            result["sample"] = text
        (self.run_dir / "result.json").write_text(json.dumps(result, indent=2))
        self.metrics.close()
        return result


def run(cfg: Config, run_dir: Path) -> dict | None:
    """Entry point shared by train.py and the tools: dry run or train."""
    if cfg.dry_run:
        plan, *_ = resolve_plan(cfg)
        print(json.dumps(plan), flush=True)
        return plan
    trainer = Trainer(cfg, run_dir)
    trainer.setup()
    (Path(run_dir) / "plan.json").write_text(json.dumps(trainer.plan, indent=2))
    return trainer.fit()


def to_config(cfg) -> Config:
    """A Hydra DictConfig (already checked against the schema) as the dataclass tree."""
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, Config), type(obj)
    return obj

