"""Training-step throughput of a recipe: tokens/s, achieved FLOP/s, MFU and peak memory.

    python tools/bench.py +recipe=tiny
    python tools/bench.py +recipe=gpt2-124m-cpu --steps 10 --warmup 3
    python tools/bench.py +recipe=gpt3-1.3b parallel.micro_batch_size=8 --modes trainer

Modes (each runs in its own process so peak memory is its own):
  trainer  this project's training step as fit() runs it between log lines
           (Trainer.train_step_local: accumulation or pipeline, clipping, schedule)
  plain    a nanoGPT-style loop over the same model: forward, cross-entropy, backward, clip, step
  hf       the same plain loop over transformers' GPT2LMHeadModel (GPT-2 architecture only),
           an independent implementation of the same model, as a reference

MFU is achieved FLOP/s over the peak: the datasheet dense peak for the compute dtype on a
GPU, and on a CPU a large matmul in the compute dtype timed in the same process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from pretrain.config.compose import compose_config
from pretrain.errors import cli
from pretrain.hardware.device import peak_memory_bytes

MODES = ("trainer", "plain", "hf")


def hf_gpt2(cfg, device):
    from transformers import GPT2Config, GPT2LMHeadModel

    m = cfg.model
    if (m.pos_emb, m.norm, m.mlp, m.tie_embeddings) != ("learned", "layernorm", "gelu", True):
        return None
    hf_cfg = GPT2Config(vocab_size=m.vocab_size, n_positions=m.seq_len, n_embd=m.d_model,
                        n_layer=m.n_layer, n_head=m.n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, attn_implementation="sdpa")
    return GPT2LMHeadModel(hf_cfg).to(device)


def plain_loop(model: torch.nn.Module, device: torch.device, compute_dtype: torch.dtype,
               compile_model: bool = False):
    """nanoGPT's training step over ``model``: forward and ``F.cross_entropy`` under
    autocast (compiled together when asked, as nanoGPT compiles its loss inside the
    forward), backward, clip, fused AdamW on a GPU. Returns ``step(batches)`` over a list of
    (x, y) micro batches already on the device; the loss stays on the device (no host
    sync). The yardstick of ``plain`` mode and of tests/test_step_ops.py."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    mixed = compute_dtype != torch.float32

    def forward_loss(x, y):
        out = model(x)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        return F.cross_entropy(logits.flatten(0, -2).float(), y.flatten())

    fwd = torch.compile(forward_loss) if compile_model else forward_loss

    def step(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        for x, y in batches:
            with torch.autocast(device.type, dtype=compute_dtype, enabled=mixed):
                loss = fwd(x, y) / len(batches)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def plain_step(mode: str, trainer, cfg):
    """A nanoGPT-style step (``plain_loop``) over ``trainer``'s model (``plain``) or
    transformers' GPT-2 (``hf``), on the trainer's data (read ahead, pinned, copied without
    a host wait) and precision; None when hf has no such model."""
    device, policy = trainer.device, trainer.policy
    mbs = cfg.parallel.micro_batch_size
    accum = cfg.train.global_batch_size // mbs
    model = trainer.module.model if mode == "plain" else hf_gpt2(cfg, device)
    if model is None:
        return None
    step = plain_loop(model, device, policy.compute_dtype, cfg.train.compile)
    pos = [0]

    def step_fn():
        x, y = trainer.prefetch.get(pos[0])  # the trainer's read-ahead thread, pinned
        pos[0] += cfg.train.global_batch_size
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        return step(list(zip(x.chunk(accum), y.chunk(accum), strict=True)))

    return step_fn


def timed(step_fn, warmup: int, steps: int, device: torch.device,
          count: Callable[[], int] = lambda: 0) -> tuple[float, int]:
    """Seconds for ``steps`` calls of ``step_fn`` after ``warmup`` unmeasured ones, and how
    far ``count`` (the samples the trainer has taken) moved over the measured ones."""
    for _ in range(warmup):
        step_fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    c0, t0 = count(), time.perf_counter()
    for _ in range(steps):
        step_fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, count() - c0


def measure(mode: str, overrides: list[str], steps: int, warmup: int) -> dict:
    cfg = compose_config([*overrides, "logging.wandb=disabled", "logging.progress_bar=false",
                          "train.sample_tokens=0"])
    from pretrain.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(cfg, Path(tmp))
        trainer.setup()
        device = trainer.device
        gbs, mbs = cfg.train.global_batch_size, cfg.parallel.micro_batch_size
        if mode == "trainer":
            step_fn = trainer.train_step_local
        else:
            step_fn = plain_step(mode, trainer, cfg)
            if step_fn is None:
                return {
                    "mode": mode,
                    "skipped": "hf reference exists for the GPT-2 architecture only",
                }
        dt, samples = timed(step_fn, warmup, steps, device, lambda: trainer.samples_seen)
        # the tokens the steps took: under a batch ramp (gpt3-1.3b's) fewer than the
        # full batch's, which counted as taken once read 2x the card's peak
        tokens = (samples * cfg.model.seq_len if mode == "trainer"
                  else steps * trainer.budget.global_batch_tokens)
        tps = tokens / dt
        achieved = tps * trainer.budget.flops_per_token
        trainer.peak.check(achieved)  # a peak timed in a busy moment is measured again
        return {
            "mode": mode, "recipe_model": cfg.model.name, "device": str(device),
            "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "threads": torch.get_num_threads(), "precision": trainer.decision.precision,
            "attention": trainer.decision.attention, "compile": cfg.train.compile,
            "n_params": trainer.budget.n_params, "seq_len": cfg.model.seq_len,
            "global_batch": gbs, "micro_batch": mbs, "steps": steps,
            "batch_taken": round(tokens / steps / cfg.model.seq_len, 2),
            "tokens_per_s": round(tps, 1), "step_s": round(dt / steps, 4),
            "achieved_tflops": round(achieved / 1e12, 4),
            "peak_tflops": round(trainer.peak.value / 1e12, 4) if trainer.peak.value else None,
            "mfu": round(achieved / trainer.peak.value, 4) if trainer.peak.value else None,
            "peak_memory_gb": round(peak_memory_bytes(device) / 1e9, 3),
        }


def print_table(rows: list[dict]) -> None:
    """The measured modes as a table under one line saying what ran."""
    head = (f"{'mode':8} {'tokens/s':>10} {'step s':>8} {'TFLOP/s':>9} {'peak':>8} "
            f"{'MFU':>7} {'mem GB':>7}")
    first = next(r for r in rows if "skipped" not in r)
    print(
        f"{first['recipe_model']}: {first['n_params']:,} params, seq {first['seq_len']}, "
        f"batch {first['global_batch']} (micro {first['micro_batch']}), {first['precision']}, "
        f"attention {first['attention']}, {first['device_name']}, {first['threads']} threads"
    )
    print(head)
    for r in rows:
        if "skipped" in r:
            print(f"{r['mode']:8} skipped: {r['skipped']}")
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        peak = f"{r['peak_tflops']:.3f}" if r["peak_tflops"] else "n/a"
        print(f"{r['mode']:8} {r['tokens_per_s']:>10,.0f} {r['step_s']:>8.3f} "
              f"{r['achieved_tflops']:>9.4f} {peak:>8} {mfu:>7} {r['peak_memory_gb']:>7.2f}")


@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--steps", type=int, default=10, help="measured steps")
    ap.add_argument("--warmup", type=int, default=3, help="unmeasured steps first")
    ap.add_argument("--modes", default="trainer,plain,hf",
                    help="comma-separated: " + ",".join(MODES))
    ap.add_argument("--json", action="store_true", help="print one JSON line per mode only")
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    args, overrides = ap.parse_known_args(argv)
    if args._child:
        print(json.dumps(measure(args._child, overrides, args.steps, args.warmup)), flush=True)
        return 0
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        ap.error(f"unknown mode(s) {sorted(unknown)}; choose from {', '.join(MODES)}")
    compose_config(overrides)  # fail fast on a bad recipe or key, before any child starts
    rows = []
    for mode in modes:
        if not args.json:
            print(f"[bench] {mode}: {args.warmup} warm-up + {args.steps} measured steps ...",
                  file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "pretrain.tools.bench", "--_child", mode,
               "--steps", str(args.steps), "--warmup", str(args.warmup), *overrides]
        out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            return out.returncode
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        if args.json:
            print(json.dumps(row))
    if not args.json:
        print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
