"""ft.mode=torchft on this machine (two replica groups as two train.py
processes and a Lighthouse in this one, no Slurm): a full restart resumes every group from
its checkpoint, a group with nothing heals from a live peer, and both give the state of the
uninterrupted run bit for bit (model and optimizer); the groups outlive a Lighthouse started
again at its address. The multi-node version, a node killed
and healed, is tests/test_slurm_nodes.py's ``test_a_node_lost_under_torchft...``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from helpers import CORPUS_FILES, DATA_NAME, REPO, TOKENIZER_VOCAB, kill_tree, launch_env

pytest.importorskip("torchft")

pytestmark = pytest.mark.slow


def lighthouse_server(min_replicas: int, port: int = 0):
    """A torchft Lighthouse in this process (what slurm/ft_lighthouse.sh runs)."""
    os.environ.setdefault("RUST_LOG", "warn")  # not a line for every quorum
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind=f"[::]:{port}", min_replicas=min_replicas,
                            join_timeout_ms=2000, heartbeat_timeout_ms=2000)


@contextmanager
def lighthouse(min_replicas: int):
    """A Lighthouse on a free port; yields its address."""
    server = lighthouse_server(min_replicas)
    try:
        yield server.address()
    finally:
        server.shutdown()


def ft_args(work_dir: Path, runs: Path, steps: int, address: str, interval: int) -> list[str]:
    """The nano model in fp32, two replica groups of one process, 4 sequences a group."""
    return ["+recipe=tiny-zero3", "model=nano", "precision=fp32", "parallel=single",
            "model.vocab_size=300", "data.source=text", f"data.name={DATA_NAME}",
            f"data.data_files=[{','.join(CORPUS_FILES)}]",
            f"data.tokenizer_vocab_size={TOKENIZER_VOCAB}", "data.validation_fraction=0.1",
            "data.num_proc=1", f"data.root={work_dir / 'data'}", f"runs_dir={runs}",
            "run_name=ft", "budget=steps", f"budget.steps={steps}",
            "train.global_batch_size=4", "parallel.micro_batch_size=2",
            "schedule.warmup_steps=2", "train.eval_batches=2", f"train.eval_interval={steps}",
            "train.sample_tokens=0", "logging=quiet", "logging.log_interval=1",
            "checkpoint.enabled=true", f"checkpoint.interval_steps={interval}",
            "checkpoint.async_save=false", "ft.mode=torchft",
            "ft.groups=2", f"ft.lighthouse={address}"]


def run_groups(args: list[str], cwd: Path, timeout: float = 240,
               meanwhile=lambda: None) -> list[str]:
    """Both groups to the end (``meanwhile`` called once they are started); their logs."""
    procs = [subprocess.Popen([sys.executable, str(REPO / "train.py"), *args], cwd=cwd,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=launch_env(OMP_NUM_THREADS="1", PRETRAIN_FT_GROUP=str(g)),
                              start_new_session=True) for g in (0, 1)]
    logs = []
    try:
        meanwhile()
        for proc in procs:
            logs.append(proc.communicate(timeout=timeout)[0])
            assert proc.returncode == 0, logs[-1][-4000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc.pid)
    return logs


def steps_logged(metrics: Path) -> int:
    return metrics.read_text().count('"loss"') if metrics.exists() else 0


def saved_state(checkpoint: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """A DCP checkpoint's model and optimizer tensors, by name."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{checkpoint.parent.parent.name}-{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, out)

    def flat(d: dict, prefix: str = "") -> dict:
        items = {}
        for k, v in d.items():
            items.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else
                         {f"{prefix}{k}": v})
        return items

    state = flat(torch.load(out, weights_only=False)["model_optim"])
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def test_a_restart_from_a_checkpoint_and_a_heal_from_a_peer_give_the_same_state(
        work_dir, prepared, tmp_path):
    """Run X: two groups, 8 steps, uninterrupted (a checkpoint at 4). Run Y: group 0 has
    X's step-4 checkpoint (a full restart), group 1 nothing: group 0 resumes from it, group
    1 heals from group 0 at step 4; at step 8 all four states are X's, bit for bit."""
    steps, final = 8, "checkpoints/step_0000008"
    x, y = tmp_path / "x", tmp_path / "y"
    with lighthouse(min_replicas=2) as address:  # every step waits for both groups
        run_groups(ft_args(work_dir, x, steps, address, interval=4), work_dir)
    (y / "ft" / "group0" / "checkpoints").mkdir(parents=True)
    shutil.copytree(x / "ft" / "group0" / "checkpoints" / "step_0000004",
                    y / "ft" / "group0" / "checkpoints" / "step_0000004")
    with lighthouse(min_replicas=2) as address:
        logs = run_groups(ft_args(work_dir, y, steps, address, interval=100), work_dir)
    assert "resumed from" in logs[0] and "step 4" in logs[0], logs[0][-3000:]
    assert "torchft: healed from a live peer at step 4" in logs[1], logs[1][-3000:]
    want = saved_state(x / "ft" / "group0" / final, tmp_path)
    assert_identical(saved_state(x / "ft" / "group1" / final, tmp_path), want)
    for g in (0, 1):
        assert_identical(saved_state(y / "ft" / f"group{g}" / final, tmp_path), want)


def test_the_groups_outlive_a_lighthouse_restarted_at_its_address(work_dir, prepared,
                                                                  tmp_path):
    """The Lighthouse (off the compute nodes) shut down mid-run and started again 2 s later
    at the same address, as slurm/ft_lighthouse.sh does: both groups retry their quorum
    (ft.quorum_retries), train to the end and hold the same state bit for bit."""
    server = lighthouse_server(min_replicas=2)
    address = server.address()
    port = int(address.rsplit(":", 1)[1])
    steps, runs = 30, tmp_path / "runs"
    restarted = []

    def restart_when_training() -> None:
        metrics = runs / "ft" / "group0" / "metrics.jsonl"
        deadline = time.time() + 180
        while time.time() < deadline and steps_logged(metrics) < 8:
            time.sleep(0.2)
        server.shutdown()
        time.sleep(2)
        restarted.append(lighthouse_server(min_replicas=2, port=port))

    try:
        run_groups(ft_args(work_dir, runs, steps, address, interval=100), work_dir,
                   meanwhile=restart_when_training)
    finally:
        for s in restarted:
            s.shutdown()
    assert restarted
    final = "checkpoints/step_0000030"
    assert_identical(saved_state(runs / "ft" / "group0" / final, tmp_path),
                     saved_state(runs / "ft" / "group1" / final, tmp_path))


def test_what_torchft_needs_and_refuses_is_named(monkeypatch):
    """No group number, no Lighthouse, a batch ramp, the spike guard: each named with its
    key (the check runs before anything is built)."""
    from helpers import compose_config

    from pretrain.train.fault_tolerant import ft_problems

    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    cfg = compose_config(["ft.mode=torchft", "ft.groups=2", "optim.spike_guard=true",
                          "batch_ramp=tokens"])
    found = " | ".join(ft_problems(cfg, None))
    for part in ("PRETRAIN_FT_GROUP must name this replica group, 0..1", "ft.lighthouse=",
                 "batch_ramp=none", "optim.spike_guard=false"):
        assert part in found, found
    ok = compose_config(["ft.mode=torchft", "ft.lighthouse=http://host:29510"])
    assert ft_problems(ok, 1) == [] and ft_problems(ok, 2) != []
    assert ft_problems(compose_config([]), None) == []  # off: nothing asked
