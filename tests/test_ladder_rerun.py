"""Anyone can check the ladder (issue 55): a rung of recipes/ladder-pinned.yaml rerun from a
pinned corpus lands within the seed spread of its committed figure. At tiny scale here: the
smallest rung (width 16, batch 1 by the ladder's rule) at 3 tokens/param on a wheel built the
same byte for byte everywhere (tests/wheels.py); its committed figure is
tests/data/ladder_rung.json. The full-scale check is ``tools/ladder_check.py rung RUN_DIR``
against docs/ladder/runs.csv."""

from __future__ import annotations

import json
import math

from helpers import REPO, read_result
from train_forks import train_py
from wheels import make_wheel, sha256

COMMITTED = REPO / "tests" / "data" / "ladder_rung.json"


def corpus() -> dict[str, bytes]:
    """Python-like text, the same on every machine."""
    words = ["def", "return", "self", "import", "value", "index", "for", "in", "if", "None"]
    files = {}
    for i in range(40):
        lines = [f"def func_{i}_{j}(self, {words[(i + j) % 10]}):\n    return "
                 f"{words[(i * j) % 10]} + {i * j % 97}\n" for j in range(120)]
        files[f"pkg/mod{i:02d}.py"] = "".join(lines).encode()
    return files


def test_a_rung_reruns_within_the_seed_spread_of_its_committed_figure(tmp_path):
    whl = make_wheel(tmp_path / "data" / "wheels", "pkg", "1.0", corpus())
    mixture = ("data.mixture=[{name: tiny, weight: 1.0, source: wheel, data_files: ['"
               f"{whl.name}#sha256={sha256(whl)}']}}]")
    out = train_py("+recipe=ladder-pinned", f"data.root={tmp_path / 'data'}", mixture,
                   "model.d_model=16", "budget.tokens_per_param=3",
                   "checkpoint.branch_tokens_per_param=[]", "train.eval_batches=16",
                   f"runs_dir={tmp_path / 'runs'}", "run_name=rung", cwd=REPO,
                   env={"OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = read_result(tmp_path / "runs" / "rung")
    committed = json.loads(COMMITTED.read_text())
    assert sha256(whl) == committed["corpus_sha256"]  # the same pinned bytes as committed
    # the seed spread of this rung: the std of log loss of its two committed seeds (405 steps
    # on a small corpus: about 9%, where the real ladder's is under 1%)
    a, b = committed["final_val_loss"], committed["seed_7_final_val_loss"]
    spread = abs(math.log(a / b)) / math.sqrt(2)
    rel = math.log(result["final_val_loss"] / a)
    assert abs(rel) <= spread, (result["final_val_loss"], a, spread)
