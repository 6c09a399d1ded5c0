"""The compiled training forward + loss is one graph with no break, at the published sizes.

One process compiles the model and its loss together (parallel/apply.whole_model_loss); a
graph break would split it into pieces with eager Python between them: more launches and
no fusion across the break, the loss's fusion included. Traced here on the meta device
(shapes only, no memory: llama-1b's 1.2B parameters cost nothing) under bf16 autocast, as a
GPU run computes, with AOTAutograd (``aot_eager``: the joint forward/backward graph inductor
would get), counting graphs and breaks with dynamo's own counters.
"""

from __future__ import annotations

import pytest
import torch
from helpers import compose_config
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch._functorch.aot_autograd import make_boxed_func

from pretrain.model.gpt import GPT, set_attention_backend
from pretrain.parallel.apply import forward_and_loss


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["gpt2-124m", "llama-1b"])
def test_training_forward_and_loss_is_one_joint_graph(name):
    cfg = compose_config([f"model={name}"])
    with torch.device("meta"):
        model = GPT(cfg.model)
    set_attention_backend(model, "sdpa")
    model.train()
    graphs, joint = [], []

    def keep_joint(gm, _inputs):
        joint.append(gm)
        return make_boxed_func(gm.forward)

    aot = aot_autograd(fw_compiler=keep_joint, bw_compiler=keep_joint)

    def backend(gm, inputs):
        graphs.append(gm)
        return aot(gm, inputs)

    compiled = torch.compile(forward_and_loss(model), backend=backend, fullgraph=True)
    x = torch.randint(0, 1000, (2, 64), device="meta")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = compiled(x, x)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1 and len(graphs) == 1
    # the whole model is in it: every block's attention, the head and the loss
    ops = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("scaled_dot_product_attention" in o for o in ops) == cfg.model.n_layer
    assert any("cross_entropy" in o for o in ops)
    # AOTAutograd split it into one forward and (when backward runs) one backward graph
    assert type(loss.grad_fn).__name__ == "CompiledFunctionBackward"
    loss.backward()
    assert len(joint) == 2


def test_z_loss_is_in_the_same_one_graph():
    """train.z_loss on one process: the model, the cross-entropy and the z-loss term compile
    as one graph (the term from the same logits), and backward runs through both."""
    cfg = compose_config(["model=nano"])
    with torch.device("meta"):
        model = GPT(cfg.model)
    set_attention_backend(model, "sdpa")
    model.train()
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        boxed = lambda g, _inputs: make_boxed_func(g.forward)  # noqa: E731
        return aot_autograd(fw_compiler=boxed, bw_compiler=boxed)(gm, inputs)

    compiled = torch.compile(forward_and_loss(model, z_loss=1e-4), backend=backend,
                             fullgraph=True)
    x = torch.randint(0, 1000, (2, 64), device="meta")
    ce, z = compiled(x, x)
    assert not counters["graph_break"] and len(graphs) == 1
    ops = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert any("cross_entropy" in o for o in ops) and any("logsumexp" in o for o in ops)
    (ce + z).backward()
