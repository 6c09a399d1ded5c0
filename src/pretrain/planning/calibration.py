"""Every measured constant the step-time model uses, with the command that measured it.

Re-measure on new hardware or after a change to the training step, and update the figures
here (and the table in docs/benchmarks.md) together.
"""

from __future__ import annotations

from dataclasses import dataclass

# --- parallel.offload=params: the host's share of a step -------------------------------
# `python tools/bench_offload.py` (1 thread: torchrun gives each rank OMP_NUM_THREADS=1),
# torch 2.13.0+cpu, AMD EPYC (AVX2, 2 cores), 2026-11-25: ns per fp32 parameter.
# - torch's AdamW as build_optimizer makes it for host parameters (fused=False: on CPU
#   tensors its single-tensor for-loop, about ten passes over memory): 11.5
# - torch's fused CPU AdamW (optim.fused=true; one vectorised pass, the kind of step
#   DeepSpeed's CPU Adam is): 1.42, 8.1x faster
# - a gradient summed into the host gradient (each micro batch after the first): 0.71
# Check against a GPU run: gpt2-1.5b, offload=params, zero2, micro batch 1 x 4, full AC,
# one H100 (torch 2.11): about 24 s per step measured; this model says 23.4 s.
HOST_ADAMW_NS = {"for_loop": 11.5, "fused": 1.42}
HOST_GRAD_ADD_NS = 0.71
# Host-device copies run at the GPU type's pcie_gbps (conf/gpu/), by DMA from pinned memory.

# --- host dispatch: a step is the longer of its GPU work and its host work ------------------
# Recorded H100 runs (one H100 80GB SXM, torch 2.11.0+cu130, this project at ec9a543,
# /work/shared/gpu/README.md, bench_gpu side_by_side.sh; eager trainer profile prof.py:
# 15,162 kernel launches in 2 steps, 1.00 s CPU against 0.49 s GPU, so launch-bound):
#   GPT-2 124M, 16 x 1024 x 4, bf16: eager 0.384 s/step (170,522 tokens/s), compiled 0.429
#   1.3B (24 x 2048, 16 heads), 8 x 2048 x 4: eager 1.236 s, compiled 1.225 (GPU-bound)
# Recorded loops at the same shape (/work/shared/gpu/iso.py, same GPU, one process, no
# wrapper, autocast, fused AdamW):
#   eager, the chunked loss: 0.278 s (235,619 tokens/s); compiled whole model with
#   F.cross_entropy: 0.1885 s (347,764); compiled with the chunked loss (eager): 0.2375 s.
# planning/dispatch.count_ops (this CPU, torch 2.13 and 2.11 alike), GPT-2 124M, one micro
# batch's forward and backward: 30 ops outside the blocks + 132 per block x 12 + the loss's
# 7 + 26 per chunk x 50 chunks (16 x 1024 tokens, 333 a chunk) = 2,921; a step: 4 x 2,921
# + 11 (clip, fused AdamW) = 11,695 (`python tools/bench_dispatch.py ...` prints them).
# - an eager op, one process (what the trainer runs since the one-device path, cdb9968):
#   the iso eager loop's 0.278 s / 11,695 = 23.8 us of host time per dispatched op.
HOST_S_PER_OP = (65536 / 235_619) / 11695
# - outside the forward/backward region (planning/host.py): a CPU profile of the trainer's
#   step (`torch.profiler` over Trainer.train_step_local, +recipe=tiny train.compile=true
#   optim.fused=true, 4 steps; docs/benchmarks.md, "One H200, 2026-11-28") found 182 aten ops
#   a step outside the compiled region: 68 AccumulateGrad and 68 clipping `.to` (one per
#   parameter tensor), 11 of clipping's and fused AdamW's own (dispatch.count_ops' `step`),
#   and the step's bookkeeping, the rest:
BOOKKEEPING_OPS = 182 - 68 - 68 - 11
#   and the loop's own Python, which no op count sees: what the H200's graphed default step
#   (5.9 ms, torch 2.11, 9f55048) leaves after one replay (GRAPH_REPLAY_S, 30 us) and the
#   182 ops at HOST_S_PER_OP (4.33 ms). A residual of that one measurement, not a CPU fit:
#   the default recipe's graphed figure reproduces it by construction; the 10M rung's
#   graphed step (9.8 ms measured) is the check (docs/planning.md).
HOST_S_LOOP = 5.9e-3 - 30e-6 - 182 * HOST_S_PER_OP
# - FSDP2's wrapper (multi-process layouts, offload; at dp=1 too at ec9a543): its hooks,
#   copies and casts per unit (each block and the root) and micro batch: the trainer's
#   eager step (0.384 s) less the iso eager loop (0.278 s), over 4 x 13 unit calls: 2.0 ms.
HOST_S_PER_FSDP_UNIT = (65536 / 170_522 - 65536 / 235_619) / (4 * 13)
# - a compiled block (regional compile: multi-process layouts), forward and backward: the
#   trainer's compiled step (0.429 s, wrapped, loss eager then) less its eager ops
#   (4 x (30 + 7 + 26 x 50) + 11 = 5,359) and wrapper calls, over 48 block calls: 4.1 ms
#   (dynamo's guards, AOTAutograd's runtime wrappers, the launches): more than the block's
#   132 eager ops (3.1 ms), so per-block compile did not pay at 124M.
HOST_S_PER_COMPILED_BLOCK = (65536 / 152_698 - 5359 * HOST_S_PER_OP
                             - 4 * 13 * HOST_S_PER_FSDP_UNIT) / 48
