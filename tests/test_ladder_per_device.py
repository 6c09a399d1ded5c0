"""tools/ladder.py --per-device K: several rungs at once on one GPU (issue 49: a 10M rung's
step is host-bound, one process cannot fill the GPU). Checked on the CPU through the
commands and environments it builds, and processes that report what they see."""

from __future__ import annotations

import sys

import pytest

from pretrain.tools import ladder


def test_dry_run_puts_k_streams_on_each_gpu(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert ladder.main(["--recipe", "ladder-mix", "--sizes", "12,16,20,24", "--jobs", "4",
                        "--per-device", "2", "--dry-run", "--", "data.root=/data",
                        f"runs_dir={tmp_path}"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("stream")]
    assert len(lines) == 8  # 4 streams x (sources, branches)
    devices = [ln.split("CUDA_VISIBLE_DEVICES=")[1].split(")")[0] for ln in lines]
    assert devices == ["0", "0", "0", "0", "1", "1", "1", "1"]


def test_streams_keep_to_the_visible_gpus():
    envs = ladder.stream_envs(3, 2, {"CUDA_VISIBLE_DEVICES": "4,6", "X": "1"})
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["4", "4", "6"]
    assert all(e["X"] == "1" for e in envs)
    assert ladder.stream_envs(2, 0, {"A": "b"}) == [{"A": "b"}, {"A": "b"}]
    with pytest.raises(ValueError, match="--per-device 1 puts 3 streams on 3 GPUs"):
        ladder.stream_envs(3, 1, {"CUDA_VISIBLE_DEVICES": "0,1"})


def test_each_stream_runs_with_its_gpu(tmp_path):
    """run_streams starts every stream's commands in that stream's environment."""
    report = "import os, sys; open(sys.argv[1], 'w').write(os.environ['CUDA_VISIBLE_DEVICES'])"
    plan = [[[sys.executable, "-c", report, str(tmp_path / f"s{i}-{j}")] for j in range(2)]
            for i in range(4)]
    assert ladder.run_streams(plan, ladder.stream_envs(4, 2, {})) == 0
    seen = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert seen == {f"s{i}-{j}": str(i // 2) for i in range(4) for j in range(2)}
