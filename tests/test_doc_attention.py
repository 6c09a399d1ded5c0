"""Document-aware attention (model.attention_mask=document): a packed window computes, for
every token, what its document computes alone.

Three documents, each ended by the end-of-document token (model.eod_id, as data/prepare.py
packs them), fill one window. Under document masking each token's loss equals (fp32, 1e-5)
the loss at the same token when its document runs alone, positions from 0: for learned
positions (nano, GPT-2 style) and RoPE (llama-tiny, grouped-query attention), with the
CPU's backends (SDPA and eager with a boolean block-causal mask); the same under TP=2 and a
1F1B pipeline of two stages (tests/doc_attention_worker.py), where the document ids travel
between stages with the activations. Plain causal attention fails the same comparison
(the test can fail), the option off leaves the causal path untouched, and the compiled
forward + loss is one graph.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from built_once import built_once
from helpers import CONF_DIR, failed, run_ranks, write_spec
from torch._dynamo.utils import counters

from pretrain.config.schema import Config, ModelConfig, ParallelConfig, TrainConfig
from pretrain.model import attention as attention_module
from pretrain.model.attention import (
    AttentionBackendError,
    block_document_mask,
    dense_document_mask,
    document_ids,
    document_positions,
    resolve_backend,
    sdpa_attention,
)
from pretrain.model.gpt import GPT, set_attention_backend
from pretrain.parallel.apply import forward_and_loss

EOD, VOCAB, SEQ, SEED = 0, 256, 64, 7
# Two windows of three documents each (the last one runs past the window: a partial
# document, as the loader's windows cut them); lengths include the EOD token.
DOC_LENGTHS = [(20, 25, 30), (9, 40, 20)]
CPU = torch.device("cpu")


def preset(name: str, **overrides) -> ModelConfig:
    """conf/model/<name>.yaml as a ModelConfig, CPU-test sized."""
    values = yaml.safe_load((CONF_DIR / "model" / f"{name}.yaml").read_text())
    values.update({"vocab_size": VOCAB, "seq_len": SEQ, "n_layer": 2,
                   "attention_mask": "document", "eod_id": EOD, **overrides})
    return ModelConfig(**values)


def packed_windows(lengths=DOC_LENGTHS, seed: int = 0):
    """(x, y, docs): windows of SEQ tokens packed from documents of ``lengths`` (each
    ended by EOD), their next-token targets, and per window its documents' (start, end)."""
    g = torch.Generator().manual_seed(seed)
    xs, ys, spans = [], [], []
    for row in lengths:
        stream = []
        for n in row:
            doc = torch.randint(1, VOCAB, (n,), generator=g)
            doc[-1] = EOD
            stream.append(doc)
        stream = torch.cat(stream)[: SEQ + 1]
        xs.append(stream[:SEQ])
        ys.append(stream[1:])
        ends = [min(sum(row[: i + 1]), SEQ) for i in range(len(row))]
        spans.append(list(zip([0, *ends[:-1]], ends, strict=True)))
    return torch.stack(xs), torch.stack(ys), spans


def token_losses(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="none").view(
        y.shape)


def model_of(cfg: ModelConfig, backend: str = "sdpa") -> GPT:
    model = GPT(cfg)
    model.init_weights(SEED)
    set_attention_backend(model, backend, CPU)
    return model.eval()


def alone_losses(model: GPT, x, y, spans) -> torch.Tensor:
    """Each document of each window run by itself (positions from 0), its tokens' losses
    against the packed window's targets: the reference."""
    out = torch.empty(y.shape)
    with torch.no_grad():
        for row, row_spans in enumerate(spans):
            for start, end in row_spans:
                logits = model(x[row:row + 1, start:end])
                out[row, start:end] = token_losses(logits, y[row:row + 1, start:end])[0]
    return out


