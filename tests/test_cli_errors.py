"""The project's own errors reach the user as one line per mistake on stderr, exit 2, once
(pretrain/errors.py): from train.py (Hydra's task function and a Hydra callback), from the
tools, and from a torchrun of several ranks; the traceback only with HYDRA_FULL_ERROR=1."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, launch_env
from train_forks import train_py

from pretrain.config.naming import check_runs_dir
from pretrain.config.schema import ConfigError
from pretrain.data.errors import DataError
from pretrain.errors import AGENT_REPORTS, UserError, cli, report
from pretrain.model.attention import AttentionBackendError

TRAIN = str(REPO / "train.py")
TOOLS = REPO / "src" / "pretrain" / "tools"


def train(tmp_path: Path, *overrides: str, **env: str) -> subprocess.CompletedProcess:
    """``python train.py`` as a user runs it, its run directories under ``tmp_path``: in a
    fresh fork of a process that imported it (tests/train_forks.py)."""
    args = [*overrides] + ([] if any(o.startswith("runs_dir=") for o in overrides)
                           else [f"runs_dir={tmp_path / 'runs'}"])
    return train_py(*args, cwd=tmp_path, env=env)


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.strip()]


@pytest.mark.parametrize("overrides,key,fix", [
    # a key the schema lacks, added with Hydra's "+" (config/structured.to_config)
    (["+train.lr_typo=1"], "train.lr_typo", "python train.py --cfg job"),
    # a plain override of a key the schema lacks: checked before Hydra, with the nearest key
    # (Hydra's own message would advise the "+" that to_config then refuses)
    (["train.lr=1e-3"], "train.lr", "did you mean optim.lr?"),
    # the attention backend (model/attention.py), decided on this CPU
    (["model.attention=flash", "train.device=cpu"], "model.attention=flash",
     "model.attention=sdpa"),
    # Hydra's own errors, checked before it composes (config/naming.check_override_values):
    # a recipe that does not exist (its nearest names), a value outside a key's options
    (["+recipe=tiny-zro3"], "no recipe named 'tiny-zro3'", "the nearest: tiny-zero3,"),
    (["+recipe=nonexistent"], "no recipe named 'nonexistent'", "(all "),
    (["model=gpt5"], "no model option named 'gpt5' in conf/model/", "the nearest: "),
    (["model.norm=batchnorm"], "'batchnorm' is not a value of model.norm",
     "the options: layernorm, rmsnorm"),
    # a head count that does not divide the width: the suggestion divides it
    (["model.d_model=100"], "model.n_head=6 does not divide model.d_model=100",
     "2 heads of 50"),
])
def test_train_py_prints_one_line_naming_the_key_and_exits_2(tmp_path, overrides, key, fix):
    proc = train(tmp_path, *overrides, "dry_run=true")
    assert proc.returncode == 2, proc.stderr
    (line,) = error_lines(proc)
    assert line.startswith("error: ") and key in line and fix in line, line
    assert proc.stdout == ""


def test_several_problems_are_one_line_each(tmp_path):
    proc = train(tmp_path, "train.global_batch_size=7", "train.z_loss=100", "dry_run=true")
    assert proc.returncode == 2
    lines = error_lines(proc)
    assert len(lines) == 2 and all(line.startswith("error: ") for line in lines), lines
    assert "train.global_batch_size=7" in lines[0] and "train.z_loss=100" in lines[1]


def test_hydra_full_error_shows_the_traceback(tmp_path):
    proc = train(tmp_path, "train.global_batch_size=7", "dry_run=true", HYDRA_FULL_ERROR="1")
    assert proc.returncode != 0
    assert "Traceback (most recent call last)" in proc.stderr
    assert "pretrain.config.schema.ConfigError" in proc.stderr
    assert "train.global_batch_size=7" in proc.stderr


def test_a_runs_dir_that_is_a_file_is_one_line(tmp_path):
    """A file where runs_dir should be a directory: refused by the Hydra callback before
    Hydra makes the run directory, not a bare NotADirectoryError."""
    (tmp_path / "afile").write_text("not a directory\n")
    runs = tmp_path / "afile"
    # a real interpreter start of train.py (train_forks.py's forks run the same code)
    proc = subprocess.run([sys.executable, TRAIN, f"runs_dir={runs}", "dry_run=true"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=launch_env())
    assert proc.returncode == 2, proc.stderr
    (line,) = error_lines(proc)
    assert line.startswith(f"error: runs_dir={runs} is a file") and "runs_dir=runs" in line
    assert "NotADirectoryError" not in proc.stderr and "Traceback" not in proc.stderr
    # the tools that compose a config refuse it the same way (config/compose.py)
    tool = subprocess.run([sys.executable, str(REPO / "tools" / "run_local.py"), "--print",
                           f"runs_dir={runs}"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=launch_env())
    assert tool.returncode == 2 and error_lines(tool) == [line]


def test_a_runs_dir_under_a_file_names_the_file(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(NotADirectoryError, match=f"is under {tmp_path / 'afile'}, which is a "
                       "file, not a directory.*runs_dir=runs"):
        check_runs_dir(tmp_path / "afile" / "sub" / "deeper")
    check_runs_dir(tmp_path / "new" / "runs")  # made when the run starts
    check_runs_dir(tmp_path)


def test_every_tool_reports_through_the_shared_mechanism():
    """Every tool's ``main`` is wrapped by pretrain.errors.cli (one mechanism, no copies)."""
    unwrapped = [p.name for p in TOOLS.glob("*.py")
                 if "\ndef main(" in p.read_text() and "\n@cli\ndef main(" not in p.read_text()]
    assert unwrapped == []
    text = "\n".join(p.read_text() for p in TOOLS.glob("*.py"))
    assert not re.search(r'print\(f"(error|run_local|launch|plan): \{', text)


