"""Measure what a model really holds, for tests/test_estimate.py (not a test module itself).

Two probes:

- ``state_bytes``: bytes of parameters (each tensor once), gradients and optimizer state
  held by a rank after a forward, backward and AdamW step, read from the tensors themselves
  (a DTensor's local shard; FSDP2's padded shard storage).
- ``ActivationTracker``: a TorchDispatchMode that sees every tensor an op creates and a
  weakref finalizer on its storage, so it knows the live bytes after every op. It counts
  exact tensor bytes (not the allocator's cached blocks, which CPU has no stats for and
  which would blur the comparison), deterministically. Storages that exist before it starts
  (parameters, buffers) are ignored; gradients of parameters and autocast's cached bf16
  weight copies are classified after the fact and subtracted, so the peak it reports is the
  activations' own: what the estimate's "activations + logits and loss + backward
  transient" predicts.

Run as ``python tests/memory_probe.py '<json list>'`` it builds one rank of each multi-rank
layout on a fake process group (``torch.testing._internal.distributed.fake_pg``: collectives
are no-ops with the right shapes, so the real ``pretrain.parallel`` code builds the real local
shards in one process) and prints ``state_bytes`` as one JSON line per layout. Each layout
runs in a child forked after the imports (a fake process group does not survive
re-initialisation in one process; forking pays for importing torch once).
"""

from __future__ import annotations

import json
import os
import sys
import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under a DTensor or a functional collective's pending result."""
    while type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        inner = getattr(t, "_local_tensor", None)
        if inner is None:
            inner = getattr(t, "elem", None)
        if inner is None:
            return t
        t = inner
    return t


