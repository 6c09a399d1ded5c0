"""Activation checkpointing: trade recomputation in backward for activation memory.

``full`` checkpoints every transformer block: only block inputs are kept, the block runs its
forward twice. ``selective`` follows Korthikanti et al. 2022: by default it recomputes only
the attention core (softmax(QK^T)V, whose activations grow with seq^2 but cost few FLOPs);
with ``parallel.ac_every_n_layers=n`` it instead checkpoints every n-th block whole. Both are
``torch.utils.checkpoint`` (non-reentrant), so results are bit-identical to no checkpointing.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

from pretrain.model import Attention


def checkpoint_blocks(layers: nn.ModuleDict, every_n: int = 1) -> None:
    """Wrap the blocks whose global index i has (i + 1) % every_n == 0 (all when 1)."""
    for key in list(layers.keys()):
        if (int(key) + 1) % every_n == 0:
            layers[key] = checkpoint_wrapper(layers[key])


def checkpoint_attention_core(layers: nn.ModuleDict, compiled: bool = False) -> None:
    """Recompute softmax(QK^T)V in backward. In a compiled block the checkpointed kernel
    runs eagerly (one graph before it, one after): it is a single fused SDPA/flash call,
    which compile would not change, and a checkpoint traced inside a compiled block whose
    weights are DTensors fails in torch 2.13 (see parallel/apply.py)."""
    for module in layers.modules():
        if isinstance(module, Attention):
            kernel = functools.partial(checkpoint, module.kernel, use_reentrant=False)
            module.kernel = torch.compiler.disable(kernel) if compiled else kernel


def apply_activation_checkpointing(layers: nn.ModuleDict, mode: str, every_n: int,
                                   compiled: bool = False) -> None:
    """``compiled``: the blocks are already compiled (``Module.compile``); full and
    every-n checkpointing then wrap the compiled blocks."""
    if mode == "full":
        checkpoint_blocks(layers)
    elif mode == "selective" and every_n > 0:
        checkpoint_blocks(layers, every_n)
    elif mode == "selective":
        checkpoint_attention_core(layers, compiled)