def test_a_tool_turns_any_project_error_into_its_line(capsys):
    @cli
    def main(error: Exception) -> int:
        raise error

    for error in (ConfigError(["a.b=1 is bad; set a.b=2", "c.d=0 must be positive"]),
                  DataError("data.name=x is not prepared\n  run tools/prepare_data.py"),
                  AttentionBackendError("model.attention=flash cannot run: use sdpa")):
        assert isinstance(error, UserError) and main(error) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["error: a.b=1 is bad; set a.b=2", "error: c.d=0 must be positive",
                   "error: data.name=x is not prepared run tools/prepare_data.py",
                   "error: model.attention=flash cannot run: use sdpa"]
    with pytest.raises(ZeroDivisionError):  # a bug keeps its traceback
        main(ZeroDivisionError("bug"))


def test_under_torchrun_a_rank_writes_its_line_to_the_agents_error_file(
        tmp_path, monkeypatch, capsys):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.setenv("RANK", "1")
    assert report(DataError("data.x=1 is bad")) == 2
    assert capsys.readouterr().err == ""  # rank 1 stays quiet; rank 0 prints
    entry = json.loads(path.read_text())["message"]
    assert entry["message"] == entry["extraInfo"]["py_callstack"] == "error: data.x=1 is bad"
    monkeypatch.setenv("RANK", "0")
    report(DataError("data.x=1 is bad"))
    assert capsys.readouterr().err == "error: data.x=1 is bad\n"
    monkeypatch.setenv(AGENT_REPORTS, "1")  # pretrain.launch.torchrun prints it instead
    report(DataError("data.x=1 is bad"))
    assert capsys.readouterr().err == ""


FAILING_RANK = """
import os, time
from pretrain.config.naming import check_runs_dir
from pretrain.config.schema import ConfigError
from pretrain.errors import exit_on_user_error
with exit_on_user_error():
    if os.environ["RANK"] == "1":
        raise ConfigError(["x.y=1 is wrong on this rank; set x.y=2"])
time.sleep(60)  # rank 0: stopped by the agent once rank 1 failed
"""


def test_run_locals_torchrun_prints_a_ranks_error_once_and_exits_2(tmp_path):
    """Two ranks under pretrain.launch.torchrun (tools/run_local.py's launcher), one failing
    alone: its line once, exit 2, and no traceback or failure table from the agent."""
    script = tmp_path / "fail.py"
    script.write_text(FAILING_RANK)
    proc = subprocess.run([sys.executable, "-m", "pretrain.launch.torchrun", "--standalone",
                           "--nproc_per_node=2", str(script)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120,
                          env=launch_env(OMP_NUM_THREADS="1"))
    assert proc.returncode == 2, proc.stderr
    ours = [line for line in error_lines(proc) if line.startswith("error: ")]
    assert ours == ["error: x.y=1 is wrong on this rank; set x.y=2"], proc.stderr
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr
