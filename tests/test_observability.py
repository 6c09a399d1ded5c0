"""Seeing inside a run (issue 56): a torch.profiler trace holding the model's matmuls and
its one-line summary; under DP=2 the collective in the trace and tools/trace_summary.py
naming the rank the others waited for; a straggler named in the log line; a rank that
stalls ending the run within comm.train_timeout_s with one line and exit 76 (and the slow
fault lifted by its PRETRAIN_FAULT_UNTIL file); a CUDA memory snapshot refused on a CPU run;
tools/plot_run.py drawing a finished run's numbers."""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import pytest
from helpers import (
    HERE,
    MARKOV_DATA,
    compose_config,
    failed,
    read_metrics,
    run_ranks,
    run_script,
    write_spec,
)

from pretrain.config.schema import ConfigError
from pretrain.decision.checks import head_suggestion
from pretrain.hardware.profiler_trace import collective_table, summarize, summarize_folder
from pretrain.train.hang import EXIT_HANG
from pretrain.train.services.step_monitor import own_times, straggler
from pretrain.train.trainer import run

NANO = ["model=nano", f"model.vocab_size={256}", "model.seq_len=32", "precision=fp32",
        *MARKOV_DATA, "train.global_batch_size=8", "parallel.micro_batch_size=4",
        "budget=steps", "budget.steps=6", "logging=quiet", "logging.wandb=disabled",
        "logging.log_interval=3", "train.eval_batches=1", "train.eval_interval=3",
        "train.sample_tokens=0", "schedule.warmup_steps=1", "checkpoint.enabled=false",
        "train.noise_scale=false"]
PROFILE = ["profile.enable=true", "profile.wait=1", "profile.warmup=1", "profile.active=2"]


def test_a_profiled_run_writes_a_trace_of_its_matmuls_and_logs_the_summary(
        markov_root, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="pretrain")
    result = run(compose_config([*NANO, f"data.root={markov_root}", *PROFILE]), tmp_path)
    assert result["steps"] == 6
    traces = sorted((tmp_path / "profile").glob("*.json"))
    assert [p.name for p in traces] == ["rank0_step4.json"]  # wait 1, warmup 1, active 2
    (s,) = summarize_folder(tmp_path / "profile")
    assert s.rank == 0 and s.steps == [3, 4]
    assert {"aten::mm", "aten::addmm"} & s.ops  # the model's matmuls
    # The shares and the order of the top ops are this CPU's: which op leads (an aten matmul
    # on one kind, ``autograd::engine::evaluate_function: NativeLayerNormBackward0`` on an
    # AVX512 Xeon) and how much of the window is compute are not asserted, only that they add up.
    assert abs(s.compute + s.comm + s.idle - 1) < 1e-6 and s.compute > 0
    assert s.top and all(name in s.ops and 0 < share <= 1 for name, share in s.top)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("profile ")]
    assert len(lines) == 1 and "rank 0 steps 3-4" in lines[0] and "rank0_step4.json" in lines[0]
    listed = lines[0].split("top self time: ", 1)[1].split(" (trace: ")[0]  # "op 20%, ..."
    assert re.fullmatch(r".+ \d+%(, .+ \d+%){4}", listed), listed
    assert listed.startswith(f"{s.top[0][0]} ")  # the summary's own largest entry leads
    rows = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 3, 6]
    assert all(0 <= r["data_wait_share"] < 1 and r["step_time_s"] > 0
               and r["tokens_per_s_per_device"] > 0 for r in rows)
    assert all("slowest_rank" not in r for r in rows)  # one rank: nobody to be slower than

    from pretrain.analysis.run_plot import plot  # the run's picture, from the same run

    fig, data = plot([tmp_path], tmp_path / "run.png")
    assert (tmp_path / "run.png").stat().st_size > 10_000
    name = tmp_path.resolve().name
    steps, losses = data["loss"][name]["loss"]
    assert steps == [1, 3, 6] and losses == [r["loss"] for r in rows]
    vsteps, _ = data["loss"][name]["val_loss"]
    assert vsteps == [0, 3, 6]
    assert data["learning rate"][name]["lr"][1] == [r["lr"] for r in rows]
    assert set(data) >= {"gradient norm", "tokens/s", "MFU", "memory (GB)"}
    assert data["loss"][name]["val_loss/markov"][0] == [0, 3, 6]  # per source
    drawn = {ax.get_title(): len(ax.get_lines()) for ax in fig.axes}
    assert drawn["loss"] == 3 and drawn["learning rate"] == 1


def test_two_runs_overlay_and_a_missing_run_is_one_line(markov_root, tmp_path, capsys):
    from pretrain.tools.plot_run import main

    for name, lr in (("a", "0.001"), ("b", "0.003")):
        (tmp_path / name).mkdir()
        rows = [{"step": s, "loss": 5.0 - s * float(lr), "lr": float(lr), "total_steps": 3}
                for s in (1, 2, 3)]
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--out",
                 str(tmp_path / "ab.png")]) == 0
    assert "2 run(s); lines per panel: loss 2, learning rate 2" in capsys.readouterr().out
    assert main([str(tmp_path / "nope"), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "metrics.jsonl does not exist" in err[0]


def test_the_summary_of_a_hand_made_trace():
    """10 ms window: a 4 ms matmul (with a 1 ms child), a 3 ms all-reduce, 3 ms idle."""
    ev = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#7", "ts": 0, "dur": 10_000,
           "pid": 1, "tid": 1},
          {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 4_000, "pid": 1,
           "tid": 1},
          {"ph": "X", "cat": "cpu_op", "name": "aten::empty", "ts": 1_000, "dur": 1_000,
           "pid": 1, "tid": 1},
          {"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "ts": 5_000, "dur": 3_000,
           "pid": 1, "tid": 1}]
    s = summarize({"traceEvents": ev, "distributedInfo": {"rank": 3}})
    assert (s.rank, s.steps) == (3, [7])
    assert (s.compute, s.comm, s.idle) == pytest.approx((0.4, 0.3, 0.3))
    assert dict(s.top) == pytest.approx({"c10d::allreduce_": 3 / 7, "aten::mm": 3 / 7,
                                         "aten::empty": 1 / 7})
    other = summarize({"traceEvents": [*ev[:3], {**ev[3], "dur": 1_000}]}, rank=4)
    (line,) = collective_table([s, other])
    assert line.startswith("c10d::allreduce_: 1 calls; r3 3.0 ms, r4 1.0 ms; slowest rank 4")


def test_the_straggler_is_the_rank_the_others_wait_for():
    # rank 1 prepares 0.3 s longer; every rank's step lasts 0.5 s
    own = own_times([0.5, 0.5, 0.5], [0.05, 0.35, 0.05])
    assert own == pytest.approx([0.2, 0.5, 0.2])
    assert straggler(own, 0.2) == (1, pytest.approx(1.5))
    assert straggler([0.2, 0.21], 0.2) is None and straggler([0.5], 0.2) is None
    assert straggler([0.2, 0.25], 0.2) == (1, pytest.approx(0.25))  # against the other one


def test_a_memory_snapshot_is_refused_on_a_cpu_run(markov_root, tmp_path):
    cfg = compose_config([*NANO, f"data.root={markov_root}", "profile.memory_snapshot=true"])
    with pytest.raises(ConfigError) as e:
        run(cfg, tmp_path)
    (line,) = e.value.lines()
    assert "profile.memory_snapshot=true needs a CUDA device" in line and "cpu" in line


def test_the_head_count_suggested_divides_the_width():
    assert head_suggestion(100) == "2 heads of 50"
    assert head_suggestion(768) == "12 heads of 64"


def two_rank_run(markov_root: Path, tmp_path: Path, *overrides: str, fault: str,
                 timeout: float = 180, launch=run_ranks):
    """Two ranks of tests/observe_worker.py with a fault injected: forked from one import
    (helpers.run_ranks) unless ``launch`` is ``run_script`` (torchrun, where its teardown is
    part of what the test times)."""
    cfg = compose_config([*NANO, f"data.root={markov_root}", "parallel=ddp",
                          "parallel.dp=2", *overrides])
    spec = write_spec(tmp_path / "spec.pkl", cfg=cfg, run_dir=str(tmp_path / "run"))
    t0 = time.monotonic()
    proc = launch(HERE / "observe_worker.py", str(spec), nproc=2, cwd=tmp_path,
                  timeout=timeout, env={"PRETRAIN_FAULT": fault,
                                        "PRETRAIN_FAULT_MARK": str(tmp_path / "mark")})
    return proc, time.monotonic() - t0


@pytest.mark.slow
def test_a_slowed_rank_is_named_and_the_traces_show_whom_the_others_waited_for(
        markov_root, tmp_path, capsys):
    proc, _ = two_rank_run(markov_root, tmp_path, *PROFILE, "profile.ranks=[]",
                           fault="slow:rank=1:seconds=0.3")
    assert proc.returncode == 0, failed(proc)
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    # the first step's warm-up dwarfs the 0.3 s; from then on rank 1 is named every time
    assert [r["step"] for r in rows] == [1, 3, 6]
    assert [r.get("slowest_rank") for r in rows[1:]] == [1, 1]
    assert all(r["step_time_max_s"] > 0.3 for r in rows[1:])
    assert "rank 1 is a straggler" in proc.stderr
    assert "slowest rank 1" in proc.stderr  # in the log line too
    summaries = summarize_folder(tmp_path / "run" / "profile")
    assert [(s.rank, s.steps) for s in summaries] == [(0, [3, 4]), (1, [3, 4])]
    # rank 0 waits in the all-reduce, rank 1 sleeps outside any op: each for about the 0.3 s
    # a step injected, whatever the step's compute takes on this CPU (as shares of the step,
    # above one half, they held only where a step computed in under 0.3 s)
    waited, slept = (summaries[0].comm * summaries[0].step_ms,
                     summaries[1].idle * summaries[1].step_ms)
    assert waited > 200 and slept > 250, (waited, slept)
    assert summaries[0].comm > summaries[1].comm and summaries[1].idle > summaries[0].idle

    from pretrain.tools.trace_summary import main

    assert main([str(tmp_path / "run" / "profile")]) == 0
    text = capsys.readouterr().out
    assert "profile rank 0 steps 3-4" in text and "profile rank 1 steps 3-4" in text
    assert "collectives over 2 rank(s):" in text
    first = text.split("collectives over 2 rank(s):\n")[1].splitlines()[0]
    assert first.strip().startswith("gloo:all_reduce") and "slowest rank 1" in first


