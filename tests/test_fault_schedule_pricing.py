"""tools/measure_fault_schedule.py's in-run pricing (issue 71): each step of a faulty run
priced at the run's own quiet steps of the same group count."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "measure_fault_schedule.py"


def tool():
    spec = importlib.util.spec_from_file_location("measure_fault_schedule", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_of(step_s: dict[int, float], kill: float, revive: float, slow: float, wall: float):
    """A torchft run of 4 groups: 4-group steps at step_s[4], one group killed at ``kill``
    (3 groups at step_s[3]; from ``revive`` its start-up slows them by ``slow`` s a step), back
    in at kill + 45 s."""
    per, t, s = {}, 0.0, 0
    while t < wall:
        groups = 3 if kill <= t < kill + 45 else 4
        t += step_s[groups] + (slow if kill + revive <= t < kill + 45 else 0.0)
        s += 1
        per[str(s)] = [groups, 3.0, round(t, 3)]
    return {"kills": [[kill, "n2"]], "per_step": per, "groups_started": 4, "wall_s": wall}


def test_a_run_without_slowdown_is_priced_at_its_own_speed():
    run = run_of({4: 0.8, 3: 0.6}, kill=100.0, revive=30.0, slow=0.0, wall=300.0)
    out = tool().effective_in_run(run)
    assert out["in_run_step_s"] == pytest.approx({3: 0.6, 4: 0.8}, abs=2e-3)
    assert out["effective_in_run"] == pytest.approx(1.0, abs=0.01)


def test_a_start_up_that_slows_the_live_groups_costs_what_it_took():
    fast = run_of({4: 0.8, 3: 0.6}, kill=100.0, revive=30.0, slow=0.0, wall=300.0)
    slowed = run_of({4: 0.8, 3: 0.6}, kill=100.0, revive=30.0, slow=0.2, wall=300.0)
    out = tool().effective_in_run(slowed)
    assert out["in_run_step_s"][3] == pytest.approx(0.6, abs=2e-3)  # priced before the revive
    # 15 s of 3-group steps at 0.8 s instead of 0.6: 18-19 steps' 0.2 s = 3.7 s of 300
    lost = tool().effective_in_run(fast)["effective_in_run"] - out["effective_in_run"]
    assert lost == pytest.approx(3.75 / 300, abs=0.004)


def test_a_group_count_with_no_quiet_step_is_not_priced(tmp_path):
    run = run_of({4: 0.8, 3: 0.6}, kill=100.0, revive=2.0, slow=0.3, wall=300.0)
    assert tool().effective_in_run(run, revive_after=2.0) == {"effective_in_run": None,
                                                             "unpriced_groups": [3]}
    run["baseline_step_s"] = {"3": 0.6}  # a no-fault run's price stands in
    assert tool().effective_in_run(run, revive_after=2.0)["priced_by_baseline"] == [3]
    saved = tmp_path / "run.json"
    del run["baseline_step_s"]
    saved.write_text(json.dumps(run))
    out = subprocess.run([sys.executable, str(TOOL), "--reprice", str(saved),
                          "--revive-after", "2"], capture_output=True, text=True,
                         check=True).stdout
    assert json.loads(out)["unpriced_groups"] == [3]
