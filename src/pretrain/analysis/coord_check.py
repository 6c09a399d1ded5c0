"""Coordinate check (Yang et al. 2022, Tensor Programs V, sec. 9 and Fig. 5): train a tiny
model at several widths for a few steps and record each layer's activation RMS.

Under a parametrisation that transfers (muP, CompleteP) the RMS of every activation stays
the same size as the width grows (a log-log slope near 0, or negative: muP's logits start
near 0); under the standard one some grow with the width (Adam's update of a hidden matrix
adds up coherently over its fan-in). The width grows at a fixed head count (``N_HEAD``
heads, so the head dimension grows too and the 1/d_head attention scale is exercised).

Data: a fixed random Markov chain over ``VOCAB`` tokens (deterministic, learnable, nothing
to prepare or download). Precision: fp32, on the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from pretrain.config.schema import ModelConfig, OptimConfig
from pretrain.model.gpt import GPT, set_attention_backend
from pretrain.optim.specs import build_optimizer

VOCAB = 256
N_HEAD = 4
DEFAULT_WIDTHS = (64, 128, 256, 512, 1024)
PARAMETRIZATIONS = ("sp", "mup", "completep")


def markov_batches(steps: int, batch: int, seq_len: int, seed: int = 0) -> list[torch.Tensor]:
    """``steps`` batches (batch, seq_len + 1) from a sparse random Markov chain: each token
    is followed by one of 4 successors, so there is something to learn."""
    gen = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, VOCAB, (VOCAB, 4), generator=gen)
    out = []
    for _ in range(steps):
        seq = torch.empty(batch, seq_len + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, VOCAB, (batch,), generator=gen)
        for t in range(seq_len):
            pick = torch.randint(0, 4, (batch,), generator=gen)
            seq[:, t + 1] = successors[seq[:, t], pick]
        out.append(seq)
    return out


def model_config(width: int, parametrization: str, base_width: int, n_layer: int = 2,
                 base_depth: int = 1, seq_len: int = 32) -> ModelConfig:
    """The tiny GPT-2-style model at ``width`` (base_depth matters to completep only)."""
    return ModelConfig(n_layer=n_layer, n_head=N_HEAD, d_model=width, vocab_size=VOCAB,
                       seq_len=seq_len, attention="sdpa", parametrization=parametrization,
                       base_width=base_width, base_depth=base_depth)


def _hooks(model: GPT, record: dict[str, float]) -> list:
    """Forward hooks writing each watched module's output RMS into ``record``."""
    def rms(name: str):
        def hook(_module, _inputs, output):
            record[name] = output.detach().float().pow(2).mean().sqrt().item()
        return hook

    watched = {"embedding": model.tok_emb, "logits": model}
    for i, block in model.layers.items():
        watched |= {f"layer{i}.attn": block.attn, f"layer{i}.mlp": block.mlp,
                    f"layer{i}.residual": block}
    return [m.register_forward_hook(rms(n)) for n, m in watched.items()]


def run_width(cfg: ModelConfig, batches: Sequence[torch.Tensor], lr: float,
              seed: int = 0) -> dict[str, list[float]]:
    """Train ``cfg`` on ``batches`` with AdamW at ``lr`` (muP's groups where the config
    says so): layer -> RMS at each step (the forward of step t sees t updates)."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    model.init_weights(seed)
    set_attention_backend(model, "sdpa")
    opt = build_optimizer(model, OptimConfig(lr=lr, weight_decay=0.0), lr, torch.device("cpu"))
    record: dict[str, float] = {}
    handles = _hooks(model, record)
    out: dict[str, list[float]] = {}
    for seq in batches:
        logits = model(seq[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), seq[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        for name, value in record.items():
            out.setdefault(name, []).append(value)
        out.setdefault("loss", []).append(loss.item())
    for h in handles:
        h.remove()
    return out


def slopes(widths: Sequence[int], by_width: dict[int, dict[str, list[float]]]
           ) -> dict[str, list[float]]:
    """layer -> the least-squares slope of log RMS against log width at each step."""
    logw = np.log(np.asarray(widths, dtype=float))
    layers = [k for k in by_width[widths[0]] if k != "loss"]
    steps = len(by_width[widths[0]][layers[0]])
    return {layer: [float(np.polyfit(logw, [math.log(by_width[w][layer][t]) for w in widths],
                                     1)[0]) for t in range(steps)]
            for layer in layers}


def coord_check(parametrizations: Sequence[str] = PARAMETRIZATIONS,
                widths: Sequence[int] = DEFAULT_WIDTHS, steps: int = 5, lr: float = 1e-2,
                batch: int = 8, seq_len: int = 32, n_layer: int = 2, base_depth: int = 1,
                seed: int = 0) -> dict:
    """The whole check: for each parametrisation, RMS per width, layer and step, and the
    slopes; ``max_slope`` is the largest slope over layers and steps."""
    widths = sorted(widths)
    batches = markov_batches(steps, batch, seq_len, seed)
    result = {"widths": widths, "steps": steps, "lr": lr, "batch": batch, "seq_len": seq_len,
              "n_layer": n_layer, "n_head": N_HEAD, "base_width": widths[0],
              "base_depth": base_depth, "parametrizations": {}}
    for kind in parametrizations:
        by_width = {w: run_width(model_config(w, kind, widths[0], n_layer, base_depth,
                                              seq_len), batches, lr, seed) for w in widths}
        s = slopes(widths, by_width)
        result["parametrizations"][kind] = {
            "rms": {str(w): v for w, v in by_width.items()}, "slopes": s,
            "max_slope": max(max(v) for v in s.values()),
            "worst_layer": max(s, key=lambda k: max(s[k]))}
    return result


def plot(result: dict, path: Path) -> Path:
    """One panel per parametrisation: each layer's RMS at the last step against width."""
    from pretrain.analysis.scaling_plot import new_figure, write_png

    kinds = list(result["parametrizations"])
    fig = new_figure((5 * len(kinds), 4.5), dpi=110)
    widths = result["widths"]
    for i, kind in enumerate(kinds):
        ax = fig.add_subplot(1, len(kinds), i + 1)
        r = result["parametrizations"][kind]
        for layer, s in r["slopes"].items():
            ax.plot(widths, [r["rms"][str(w)][layer][-1] for w in widths], marker="o",
                    label=f"{layer} ({s[-1]:+.2f})")
        ax.set(xscale="log", yscale="log", xlabel="width (d_model)",
               ylabel=f"activation RMS at step {result['steps'] - 1}",
               title=f"{kind}: max slope {r['max_slope']:+.2f}")
        ax.legend(fontsize=6)
    return write_png(fig, path)


def summary(result: dict) -> str:
    """A table: each layer's largest slope over the steps, per parametrisation."""
    kinds = list(result["parametrizations"])
    layers = list(result["parametrizations"][kinds[0]]["slopes"])
    lines = [f"{'layer':<18}" + "".join(f"{k:>12}" for k in kinds)]
    for layer in layers:
        lines.append(f"{layer:<18}" + "".join(
            f"{max(result['parametrizations'][k]['slopes'][layer]):>+12.3f}" for k in kinds))
    lines.append(f"{'max':<18}" + "".join(
        f"{result['parametrizations'][k]['max_slope']:>+12.3f}" for k in kinds))
    return "\n".join(lines)