def state_bytes(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> dict:
    seen, pbytes = set(), 0
    for p in params:
        st = _local(p).untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            pbytes += st.nbytes()
    grads = sum(_local(p.grad).numel() * _local(p.grad).element_size()
                for p in params if p.grad is not None)
    opt = sum(_local(v).numel() * _local(v).element_size()
              for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    return {"parameters": pbytes, "gradients": grads, "optimizer state": opt}


class ActivationTracker(TorchDispatchMode):
    def __init__(self, existing: list[torch.Tensor]):
        super().__init__()
        self.ignore = {t.untyped_storage().data_ptr() for t in existing}
        self.events: list[tuple[int, int]] = []  # (+/- bytes, storage key)
        self.keys: dict[int, list[tuple[weakref.ref, int]]] = {}
        self.weight_copies: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self.events.append((-nbytes, key))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        copy = (func is torch.ops.aten._to_copy.default
                and _plain(args[0]).untyped_storage().data_ptr() in self.ignore)
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = _plain(t).untyped_storage()  # a DTensor's local shard (TP)
            ptr = st.data_ptr()
            if ptr in self.ignore or st.nbytes() == 0:
                continue
            if any(ref() is st for ref, _ in self.keys.get(ptr, [])):
                continue
            key = len(self.events) + 1
            self.keys.setdefault(ptr, []).append((weakref.ref(st), key))
            weakref.finalize(st, self._free, key, st.nbytes())
            self.events.append((st.nbytes(), key))
            if copy:
                self.weight_copies.add(key)
        return out

    def _keys_of(self, tensors: list[torch.Tensor]) -> set[int]:
        out = set()
        for t in tensors:
            st = t.untyped_storage()
            out |= {k for ref, k in self.keys.get(st.data_ptr(), []) if ref() is st}
        return out

    def peak(self, grads: list[torch.Tensor]) -> int:
        """Peak live bytes of everything but parameter gradients and weight copies."""
        skip = self._keys_of(grads) | self.weight_copies
        live = peak = 0
        for delta, key in self.events:
            if key not in skip:
                live += delta
                peak = max(peak, live)
        return peak

    def weight_copy_bytes(self) -> int:
        return sum(d for d, k in self.events if d > 0 and k in self.weight_copies)


def _world(spec: dict) -> dict:
    """One rank of a layout on a fake process group: build, step, measure."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from pretrain.config.schema import Config, ModelConfig, ParallelConfig, PrecisionConfig
    from pretrain.optim.specs import build_optimizer
    from pretrain.parallel.apply import materialize, parallelize_gpt
    from pretrain.parallel.layout import resolve_layout
    from pretrain.parallel.mesh import build_mesh
    from pretrain.precision.policy import resolve_policy

    cfg = Config()
    cfg.model = ModelConfig(**spec["model"])
    cfg.parallel = ParallelConfig(**spec["parallel"])
    cfg.train.global_batch_size = spec["global_batch_size"]
    cfg.precision = PrecisionConfig(name="bf16", compute_dtype="bfloat16")
    par = cfg.parallel
    world = par.tp * par.pp * par.dp
    dist.init_process_group("fake", rank=spec["rank"], world_size=world, store=FakeStore())
    device = torch.device("cpu")
    layout = resolve_layout(cfg, world)
    mesh = build_mesh(layout, device)
    policy = resolve_policy(cfg.precision, device)
    pm = parallelize_gpt(cfg, layout, mesh, device, policy, "sdpa")
    materialize(pm, device, 0)
    b, s = par.micro_batch_size, cfg.model.seq_len
    for part in pm.parts:
        if part.tok_emb is not None:
            x = torch.randint(0, cfg.model.vocab_size, (b, s))
        else:  # a later stage receives the residual stream, in the compute dtype
            x = torch.randn(b, s, cfg.model.d_model, dtype=policy.compute_dtype,
                            requires_grad=True)
        out = part(x)
        _local(out).float().sum().backward()
    optimizer = build_optimizer(torch.nn.ModuleList(pm.parts), cfg.optim, 1e-3, device)
    optimizer.step()
    return {**state_bytes(pm.parameters(), optimizer), "pp_rank": mesh.pp.get_local_rank()}


def sp_blocks_saved(spec: dict) -> dict:
    """Bytes the transformer blocks of tensor-parallel rank 0 keep after their forward under
    sequence parallelism (TP 2 on a fake process group, bf16), with ``none`` checkpointing
    as parallel/apply.py applies it (``sp_policy``) or DTensor's own saving (without)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from pretrain.config.schema import ModelConfig
    from pretrain.model.gpt import GPT, set_attention_backend
    from pretrain.parallel.activation_checkpoint import apply_activation_checkpointing
    from pretrain.parallel.tensor_parallel import apply_tensor_parallel

    t = spec["tp"]
    dist.init_process_group("fake", rank=0, world_size=t, store=FakeStore())
    cfg = ModelConfig(**spec["model"])
    model = GPT(cfg).to(torch.bfloat16)
    set_attention_backend(model, "sdpa")
    apply_tensor_parallel(model, init_device_mesh("cpu", (t,)), sequence_parallel=True)
    apply_activation_checkpointing(model.layers, "none", 0, spec["sp_policy"])
    x = torch.randn(spec["micro_batch"], cfg.seq_len // t, cfg.d_model, dtype=torch.bfloat16,
                    requires_grad=True)
    tracker = ActivationTracker([x, *(_plain(t) for t in [*model.parameters(),
                                                         *model.buffers()])])
    with tracker:
        for block in model.layers.values():
            x = block(x, None)
    return {"saved": sum(d for d, _ in tracker.events) - x.numel() * x.element_size()}


def forked(spec: dict, fn=None) -> str:
    """``fn(spec)`` (default: ``_world``) in a child process; its result as one JSON line."""
    fn = fn or _world
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: one world, then exit without running the parent's cleanup
        os.close(read)
        try:
            result = json.dumps(fn(spec))
        except BaseException as e:  # report, never fall through into the parent's code
            result = json.dumps({"error": f"{type(e).__name__}: {e}"})
        os.write(write, result.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return out


if __name__ == "__main__":
    import pretrain.parallel.apply  # noqa: F401  (import once, before forking)

    for spec in json.loads(sys.argv[1]):
        print(forked(spec), flush=True)
