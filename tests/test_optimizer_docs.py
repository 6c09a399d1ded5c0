"""docs/optimizers.md names every registered optimizer (optim/specs.py OPTIMIZERS): each has
its row in the table of what the optimizers do and in the table of the keys each reads, and
that row lists exactly its spec's ``reads``; a row for a name that is not registered fails
too. A new optimizer's module fails this test until its rows are written."""

from __future__ import annotations

import re

from helpers import REPO

from pretrain.optim.specs import OPTIMIZERS

DOC = REPO / "docs" / "optimizers.md"
ROW = re.compile(r"^\| `([a-z0-9_]+)` \|(.*)$", re.M)


def table_after(text: str, header: str) -> dict[str, str]:
    """The rows ``| `name` | rest`` of the Markdown table whose header line is ``header``."""
    start = text.index(header)
    block = text[start:].split("\n\n", 1)[0]
    return dict(ROW.findall(block))


def doc_problems(text: str, specs: dict) -> list[str]:
    found = []
    does = table_after(text, "| `optim=` | what it does |")
    reads = table_after(text, "| `optim=` | reads |")
    for name, s in specs.items():
        if name not in does:
            found.append(f"docs/optimizers.md: no row for `{name}` in the table of what "
                         "each optimizer does")
        if name not in reads:
            found.append(f"docs/optimizers.md: no row for `{name}` in the table of the keys "
                         "each optimizer reads")
        elif set(re.findall(r"`optim\.(\w+)`", reads[name])) != set(s.reads):
            found.append(f"docs/optimizers.md: `{name}` reads "
                         f"{', '.join(f'optim.{k}' for k in sorted(s.reads))}, not what its "
                         "row says")
    found += [f"docs/optimizers.md: `{n}` is no registered optimizer"
              for n in sorted((set(does) | set(reads)) - set(specs))]
    return found


def test_docs_name_every_optimizer_and_the_keys_it_reads():
    assert doc_problems(DOC.read_text(), OPTIMIZERS) == []


def test_the_check_finds_a_missing_row_a_wrong_key_and_a_stale_name():
    text = ("| `optim=` | what it does | state |\n|---|---|---|\n| `adamw` | x | y |\n"
            "| `gone` | x | y |\n\n| `optim=` | reads |\n|---|---|\n"
            "| `adamw` | `optim.betas` |\n| `lamb` | `optim.betas`, `optim.eps`, "
            "`optim.weight_decay` |\n")
    specs = {n: OPTIMIZERS[n] for n in ("adamw", "lamb")}
    assert doc_problems(text, specs) == [
        "docs/optimizers.md: `adamw` reads optim.betas, optim.eps, optim.fused, "
        "optim.weight_decay, not what its row says",
        "docs/optimizers.md: no row for `lamb` in the table of what each optimizer does",
        "docs/optimizers.md: `gone` is no registered optimizer"]
