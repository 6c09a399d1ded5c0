"""Initial weights as a pure function of (seed, parameter name, global shape).

Every element's initial value is fixed by where it sits in the *global* tensor, never by
which process holds it or on which device: a parameter is cut into fixed tiles of
``TILE = (rows, cols)`` elements, each tile drawn from its own CPU generator seeded by a hash
of (seed, name, global shape, tile index). A rank fills its shard (a DTensor's local piece:
a tensor-parallel slice, an FSDP2 shard, or the whole tensor) by drawing only the tiles that
shard overlaps (a 3-D experts x out x in tensor: each expert's matrix as its own 2-D
parameter), so initialising costs memory and time in proportion to the shard, and one
process, every TP x PP x DP layout, CPU and GPU start from bit-identical global weights.

What each parameter's distribution is (normal with a std, zeros, ones) is the model's to
say (``GPT.init_rule``); this module only draws the numbers.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

TILE = (128, 1024)  # rows x columns of one generator's draw: 128 Ki values, 512 KiB in fp32
# Wrappers that insert a path component into parameter names (the names are the model's
# own without them, as torch.distributed.checkpoint's state-dict helpers also see them).
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


@dataclass(frozen=True)
class Init:
    """How one parameter starts: ``normal`` (mean 0, ``std``), ``zeros`` or ``ones``.
    ``key`` names the random stream (a tied copy of a weight draws its original's)."""

    kind: str
    std: float = 0.0
    key: str | None = None


def canonical_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _tile_seed(seed: int, key: str, shape: tuple[int, ...], tile: tuple[int, int]) -> int:
    text = f"{seed}|{key}|{'x'.join(map(str, shape))}|{tile[0]},{tile[1]}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def local_region(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local tensor, its global offsets, the global shape) of a parameter: a DTensor's
    local piece and where torch.distributed.checkpoint says it sits, or a plain tensor."""
    if isinstance(t, DTensor):
        chunk = t.__create_chunk_list__()[0]  # the offsets DCP saves this shard under
        return t.to_local(), tuple(chunk.offsets), tuple(t.shape)
    return t, (0,) * t.dim(), tuple(t.shape)


def _as_2d(shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]):
    if len(shape) == 1:
        return (1, shape[0]), (0, offsets[0]), (1, sizes[0])
    if len(shape) == 2:
        return shape, offsets, sizes
    raise NotImplementedError(f"initialising a {len(shape)}-D parameter: only 1-D, 2-D and "
                              "3-D (experts x out x in) are tiled")


@torch.no_grad()
def fill_normal_(local: torch.Tensor, offsets: tuple[int, ...], shape: tuple[int, ...],
                 std: float, seed: int, key: str) -> None:
    """Write N(0, std) into ``local``, the piece of the global ``shape`` tensor that starts
    at ``offsets``, drawing only the tiles it overlaps (on the CPU, in fp32)."""
    if local.numel() == 0:
        return
    if len(shape) == 3:  # experts x out x in: each expert's matrix its own stream
        for i in range(local.shape[0]):
            e = offsets[0] + i
            fill_normal_(local[i], offsets[1:], shape[1:], std, seed, f"{key}[{e}]")
        return
    (rows, cols), (r_off, c_off), (r_len, c_len) = _as_2d(shape, offsets, tuple(local.shape))
    view = local if local.dim() == 2 else local.unsqueeze(0)
    tr, tc = TILE
    for i in range(r_off // tr, math.ceil((r_off + r_len) / tr)):
        r0, r1 = i * tr, min(rows, (i + 1) * tr)
        a0, a1 = max(r0, r_off), min(r1, r_off + r_len)
        for j in range(c_off // tc, math.ceil((c_off + c_len) / tc)):
            c0, c1 = j * tc, min(cols, (j + 1) * tc)
            b0, b1 = max(c0, c_off), min(c1, c_off + c_len)
            gen = torch.Generator("cpu").manual_seed(_tile_seed(seed, key, shape, (i, j)))
            # device="cpu" stated: under ``with torch.device("cuda")`` (or "meta") a factory
            # call without one would take the context's device and refuse the CPU generator
            tile = torch.randn(r1 - r0, c1 - c0, generator=gen, device="cpu")
            part = tile[a0 - r0:a1 - r0, b0 - c0:b1 - c0].mul_(std)
            view[a0 - r_off:a1 - r_off, b0 - c_off:b1 - c_off].copy_(part)


@torch.no_grad()
def init_parameters(module: nn.Module, seed: int, rule: Callable[[str], Init]) -> None:
    """Initialise every parameter of ``module`` (a whole model, a pipeline stage, tensor-
    parallel or FSDP-sharded) in place: each rank writes only its local shard."""
    for name, param in module.named_parameters():
        name = canonical_name(name)
        _fill(param, rule(name), seed, name)


def _fill(param: torch.Tensor, init: Init, seed: int, name: str) -> None:
    """Write ``init`` into this rank's piece of ``param``."""
    local, offsets, shape = local_region(param)
    if init.kind == "zeros":
        local.zero_()
    elif init.kind == "ones":
        local.fill_(1.0)
    elif init.kind == "normal":
        fill_normal_(local, offsets, shape, init.std, seed, init.key or name)
    else:
        raise ValueError(f"{name}: unknown initialisation {init.kind!r}")