def test_a_slow_fault_sleeps_until_its_until_file_exists(tmp_path, monkeypatch):
    """The Slurm tests slow a run only until the fault is in (tests/test_slurm_nodes.py)."""
    from types import SimpleNamespace

    from pretrain.train.services import fault_injection

    slept: list[float] = []
    monkeypatch.setattr(fault_injection, "time", SimpleNamespace(sleep=slept.append))
    monkeypatch.setenv("PRETRAIN_FAULT_UNTIL", str(tmp_path / "go"))
    fault = fault_injection.Fault(*fault_injection.parse("slow:rank=0:seconds=0.25"))
    fault.before_step(None)
    fault.before_step(None)
    (tmp_path / "go").touch()
    fault.before_step(None)
    assert slept == [0.25, 0.25]


@pytest.mark.slow
def test_a_stalled_rank_ends_the_run_within_the_timeout_with_one_line(markov_root, tmp_path):
    timeout = 4
    proc, _ = two_rank_run(markov_root, tmp_path, f"comm.train_timeout_s={timeout}",
                           fault="stall:rank=1:step=3", launch=run_script)
    ended = time.time()
    stalled = float((tmp_path / "mark").read_text())
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: collective")]
    assert len(lines) == 1, failed(proc)
    assert "at step 3" in lines[0] and "rank(s) [1] did not arrive" in lines[0]
    assert f"within {timeout} s (comm.train_timeout_s)" in lines[0]
    assert f"exitcode  : {EXIT_HANG}" in proc.stderr or f"exit {EXIT_HANG}" in lines[0]
    assert proc.returncode != 0
    # the timeout, the few seconds the ranks wait for each other's word, torchrun's teardown
    print(f"{lines[0]}\nended {ended - stalled:.1f} s after the stall")
    assert ended - stalled < timeout + 15


def test_a_failed_collective_is_named_from_the_traceback():
    """The innermost torch.distributed collective on the stack and the project's frame that
    called it; an error that is no collective's passes through ``watching`` untouched."""
    import torch.distributed as dist

    from pretrain.train.hang import CollectiveWatch, collective_of, is_collective_failure

    def clip():  # stands in for the project's caller (its file is under tests/, not pretrain/)
        dist.all_reduce(__import__("torch").ones(1))

    with pytest.raises(ValueError) as e:  # no process group: raised inside all_reduce
        clip()
    assert collective_of(e.value).startswith("all_reduce")
    assert is_collective_failure(RuntimeError("[gloo/pair.cc:534] Timed out waiting 4000ms"))
    assert not is_collective_failure(ValueError("a bug"))
    watch = CollectiveWatch(type("Comm", (), {"init_timeout_s": 60, "train_timeout_s": 5}))
    with pytest.raises(ValueError), watch.watching(lambda: 3):
        raise ValueError("a bug")  # not a collective's: re-raised, no exit


def test_the_missing_ranks_are_named_by_node(tmp_path, monkeypatch):
    """The hang line names each missing rank's node (several nodes only), and the job's first
    node writes the lost nodes, without its own, where the launcher asked for them."""
    from pretrain.train.hang import LOST_NODES_FILE, CollectiveWatch, where

    nodes = ["n1", "n1", "n2", "n2", "n3", "n3"]
    assert where([2, 3, 5], nodes) == " (node n2: ranks 2, 3; node n3: rank 5)"
    assert where([1], ["h", "h"]) == "" and where([], nodes) == ""
    watch = CollectiveWatch(type("Comm", (), {"init_timeout_s": 60, "train_timeout_s": 5}))
    watch.nodes = nodes
    lost = tmp_path / "lost_nodes"
    monkeypatch.setenv(LOST_NODES_FILE, str(lost))
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    monkeypatch.setenv("SLURM_NODEID", "1")  # not the first node: it does not judge
    watch._write_lost_nodes([1, 2, 3])
    assert not lost.exists()
    monkeypatch.setenv("SLURM_NODEID", "0")
    watch._write_lost_nodes([1, 2, 3])
    assert lost.read_text() == "n2\n"  # n1's own rank 1 is stuck, not its node lost


def test_trace_summary_without_traces_is_one_line(tmp_path, capsys):
    from pretrain.tools.trace_summary import main

    assert main([str(tmp_path / "nope")]) == 2
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "is not a folder" in err[0] and "profile.enable=true" in err[1]
