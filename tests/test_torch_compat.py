"""pretrain.torch_compat: every private torch name is looked up on use, checked against the
torch versions it was written for, and a torch without any of them still trains."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from helpers import HERE, MARKOV_DATA, REPO, failed, read_result, run_script

from pretrain import torch_compat
from pretrain.hardware.device import cpu_native_matmul
from pretrain.parallel import pipeline


def test_every_name_written_for_this_torch_is_here():
    """Each name whose use was written for the running torch resolves (CI runs this on
    both tested torches: a name that moved is caught there, not on a cluster)."""
    here = [k for k in torch_compat.PRIVATE if torch_compat.written_for(k)
            and (torch.backends.cuda.is_built() or not torch_compat.PRIVATE[k].cuda_build)]
    assert here, torch.__version__
    assert [k for k in here if not torch_compat.has(k)] == []


def test_a_missing_name_says_what_where_which_torch_and_the_fix(monkeypatch):
    import torch.optim._muon as muon_module  # noqa: F401 (the module the name leaves)

    monkeypatch.delattr("torch.optim._muon._adjust_lr")
    assert not torch_compat.has("muon_adjust_lr")
    with pytest.raises(torch_compat.TorchCompatError) as e:
        torch_compat.private("muon_adjust_lr")
    message = str(e.value)
    for part in ("torch.optim._muon:_adjust_lr", torch.__version__, "2.11 and 2.13",
                 "Fix: install a tested torch", "muon.py"):
        assert part in message, (part, message)


def test_a_moved_name_is_found_where_this_torch_keeps_it(monkeypatch):
    """torch 2.13 keeps _make_tensor_from_meta in pipelining._utils, 2.11 in
    pipelining.stage: either place serves."""
    import torch.distributed.pipelining._utils as utils
    import torch.distributed.pipelining.stage as stage

    real = torch_compat.private("make_tensor_from_meta")
    monkeypatch.delattr(utils, "_make_tensor_from_meta", raising=False)
    monkeypatch.setattr(stage, "_make_tensor_from_meta", real, raising=False)
    assert torch_compat.private("make_tensor_from_meta") is real


def test_an_untested_torch_warns_once_per_name(monkeypatch, caplog):
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    torch_compat._warn_untested.cache_clear()
    with caplog.at_level(logging.WARNING, logger="pretrain"):
        torch_compat.private("replicate")
        torch_compat.private("replicate")
    torch_compat._warn_untested.cache_clear()
    warned = [r.getMessage() for r in caplog.records if "outside the versions" in r.message]
    assert len(warned) == 1 and "2.99.0" in warned[0] and "2.11-2.13" in warned[0], warned


def test_bounded_stage_only_on_the_torch_its_hooks_were_written_for(monkeypatch, caplog):
    """BoundedStage overrides torch 2.13's private receive hooks; where they are gone (or
    torch is another version) the schedule gets torch's own stage, and the log says the
    receive buffers are then held for every microbatch."""
    from torch.distributed.pipelining import PipelineStage

    if torch_compat.torch_minor() == "2.13":
        assert pipeline.stage_class() is pipeline.BoundedStage
        monkeypatch.delattr(PipelineStage, "_setup_forward_recv_info")
    with caplog.at_level(logging.WARNING, logger="pretrain"):
        assert pipeline.stage_class() is pipeline.UncountedStage
    assert "every microbatch" in caplog.text and "_setup_forward_recv_info" in caplog.text


def test_shape_inference_is_uncounted_under_the_name_this_torch_calls():
    """MoE layers do not count the stage's shape-inference forward: the wrapper this torch
    calls (2.13 _forward_metadata_inference, 2.11 _shape_inference) is the project's."""
    hook = torch_compat.private("stage_shape_inference")
    name = hook.__name__
    assert getattr(pipeline.UncountedStage, name) is not hook
    assert getattr(pipeline.UncountedStage, name).__qualname__.startswith("UncountedStage.")


def test_auto_precision_on_a_cpu_without_the_probes_takes_fp32_and_says_why(monkeypatch):
    monkeypatch.delattr("torch.cpu._is_avx512_bf16_supported")
    native, why = cpu_native_matmul(torch.bfloat16)
    assert native is False
    assert "unknown" in why and "torch.cpu._is_avx512_bf16_supported" in why, why


def test_a_torch_without_any_private_name_imports_every_module_and_trains(markov_root,
                                                                          tmp_path):
    """tests/no_private_torch.py takes every name torch_compat lists away from torch (as
    the package sees it), imports every module, then trains a nano model 3 steps on one
    CPU process with precision=auto."""
    runs = tmp_path / "runs"
    proc = run_script(HERE / "no_private_torch.py", str(REPO / "train.py"), "model=nano",
                      *MARKOV_DATA, f"data.root={markov_root}", "budget=steps",
                      "budget.steps=3", "train.global_batch_size=8",
                      "parallel.micro_batch_size=8", "train.sample_tokens=0",
                      "train.device=cpu", "logging=quiet", f"runs_dir={runs}", cwd=tmp_path,
                      timeout=300)
    assert proc.returncode == 0, failed(proc)
    seen = json.loads(proc.stdout.splitlines()[0])
    assert seen["torch"] == torch.__version__
    assert seen["found"] == [], "the package still finds these"
    here = {where for p in torch_compat.PRIVATE.values() for where in p.where
            if _exists(where)}
    assert here - set(seen["taken"]) == set()
    package = REPO / "src" / "pretrain"  # its modules: folders with an __init__.py (not
    # data/lm_eval_tasks/, lm-eval's task files that lm-eval imports, never the package)
    modules = {p.relative_to(REPO / "src").with_suffix("").as_posix().replace("/", ".")
               .removesuffix(".__init__") for p in package.rglob("*.py")
               if all((d / "__init__.py").exists()
                      for d in p.parents if d.is_relative_to(package))}
    assert set(seen["imported"]) == modules - {"pretrain"}
    (run_dir,) = [p for p in runs.iterdir() if p.is_dir()]
    result = read_result(run_dir)
    assert result["steps"] == 3 and 0 < result["final_loss"] < 10
    log = (run_dir / "train.log").read_text()
    assert "precision=auto -> fp32" in log and "is unknown" in log


def _exists(where: str) -> bool:
    try:
        torch_compat._resolve(where)
    except (ImportError, AttributeError):
        return False
    return True


def test_zbv_on_gloo_is_refused_before_torch_2_13(monkeypatch):
    """torch 2.11's pipeline warm-up sends a rank to itself where ZBV's V turns; gloo cannot
    (the run died in its first step): refused naming the fix, NCCL and torch 2.13 let pass."""
    from pretrain.config.schema import ConfigError

    zbv = SimpleNamespace(pp_schedule="zbv")
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    with pytest.raises(ConfigError, match="interleaved_1f1b here, or torch 2.13"):
        pipeline.check_schedule_runs_here(zbv, "cpu")
    pipeline.check_schedule_runs_here(zbv, "cuda")
    pipeline.check_schedule_runs_here(SimpleNamespace(pp_schedule="1f1b"), "cpu")
    monkeypatch.setattr(torch, "__version__", "2.13.0")
    pipeline.check_schedule_runs_here(zbv, "cpu")
