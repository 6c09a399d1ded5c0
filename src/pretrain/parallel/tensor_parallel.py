"""Megatron-style tensor parallelism with DTensor, applied to a plain GPT from outside.

Per block (Shoeybi et al. 2019): Q, K, V and the MLP up/gate projections are column-parallel
(each rank owns a slice of the heads / hidden units), the attention output and MLP down
projection are row-parallel, so a block costs one all-reduce forward and one backward per
sub-layer. With sequence parallelism (Korthikanti et al. 2022) the norms and dropout run on
a sequence shard and the all-reduces become reduce-scatter + all-gather.

The token embedding and the output head are vocabulary-parallel (row-wise embedding, column
-wise head whose logits stay sharded on the vocabulary for ``loss_parallel``). Every parameter
gets a placement, including the learned position table (sharded by position, the same way as
the token table) and the norms (Replicate, or SequenceParallel), so gradient clipping and
FSDP see one kind of parameter.
"""

from __future__ import annotations

import contextlib

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from pretrain import torch_compat
from pretrain.config.schema import ConfigError
from pretrain.model.gpt import GPT

# The Megatron plan, as data: the planner (planning/params.py) reads the same names.
COLWISE = ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3")  # Shard(0): output features
ROWWISE = ("attn.wo", "mlp.w2")  # weight Shard(1): input features; bias replicated
VOCAB_PARALLEL = ("tok_emb", "pos_emb", "lm_head")  # Shard(0): vocabulary / position rows


def tp_shard_dim(name: str) -> int | None:
    """The dimension of parameter ``name`` (the whole model's name) that tensor
    parallelism shards, or None when it is replicated over the TP ranks."""
    module, _, kind = name.rpartition(".")
    if module in VOCAB_PARALLEL or module.endswith(COLWISE):
        return 0
    if module.endswith(ROWWISE):
        return 1 if kind == "weight" else None
    return None


class ReplicateParallel(ParallelStyle):
    """Parameters replicated over the TP mesh (as DTensors), inputs and outputs plain
    tensors: for the norms when sequence parallelism is off. Their gradients are already
    identical on every TP rank (their inputs are), the placement records that."""

    @staticmethod
    def _to_dtensor(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)

    @staticmethod
    def _to_local(module: nn.Module, output: DTensor, mesh: DeviceMesh):
        return output.to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=self._to_dtensor,
                                 output_fn=self._to_local)


def _block_styles(block: nn.Module, fp8_tensorwise: bool):
    """(colwise, rowwise, prepare-input) style classes for a block's Linears: torchao's
    Float8 styles when every block Linear is a tensorwise Float8Linear (their inputs are
    cast to fp8 before the all-gather, as torchtitan does), else the plain ones."""
    if fp8_tensorwise:
        from pretrain.precision.fp8 import is_fp8

        linears = [m for m in block.modules() if isinstance(m, nn.Linear)]
        if linears and all(is_fp8(m) for m in linears):
            from torchao.float8.float8_tensor_parallel import (
                Float8ColwiseParallel,
                Float8RowwiseParallel,
                PrepareFloat8ModuleInput,
            )

            return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
    return ColwiseParallel, RowwiseParallel, PrepareModuleInput


def apply_tensor_parallel(model: GPT, tp_mesh: DeviceMesh, sequence_parallel: bool,
                          fp8_tensorwise: bool = False) -> None:
    """Shard ``model`` (a whole GPT or one pipeline stage of it) over ``tp_mesh`` in place.

    Activations between sub-layers are plain tensors: replicated, or sharded on the sequence
    (dim 1) with SP. Logits leave the head as a DTensor sharded on the vocabulary; compute
    the loss under :func:`loss_context`. ``fp8_tensorwise``: the block Linears are
    tensorwise Float8Linears and the TP collectives may carry fp8.
    """
    seq = Shard(1) if sequence_parallel else Replicate()

    def norm_style() -> ParallelStyle:
        return SequenceParallel(use_local_output=True) if sequence_parallel else ReplicateParallel()

    root: dict[str, ParallelStyle] = {}
    if model.tok_emb is not None:
        root["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.pos_emb is not None:
        # Looked up with positions (seq,), so its output's sequence dim is 0; under document
        # masking with per-token positions (batch, seq), it is 1.
        seq_dim = 1 if model.cfg.attention_mask == "document" else 0
        root["pos_emb"] = RowwiseParallel(input_layouts=Replicate(),
                                          output_layouts=Shard(seq_dim) if sequence_parallel
                                          else Replicate())
    if model.norm is not None:
        root["norm"] = norm_style()
    if model.lm_head is not None:
        root["lm_head"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                          use_local_output=False)
    parallelize_module(model, tp_mesh, root)

    for block in model.layers.values():
        colwise, rowwise, prepare_input = _block_styles(block, fp8_tensorwise)
        plan: dict[str, ParallelStyle] = {"attn_norm": norm_style(), "mlp_norm": norm_style()}
        present = {name for name, _ in block.named_modules()}  # w3 only with SwiGLU
        plan.update({name: colwise() for name in COLWISE if name in present})
        plan.update({name: rowwise(output_layouts=seq) for name in ROWWISE})
        if sequence_parallel:  # gather the sequence before the column-parallel matmuls
            plan["attn"] = prepare_input(input_layouts=(Shard(1), None),
                                         desired_input_layouts=(Replicate(), None),
                                         use_local_output=True)
            plan["mlp"] = prepare_input(input_layouts=(Shard(1),),
                                        desired_input_layouts=(Replicate(),),
                                        use_local_output=True)
        parallelize_module(block, tp_mesh, plan)
    # parallelize_module replaced tok_emb.weight and lm_head.weight by two DTensors with the
    # same placement (Shard(0): vocabulary rows); share one again.
    model.tie_weights()


def loss_context(tp: int):
    """Cross-entropy on vocabulary-sharded logits without gathering them (loss_parallel)."""
    return loss_parallel() if tp > 1 else contextlib.nullcontext()


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Async TP as torchtitan enables it: symmetric memory for the TP group and inductor's
    micro-pipeline pass, which rewrites each compiled block's all-gather -> matmul and
    matmul -> reduce-scatter into fused ops that overlap the transfers with partial
    matmuls. CUDA only (symmetric memory), so refused elsewhere rather than ignored."""
    if tp_mesh.device_type != "cuda":
        raise ConfigError([
            f"parallel.async_tp=true needs CUDA (symmetric memory for the TP group); this run "
            f"is on '{tp_mesh.device_type}': set parallel.async_tp=false"])
    import warnings

    with warnings.catch_warnings():  # deprecated in favour of automatic registration
        warnings.simplefilter("ignore", FutureWarning)
        torch_compat.private("enable_symm_mem_for_group")(tp_mesh.get_group().group_name)
    torch_compat.set_private("micro_pipeline_tp", True)
