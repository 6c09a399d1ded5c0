"""Activation checkpointing: trade recomputation in backward for activation memory.

``full`` checkpoints every transformer block: only block inputs are kept, the block runs its
forward twice. ``selective`` is op-level selective checkpointing, as torchtitan's
``selective_ac_option="op"``: a ``torch.utils.checkpoint`` policy
(``create_selective_checkpoint_contexts``) keeps the outputs of the expensive ops (the
attention kernel, the matmuls, the sequence-parallel reduce-scatters) and recomputes the
cheap elementwise ones (norms, rotary embeddings, activations, residual adds, casts). Like
torchtitan it saves every other matmul of a block only (``recomputed_linears``: wk, wo and the
MLP's second Linear are recomputed), which is where most of the memory goes. Under sequence
parallelism the all-gathered Linear inputs are not kept either: backward gathers them again,
as Megatron-LM does. With ``parallel.ac_every_n_layers=n`` selective instead checkpoints every
n-th block whole. ``none`` under sequence parallelism checkpoints too, with a policy that
keeps the column-parallel matmuls' outputs (wq, wk, wv, w1, w3), the attention kernel's and
the reduce-scatters': so the gathered Linear inputs are kept as their sequence shards and
backward gathers them again, as Megatron-LM does (Korthikanti et al. 2022, section 4.2.2).
The norms, rotary embeddings and activations run again from what is kept, and in eager mode
the attention output projection too (its output is a reduce-scatter's input); compiled, the
partitioner drops what no gradient needs. All are non-reentrant ``torch.utils.checkpoint``:
results are bit-identical to no checkpointing.

Checkpointing goes on before ``torch.compile`` (torchtitan's order), so each block compiles
with ``fullgraph=True`` around its checkpoint region, the policy applied by the compiler's
partitioner.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from pretrain import torch_compat
from pretrain.config.schema import ModelConfig
from pretrain.parallel.tensor_parallel import ROWWISE

# A block's Linears in the order its forward runs them (model.Block: attention, then MLP).
LINEAR_ORDER = ("wq", "wk", "wv", "wo", "w1", "w3", "w2")
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


def _save_list() -> set:
    """Ops whose outputs the selective policy keeps (besides every other matmul)."""
    ops = {
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        # expert parallelism's token exchange: kept, so recomputation sends nothing again
        torch.ops._c10d_functional.all_to_all_single.default,
        # fp8: the amax of a tensor, cheap to keep, a reduction to recompute
        torch.ops.aten.abs.default,
        torch.ops.aten.max.default,
    }
    for name in ("_scaled_dot_product_cudnn_attention", "_flash_attention_forward"):
        if hasattr(torch.ops.aten, name):
            ops.add(getattr(torch.ops.aten, name).default)
    if hasattr(torch.ops, "flash_attn") and hasattr(torch.ops.flash_attn, "_flash_attn_forward"):
        ops.add(torch.ops.flash_attn._flash_attn_forward.default)
    return ops


def block_linears(cfg: ModelConfig) -> list[str]:
    """This model's block Linears in forward order (no w3 without SwiGLU)."""
    return [n for n in LINEAR_ORDER if n != "w3" or cfg.mlp == "swiglu"]


def recomputed_linears(cfg: ModelConfig) -> list[str]:
    """The Linears whose outputs selective checkpointing recomputes: the 2nd, 4th, ...
    matmul of a block (torchtitan's rule). The policy below counts matmuls at run time;
    the planner (planning/activations.py) reads this list: tests compare the two."""
    return block_linears(cfg)[1::2]


def describe(cfg: ModelConfig, mode: str, every_n: int, sequence_parallel: bool = False) -> str:
    """What ``parallel.activation_checkpointing`` does for this model, for plans and logs."""
    if mode == "selective" and every_n > 0:
        return f"selective: every {every_n}th block checkpointed whole"
    if mode == "selective":
        return ("selective (op-level): matmul, attention and reduce-scatter outputs saved, "
                "elementwise ops and " + ", ".join(recomputed_linears(cfg)) + " recomputed")
    if mode == "none" and sequence_parallel:
        return ("none (sequence parallelism: " + ", ".join(sequence_parallel_kept(cfg)) +
                " outputs kept, their gathered inputs saved as shards and gathered again in "
                "backward, elementwise ops recomputed)")
    return {"full": "full: each block recomputed in backward"}.get(mode, mode)


def sequence_parallel_kept(cfg: ModelConfig) -> list[str]:
    """The Linears whose outputs ``none`` keeps under sequence parallelism: the
    column-parallel ones (their inputs are what SP gathers)."""
    return [n for n in block_linears(cfg) if n not in ROW_PARALLEL]


ROW_PARALLEL = tuple(name.rpartition(".")[2] for name in ROWWISE)  # wo, w2


def _policy(save: set, keep_matmul=lambda i: i % 2 == 0):
    """``keep_matmul(i)``: whether the i-th matmul of a block (from 0) is kept."""
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in MATMULS:
            key = "recompute" if ctx.is_recompute else "forward"
            keep = keep_matmul(counts[key])
            counts[key] += 1
        else:
            keep = func in save
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _selective_context():
    return create_selective_checkpoint_contexts(_policy(_save_list()))


def _sharded_inputs_context(block: nn.Module):
    """The ``none`` policy under sequence parallelism for ``block`` (its Linears' order)."""
    names = [n for n in LINEAR_ORDER if n != "w3" or block.mlp.w3 is not None]
    keep = {i for i, n in enumerate(names) if n not in ROW_PARALLEL}

    def context():
        return create_selective_checkpoint_contexts(_policy(_save_list(), keep.__contains__))

    return context


def checkpoint_blocks(layers: nn.ModuleDict, every_n: int = 1, selective: bool = False) -> None:
    """Wrap the blocks whose global index i has (i + 1) % every_n == 0 (all when 1);
    ``selective``: with the op-level policy (a fresh matmul count per block and pass)."""
    for key in list(layers.keys()):
        if (int(key) + 1) % every_n == 0:
            kwargs = {"context_fn": _selective_context} if selective else {}
            layers[key] = torch_compat.private("checkpoint_wrapper")(layers[key], **kwargs)


def apply_activation_checkpointing(layers: nn.ModuleDict, mode: str, every_n: int,
                                   sequence_parallel: bool = False) -> None:
    """Before compile: the compiled block then holds the checkpoint region.
    ``sequence_parallel``: the blocks run under TP with SP (``none`` then keeps shards)."""
    if mode == "full":
        checkpoint_blocks(layers)
    elif mode == "selective" and every_n > 0:
        checkpoint_blocks(layers, every_n)
    elif mode == "selective":
        checkpoint_blocks(layers, selective=True)
    elif sequence_parallel:
        for key in list(layers.keys()):
            if not hasattr(layers[key], "moe"):  # TP refuses a mixture of experts
                layers[key] = torch_compat.private("checkpoint_wrapper")(
                    layers[key], context_fn=_sharded_inputs_context(layers[key]))

