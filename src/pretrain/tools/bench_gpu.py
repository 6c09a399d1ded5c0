"""The one-GPU benchmark of docs/benchmarks.md: two models x four settings through
tools/bench.py (the trainer's step), plus a `plain` reference row per model (nanoGPT's loop
over the same model, compiled, at the baseline setting), written as a markdown table ready
to paste there.

    python tools/bench_gpu.py                    # everything, on one GPU
    python tools/bench_gpu.py --dry-run          # resolve every cell, print the commands
    python tools/bench_gpu.py --models gpt3-1.3b --settings bf16-compile,fp8-tensorwise

Each cell is one `tools/bench.py ... --modes trainer --json` process (its own peak memory)
whose budget is exactly the steps it times (`budget=steps`: the recipes' own budgets are
thousands of epochs of the embedded corpus, which the epochs check refuses); results.jsonl
and results.md in --out are rewritten after every cell, so a matrix cut short keeps what it
measured. Targets (MFU_TARGET, FP8_SPEEDUP_TARGET, PLAIN_TARGET): gpt3-1.3b in bf16 at
>= 50% MFU, fp8 at >= 1.3x the tokens/s of bf16 with compile at the same batch, and the
trainer at least as fast as the plain loop.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from pretrain.config.paths import REPO
from pretrain.errors import cli

# Models at a batch of micro x accumulation that fits an 80 GB GPU without activation
# checkpointing (tools/plan.py: 62 GiB for gpt3-1.3b at micro batch 8) and gives steps short
# enough to time; every setting of a model uses the same batch.
MODELS = {
    "gpt2-124m": ("+recipe=gpt2-124m", "parallel.micro_batch_size=16",
                  "train.global_batch_size=64"),
    "gpt3-1.3b": ("+recipe=gpt3-1.3b", "parallel.micro_batch_size=8",
                  "train.global_batch_size=32"),
}
# Shared by every cell: the embedded corpus, so nothing is downloaded (the text does not
# change the step time; the models keep GPT-2's vocabulary for the logits), and that
# vocabulary padded to a multiple of 128, as Megatron-LM does, for aligned matmuls.
COMMON = ("data=stdlib", "model.pad_vocab_to=128")
# Attention `auto`: SDPA with cuDNN first on Hopper (faster there than flash-attn 2),
# flash-attn before Hopper when installed (attention.resolve_backend).
SETTINGS = {
    "bf16-sdpa": ("precision=bf16", "model.attention=sdpa", "train.compile=false"),
    "bf16-compile": ("precision=bf16", "model.attention=auto", "train.compile=true"),
    "fp8-tensorwise": ("precision=fp8", "precision.fp8_recipe=tensorwise",
                       "model.attention=auto", "train.compile=true"),
    "fp8-rowwise": ("precision=fp8", "precision.fp8_recipe=rowwise", "model.attention=auto",
                    "train.compile=true"),
}
BASELINE = "bf16-compile"  # what fp8 and the plain loop are compared with; the MFU row
MFU_TARGET = ("gpt3-1.3b", BASELINE, 0.50)
FP8_SPEEDUP_TARGET = 1.3
PLAIN_TARGET = 1.0  # the trainer's tokens/s over the plain loop's, at the baseline
MODES = ("trainer", "plain")


def overrides(model: str, setting: str, steps: int = 20, warmup: int = 5) -> list[str]:
    """A cell's config: the model's recipe and batch, the setting, and a budget of exactly
    the steps it runs (no evaluation, no checkpoint inside the timing)."""
    return [*MODELS[model], *COMMON, *SETTINGS[setting], "budget=steps",
            f"budget.steps={steps + warmup}", "checkpoint=default",
            f"train.eval_interval={steps + warmup + 1}"]


def command(model: str, setting: str, steps: int, warmup: int, mode: str = "trainer"
            ) -> list[str]:
    return [sys.executable, "-m", "pretrain.tools.bench", *overrides(model, setting, steps, warmup),
            "--modes", mode,
            "--json", "--steps", str(steps), "--warmup", str(warmup)]


def resolve_cell(model: str, setting: str, steps: int = 20, warmup: int = 5) -> dict:
    """The device-independent plan of a cell (budget, epochs of the corpus, layout), as the
    run resolves it before it starts: raises ConfigError where the run would stop."""
    from pretrain.budget.compute import resolve_budget
    from pretrain.config.compose import compose_config
    from pretrain.decision.checks import check
    from pretrain.decision.resolve import describe_run

    cfg = compose_config(overrides(model, setting, steps, warmup))
    check(cfg, 1)
    budget = resolve_budget(cfg.model, cfg.budget, cfg.train.global_batch_size)
    return describe_run(cfg, 1, budget)


def cells_of(models: list[str], settings: list[str]) -> list[tuple[str, str, str]]:
    """(model, setting, mode): every trainer cell, and a plain row after each model's
    baseline."""
    out = []
    for m in models:
        for s in settings:
            out.append((m, s, "trainer"))
            if s == BASELINE:
                out.append((m, s, "plain"))
    return out


def shown(cmd: list[str]) -> str:
    """The command as a reader types it, from the repository root."""
    args = ["python", "tools/bench.py", *cmd[3:]]
    return " ".join(shlex.quote(a) for a in args if a != "--json")


def run_cell(cmd: list[str], timeout_s: float) -> dict:
    env = dict(os.environ)
    # torchtitan's setting: fewer fragmentation OOMs near the memory limit
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    try:
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env,
                             timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    if out.returncode != 0:
        sys.stderr.write(out.stderr[-4000:])
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        return {"error": lines[-1][:200] if lines else f"exit status {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def environment() -> str:
    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (f"{gpu}, torch {torch.__version__} (CUDA {torch.version.cuda}), flash-attn "
            f"{version('flash-attn')}, torchao {version('torchao')}, "
            f"{datetime.date.today().isoformat()}")


def speedup(rows: list[dict], row: dict) -> float | None:
    base = next((r for r in rows if r["model"] == row["model"] and r["setting"] == BASELINE
                 and r.get("mode", "trainer") == "trainer" and "tokens_per_s" in r), None)
    if base is None or "tokens_per_s" not in row:
        return None
    return row["tokens_per_s"] / base["tokens_per_s"]


def verdicts(rows: list[dict]) -> list[str]:
    out = []
    model, setting, target = MFU_TARGET
    row = next((r for r in rows if (r["model"], r["setting"]) == (model, setting)), None)
    if row is not None and row.get("mfu") is not None:
        met = "met" if row["mfu"] >= target else "NOT met"
        out.append(f"{model} {setting}: MFU {row['mfu']:.1%} (target >= {target:.0%}: {met})")
    for row in rows:
        ratio = speedup(rows, row)
        if row.get("mode") == "plain" and ratio:
            met = "met" if 1 / ratio >= PLAIN_TARGET else "NOT met"
            out.append(f"{row['model']} {BASELINE}: the trainer at {1 / ratio:.2f}x the "
                       f"plain loop's tokens/s (target >= {PLAIN_TARGET}x: {met})")
        if row["setting"].startswith("fp8") and ratio is not None:
            met = "met" if ratio >= FP8_SPEEDUP_TARGET else "NOT met"
            out.append(f"{row['model']} {row['setting']}: {ratio:.2f}x the tokens/s of "
                       f"{BASELINE} (target >= {FP8_SPEEDUP_TARGET}x: {met})")
    return out


def markdown(rows: list[dict], env: str) -> str:
    lines = [f"Measured on {env} with `python tools/bench_gpu.py` (one process per row; "
             f"shared overrides `{' '.join(COMMON)}`):", "",
             f"| model | setting | batch (micro x accum) | tokens/s | vs {BASELINE} "
             "| step s | TFLOP/s | peak TFLOP/s | MFU | peak mem GB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        setting = r["setting"] + (" (plain loop)" if r.get("mode") == "plain" else "")
        if "error" in r:
            error = r["error"].replace("|", "\\|")  # a bar would end the table cell
            lines.append(f"| {r['model']} | {setting} | failed: {error} | | | | | | | |")
            continue
        ratio = speedup(rows, r)
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "n/a"
        peak = f"{r['peak_tflops']:.0f}" if r.get("peak_tflops") else "n/a"
        lines.append(
            f"| {r['model']} | {setting} | {r['micro_batch']} x "
            f"{r['global_batch'] // r['micro_batch']} x {r['seq_len']} | "
            f"{r['tokens_per_s']:,.0f} | {f'{ratio:.2f}x' if ratio is not None else ''} | "
            f"{r['step_s']:.3f} | {r['achieved_tflops']:.1f} | {peak} | {mfu} | "
            f"{r['peak_memory_gb']:.1f} |")
    found = verdicts(rows)
    if found:
        lines += ["", "Targets:", "", *(f"- {v}" for v in found)]
    lines += ["", "Commands:", "", "```bash", *(r["command"] for r in rows), "```"]
    return "\n".join(lines) + "\n"


def pick(names: str | None, known: dict, what: str, ap: argparse.ArgumentParser) -> list[str]:
    chosen = [n for n in (names or ",".join(known)).split(",") if n]
    unknown = [n for n in chosen if n not in known]
    if unknown:
        ap.error(f"unknown {what} {unknown}; choose from {', '.join(known)}")
    return chosen


@cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--models", help="comma-separated: " + ",".join(MODELS))
    ap.add_argument("--settings", help="comma-separated: " + ",".join(SETTINGS))
    ap.add_argument("--steps", type=int, default=20, help="measured steps per cell")
    ap.add_argument("--warmup", type=int, default=5,
                    help="unmeasured steps first (torch.compile compiles in the first)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per cell")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench_gpu",
                    help="results.jsonl and results.md go here")
    ap.add_argument("--dry-run", action="store_true",
                    help="compose every cell's config (a typo in a key fails here) and print "
                         "the commands; run nothing")
    args = ap.parse_args(argv)
    cells = cells_of(pick(args.models, MODELS, "models", ap),
                     pick(args.settings, SETTINGS, "settings", ap))

    if args.dry_run:
        for model, setting, mode in cells:
            plan = resolve_cell(model, setting, args.steps, args.warmup)
            print(shown(command(model, setting, args.steps, args.warmup, mode)))
            print(f"  # {plan['steps']} steps of {plan['global_batch_tokens']:,} tokens, "
                  f"{plan['epochs']} epochs of {plan['data']}", file=sys.stderr)
        return 0

    env = environment()
    print(f"[bench_gpu] {env}; {len(cells)} cells -> {args.out}", file=sys.stderr, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n, (model, setting, mode) in enumerate(cells, 1):
        cmd = command(model, setting, args.steps, args.warmup, mode)
        print(f"[bench_gpu] {n}/{len(cells)} {model} {setting} {mode}: {shown(cmd)}",
              file=sys.stderr, flush=True)
        row = {"model": model, "setting": setting, "mode": mode, "command": shown(cmd),
               **run_cell(cmd, args.timeout)}
        rows.append(row)
        result = row["error"] if "error" in row else f"{row['tokens_per_s']:,.0f} tokens/s"
        print(f"[bench_gpu]   {result}", file=sys.stderr, flush=True)
        (args.out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (args.out / "results.md").write_text(markdown(rows, env))
    print(markdown(rows, env))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
