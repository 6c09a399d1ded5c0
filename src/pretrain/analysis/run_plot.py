"""A run's picture from its metrics.jsonl, without wandb: one panel per quantity (training
and validation loss per source, LR, gradient norm, tokens/s, MFU, memory), several runs
overlaid, one colour per run (training loss solid, validation dashed, each source its own
marker). ``panels`` is the figure's data, so tests read what is drawn."""

from __future__ import annotations

import json
from pathlib import Path

from pretrain.analysis.scaling_plot import new_figure, write_png
from pretrain.errors import UserError

# panel title -> the metrics keys drawn in it (a key ending in "/" is a prefix: one line
# per key under it, e.g. one validation loss per source)
PANELS: dict[str, tuple[str, ...]] = {
    "loss": ("loss", "val_loss", "val_loss/"),
    "learning rate": ("lr",),
    "gradient norm": ("grad_norm",),
    "tokens/s": ("tokens_per_s",),
    "MFU": ("mfu",),
    "memory (GB)": ("memory_gb", "memory_reserved_gb"),
}

Series = dict[str, tuple[list[int], list[float]]]


def read_rows(run_dir: Path) -> list[dict]:
    """Every row of ``run_dir``/metrics.jsonl; a step logged twice (killed after logging,
    redone on resume) keeps its last row per key."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise UserError(f"{path} does not exist: give a run directory (runs/NAME) of a run "
                        "that has logged at least one step")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _drawn(key: str, value: object, keys: tuple[str, ...]) -> bool:
    """Whether ``key``'s ``value`` is a number a panel of ``keys`` draws."""
    wanted = key in keys or any(k.endswith("/") and key.startswith(k) for k in keys)
    return wanted and isinstance(value, int | float)


def _lines(rows: list[dict], keys: tuple[str, ...]) -> Series:
    lines: dict[str, dict[int, float]] = {}
    for row in rows:
        for key, value in row.items():
            if _drawn(key, value, keys):
                lines.setdefault(key, {})[int(row["step"])] = float(value)
    return {k: (sorted(v), [v[s] for s in sorted(v)]) for k, v in lines.items()}


def series(rows: list[dict]) -> dict[str, Series]:
    """Panel -> metrics key -> (steps, values), the numbers the figure draws."""
    return {title: _lines(rows, keys) for title, keys in PANELS.items()}


def panels(run_dirs: list[Path]) -> dict[str, dict[str, Series]]:
    """Panel -> run label -> its series: what ``plot`` draws."""
    labels = [Path(d).resolve().name for d in run_dirs]
    if len(set(labels)) < len(labels):  # two runs of one name: say where they are
        labels = [str(d) for d in run_dirs]
    data: dict[str, dict[str, Series]] = {title: {} for title in PANELS}
    for label, d in zip(labels, run_dirs, strict=True):
        for title, lines in series(read_rows(Path(d))).items():
            if lines:
                data[title][label] = lines
    return data


def plot(run_dirs: list[Path], out: Path | str):
    """The figure of ``run_dirs`` written to ``out`` (PNG, or what its suffix says);
    returns (figure, ``panels``)."""
    data = panels(run_dirs)
    shown = [t for t in PANELS if data[t]]
    cols = 2
    rows = (len(shown) + cols - 1) // cols
    fig = new_figure(figsize=(11, 3.2 * rows))
    colours = [f"C{i}" for i in range(10)]
    runs = list(dict.fromkeys(label for t in shown for label in data[t]))
    for i, title in enumerate(shown):
        ax = fig.add_subplot(rows, cols, i + 1)
        for label, lines in data[title].items():
            colour = colours[runs.index(label) % len(colours)]
            for key, (steps, values) in lines.items():
                style = "--" if key.startswith("val_") else "-"
                marker = "o" if key.startswith("val_loss/") else None
                name = label if len(lines) == 1 else f"{label}: {key}"
                ax.plot(steps, values, style, color=colour, marker=marker, markersize=3,
                        label=name)
        ax.set_title(title)
        ax.set_xlabel("step")
        if title == "MFU":
            ax.yaxis.set_major_formatter(lambda v, _: f"{v:.1%}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    write_png(fig, out)
    return fig, data
