"""For tests/test_initialization.py (not a test module itself): one rank of a layout on a
fake process group, built and initialised by ``pretrain.parallel`` exactly as a run does;
prints one JSON line per layout saying whether every local shard equals the same slice of
the weights one process initialises (and how many tensors and elements were compared).

    python tests/init_probe.py '<json list of {"overrides": [...], "world": N, "rank": R}>'
"""

from __future__ import annotations

import json
import sys

import torch


def _check(spec: dict) -> dict:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from pretrain.config.compose import compose_config
    from pretrain.model.gpt import build_model
    from pretrain.model.initialization import canonical_name, local_region
    from pretrain.parallel.apply import materialize, parallelize_gpt
    from pretrain.parallel.layout import resolve_layout
    from pretrain.parallel.mesh import build_mesh
    from pretrain.precision.policy import resolve_policy

    cfg = compose_config(spec["overrides"])
    device = torch.device("cpu")
    full = build_model(cfg, device, "sdpa", cfg.train.seed).state_dict()
    dist.init_process_group("fake", store=FakeStore(), rank=spec["rank"],
                            world_size=spec["world"])
    layout = resolve_layout(cfg, spec["world"])
    pm = parallelize_gpt(cfg, layout, build_mesh(layout, device), device,
                         resolve_policy(cfg.precision, device), "sdpa")
    materialize(pm, device, cfg.train.seed)
    tied = cfg.model.tie_embeddings
    compared, elements, wrong = 0, 0, []
    for part in pm.parts:
        for name, p in part.named_parameters():
            name = canonical_name(name)
            local, offsets, _ = local_region(p)
            ref = full["tok_emb.weight" if tied and name == "lm_head.weight" else name]
            piece = ref[tuple(slice(o, o + n) for o, n in zip(offsets, local.shape, strict=True))]
            compared, elements = compared + 1, elements + local.numel()
            if not torch.equal(local, piece):
                wrong.append(name)
    return {"layout": layout.describe(), "stages": pm.stage_ids, "tensors": compared,
            "elements": elements, "full_elements": sum(t.numel() for t in full.values()),
            "wrong": wrong}


if __name__ == "__main__":
    from memory_probe import forked

    import pretrain.train.trainer  # noqa: F401  (import once, before forking)

    for spec in json.loads(sys.argv[1]):
        print(forked(spec, _check), flush=True)