def test_document_ids_and_positions():
    tokens = torch.tensor([[5, 3, EOD, 7, EOD, 8, 9, 9]])
    docs = document_ids(tokens, EOD)
    assert docs.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]  # an EOD ends (belongs to) its document
    assert document_positions(docs).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    mask = dense_document_mask(docs)[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False, False, False]
    assert mask[7].tolist() == [False] * 5 + [True] * 3


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ["nano", "llama-tiny"])
def test_each_token_scores_as_its_document_alone(name, backend):
    cfg = preset(name)
    x, y, spans = packed_windows()
    model = model_of(cfg, backend)
    with torch.no_grad():
        packed = token_losses(model(x), y)
    reference = alone_losses(model, x, y, spans)
    torch.testing.assert_close(packed, reference, atol=1e-5, rtol=0)
    # the comparison can fail: plain causal attention lets later documents see earlier ones
    causal = model_of(dataclasses.replace(cfg, attention_mask="causal"), backend)
    with torch.no_grad():
        leaky = token_losses(causal(x), y)
    first = [end for (_, end), *_ in spans]
    assert all((leaky[r, :e] - reference[r, :e]).abs().max() < 1e-5 for r, e in enumerate(first))
    assert (leaky - reference).abs().max() > 1e-3


def test_gradients_stay_within_documents():
    """Backward too: the loss of the last document has no gradient on the tokens' embeddings
    of the documents before it."""
    model = model_of(preset("llama-tiny")).train()
    x, y, spans = packed_windows()
    h = {}

    def keep(module, args, out):
        out.retain_grad()
        h["emb"] = out

    model.tok_emb.register_forward_hook(keep)
    logits = model(x)
    start = spans[0][2][0]
    token_losses(logits[:1, start:], y[:1, start:]).sum().backward()
    grad = h["emb"].grad[0]
    assert grad[:start].abs().max() == 0 and grad[start:].abs().max() > 0


def test_option_off_never_builds_a_document_mask(monkeypatch):
    """attention_mask=causal (the default) runs today's path: no document ids, no mask,
    the kernel called exactly as before (positionally, no mask keyword)."""
    def refuse(*args, **kwargs):
        raise AssertionError("document masking used with attention_mask=causal")

    calls = []

    def spy(q, k, v, dropout_p=0.0, **kwargs):
        calls.append(sorted(kwargs))
        return sdpa_attention(q, k, v, dropout_p, **kwargs)

    from pretrain.model import gpt

    monkeypatch.setattr(gpt, "document_ids", refuse)
    monkeypatch.setattr(gpt, "document_positions", refuse)
    model = model_of(preset("nano", attention_mask="causal"))
    model.mask_builder = refuse
    for layer in model.layers.values():
        layer.attn.kernel = spy
    x, _, _ = packed_windows()
    model(x)
    assert calls == [[], []]
    assert ModelConfig().attention_mask == "causal"


def test_a_window_without_eod_is_plain_causal():
    """No EOD token: one document, positions 0.. and the causal mask: the same logits as
    causal attention (eager: the same masked_fill of the same mask, bit for bit)."""
    cfg = preset("nano", eod_id=VOCAB)  # no token has this id
    x, _, _ = packed_windows()
    on = model_of(cfg, "eager")
    off = model_of(dataclasses.replace(cfg, attention_mask="causal"), "eager")
    with torch.no_grad():
        assert torch.equal(on(x), off(x))


def test_flex_block_mask_matches_the_dense_mask():
    """FlexAttention's block mask (the CUDA path) holds the dense mask's rule: its forward
    (eager FlexAttention runs forward on the CPU) equals SDPA under the boolean mask."""
    x, _, _ = packed_windows()
    docs = document_ids(x, EOD)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, SEQ, 4, 16, generator=g) for _ in range(3))
    dense = sdpa_attention(q, k, v, mask=dense_document_mask(docs))
    from torch.nn.attention.flex_attention import flex_attention

    with pytest.warns(UserWarning):  # torch: eager FlexAttention is for debugging
        flex = flex_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                              block_mask=block_document_mask(docs)).transpose(1, 2)
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)