# - one graph (model + loss, one process): what its call costs the host, read off
#   torch.profiler over the trainer's compiled step at tools/host_time.py's shape (nano,
#   tiny and 10M alike, torch 2.13.0+cpu, 2026-11-29): two parts.
#   * Per graph input (each parameter tensor, and the batch's two: with
#     inline_inbuilt_nn_modules every parameter is an input of the graph): dynamo's guards
#     ("TorchDynamo Cache Lookup": 0.13, 0.25, 0.38 ms a step for 36, 68 and 132 tensors)
#     and AOTAutograd's runtime wrappers (CompiledFunction and CompiledFunctionBackward:
#     each input, and each input's gradient, handled in Python). ``HostCosts.per_input``.
#   * Per kernel: inductor's generated code (forward and backward, "## Call CompiledFxGraph
#     ##") calls each kernel from Python. Counted in that code (TORCH_LOGS=output_code), the
#     same for the three models: a block's 20 heavy ops (dispatch.HEAVY: 6 Linears, their
#     12 backward matmuls, attention forward and backward) and 9 fused kernels between them
#     (3 in its forward: the norms, GELU, the residual adds; 6 in its backward), 29 a block;
#     7 outside the blocks (the head's matmuls, the embeddings', final norm's and loss's
#     fused kernels). ``HostCosts.per_launch``.
#   This CPU's two costs are calibrated on nano's compiled step at 2 and 16 layers
#   (tools/host_time.py: what the 14 layers add, split by the profile's share inside the
#   generated code; the rest of nano's graph its fixed part); the tiny model and the 10M
#   rung check them (docs/planning.md). A GPU machine's host: a launch at a stated 6 us (a
#   CUDA launch from inductor's wrapper; not measured: no GPU here), a graph input at 7.5 us:
#   this CPU's figure when calibrated on nano alone at 8 channels a head, which charged the
#   graph's fixed part to its inputs and launches; the two-depth calibration puts an input at
#   2.8-4.3 us and the graph's fixed part (here with the 4096-token loss's kernels inline)
#   at 0.59-0.75 ms (five runs, docs/planning.md): not moved here without a GPU machine's
#   profile to split that part.
COMPILED_LAUNCHES_PER_HEAVY_OP = 29 / 20
COMPILED_LAUNCHES_OUTSIDE = 7
HOST_S_PER_COMPILED_LAUNCH = 6e-6
HOST_S_PER_GRAPH_INPUT = 7.5e-6