def test_backend_choice_under_document_masking():
    cuda, fp32, bf16 = torch.device("cuda"), torch.float32, torch.bfloat16
    assert resolve_backend("auto", CPU, fp32, document=True) == "sdpa"
    assert resolve_backend("auto", cuda, bf16, document=True) == "flex"
    assert resolve_backend("eager", CPU, fp32, document=True) == "eager"
    with pytest.raises(AttentionBackendError, match=r"model.attention=flash.*varlen.*flex"):
        resolve_backend("flash", cuda, bf16, document=True)
    with pytest.raises(AttentionBackendError, match=r"model.attention=flex needs CUDA.*sdpa"):
        resolve_backend("flex", CPU, fp32, document=True)
    with pytest.raises(AttentionBackendError, match=r"attention_mask=document"):
        resolve_backend("flex", CPU, fp32)


def test_compiled_forward_and_loss_is_one_graph():
    """One process compiles model + loss as one graph (parallel/apply.whole_model_loss):
    the document ids, positions and mask are traced into it, no graph break."""
    torch._dynamo.reset()
    counters.clear()
    model = model_of(preset("llama-tiny")).train()
    x, y, _ = packed_windows()
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    try:
        compiled = torch.compile(forward_and_loss(model), backend=backend, fullgraph=True)
        loss = compiled(x, y)
        assert not counters["graph_break"], dict(counters["graph_break"])
        assert len(graphs) == 1
        ops = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
        assert sum("scaled_dot_product_attention" in o for o in ops) == 2
        torch.testing.assert_close(loss, forward_and_loss(model)(x, y))
    finally:
        torch._dynamo.reset()


# --- multi-process: TP=2 and a 1F1B pipeline of two stages -----------------------------

LAYOUTS = {
    "tp2": ParallelConfig(tp=2, dp=1, micro_batch_size=2),
    "tp2_sp": ParallelConfig(tp=2, dp=1, micro_batch_size=2, sequence_parallel=True),
    "pp2_1f1b": ParallelConfig(pp=2, dp=1, pp_schedule="1f1b", micro_batch_size=1),
}


MODELS = ["nano", "llama-tiny"]


def layout_case(name: str, layout: str) -> Config:
    return Config(model=preset(name, n_layer=4), parallel=LAYOUTS[layout],
                  train=TrainConfig(global_batch_size=2, compile=False))


@pytest.fixture(scope="module")
def layout_losses(tmp_path_factory) -> dict:
    """Every (model, layout) case in one pair of processes (one start-up for all six), once
    per pytest run (tests/built_once.py)."""
    return built_once(tmp_path_factory, "doc-layouts", run_cases)


def run_cases(out: Path) -> dict:
    x, y, spans = packed_windows()
    cases = {f"{name}-{layout}": layout_case(name, layout)
             for name in MODELS for layout in LAYOUTS}
    spec = write_spec(out / "spec.pkl", cases=cases, x=x, y=y, seed=SEED, attention="sdpa")
    proc = run_ranks("tests/doc_attention_worker.py", str(out), str(spec), nproc=2,
                      cwd=CONF_DIR.parent)
    assert proc.returncode == 0, failed(proc)
    return {case: torch.load(out / f"{case}.pt") for case in cases}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", MODELS)
def test_layouts_score_each_token_as_its_document_alone(layout_losses, name, layout):
    x, y, spans = packed_windows()
    reference = alone_losses(model_of(layout_case(name, layout).model), x, y, spans)
    torch.testing.assert_close(layout_losses[f"{name}-{layout}"], reference, atol=1e-5, rtol=0)


def test_attention_module_names_every_mask_builder():
    assert set(attention_module.MASK_BUILDERS) == set(attention_module.KERNELS) - {"flash"}