@dataclass(frozen=True)
class HostCosts:
    """What the host pays, per step's unit: a dispatched aten op (eager), a compiled graph's
    kernel launch, its call (a fixed part) and each of its inputs (dynamo's guards and
    AOTAutograd's runtime wrappers, forward and backward), the loop's own Python a step
    (the batch, hooks, zero_grad, the schedule, the trainer's lines between them), and a
    parameter tensor's share of clipping and the optimizer step (its norm, its ``.to``,
    its turn in the fused AdamW kernel's loop)."""

    per_op: float
    per_launch: float
    per_graph: float
    loop: float
    per_tensor: float
    per_input: float = 0.0
    # the eager region's fixed part a micro batch, besides its ops (on this CPU: the
    # embedding's and the loss's vocabulary-sized work; none stated for a GPU's host)
    per_region: float = 0.0


# A GPU machine's host (the figures above; a graph's call is in its launches and inputs
# there, a parameter tensor is clipping's `.to`, one op).
GPU_HOST = HostCosts(HOST_S_PER_OP, HOST_S_PER_COMPILED_LAUNCH, 0.0, HOST_S_LOOP,
                     HOST_S_PER_OP, HOST_S_PER_GRAPH_INPUT)

# --- kernels on one GPU -------------------------------------------------------------------
# A GPU type's kernel_efficiency (conf/gpu/) was fitted on torchtitan's 8B over 8 GPUs,
# where FSDP's all-gathers and reduce-scatters run beside the compute kernels and take SMs
# and memory bandwidth from them. One GPU runs no collectives, and its step is two parts:
# - the memory-bound kernels (norms, GELU, residual adds, casts: what compile leaves outside
#   the matmuls), SOLO_BYTES_PER_LAYER_ELEMENT bytes per token, layer and d_model element at
#   the GPU type's memory_gbps. Fitted on nanoGPT's train.py, the same code on two cards
#   (/work/shared/gpu/README.md, torch 2.11): 124M 139.8 ms/step on the H100 SXM (3.35 TB/s)
#   against 131.2 on the H200 (4.8 TB/s): 157.9 bytes; 1.3B 1,079.5 against 1,032.8: 160.7.
#   The mean, 159 (bf16: about 80 reads and writes of each element, forward and backward);
SOLO_BYTES_PER_LAYER_ELEMENT = 159
# - the matmuls and attention, at a fraction of the dense peak that grows with the width
#   (small matrices do not fill the SMs): SOLO_EFFICIENCY_MAX * d / (d + SOLO_HALF_WIDTH) on
#   the card the curve was fitted on (kernel_efficiency 0.425), scaled by another type's
#   kernel_efficiency / 0.425. Fitted on this project's trainer at bcb5f89 (the code as it
#   runs now: one device, one compiled graph) on one H200, side_by_side.sh, 16 x 1024 x 4 and
#   8 x 2048 x 4 tokens, bf16: 124M 136.2 ms/step (the planner's FLOPs at the dense peak:
#   56.68 ms; less 20.0 ms of memory-bound kernels: efficiency 0.488), 1.3B 1,037.9 ms
#   (601.5 at the peak, 106.7 memory-bound: 0.646). Two points, two parameters: the curve
#   passes through both; it gives 0.27 at d_model 256 and 0.72 at 4096.
SOLO_EFFICIENCY_MAX = 0.8020
SOLO_HALF_WIDTH = 494.6
SOLO_FIT_KERNEL_EFFICIENCY = 0.425  # conf/gpu/h200-141gb.yaml's, the card fitted on
# The H100 at the same code, by this model: 124M 0.143 s, 1.3B 1.085 s (nanoGPT's H100/H200
# ratio, 0.957, puts it at 1.085 too); the H100 run at ec9a543 (FSDP's wrapper at dp=1)
# measured 1.225 s (tests/test_step_time.py holds the plan within 15% of it).
# Eager against compiled blocks on one GPU, this project at ec9a543: the 1.3B eager step
# 1.236 s against 1.225 compiled (GELU/LayerNorm blocks: eager runs fused norm and GELU
# kernels already). torchtitan's Llama blocks (RMSNorm, SwiGLU, RoPE) lost more
# (cost.EAGER_SPEED); applied where the published rows measured it, on several GPUs.
SOLO_EAGER_SPEED = 1.225 / 1.236
