"""Processes for test_compiled_fallback.py: each function here runs in a spawned child (see gloo_workers.py for
why the workers live in modules of their own)."""
from __future__ import annotations

import types
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives

from compile_workers import SPLITS, build, global_batch, train
from gloo_workers import _join

NEWER_GATHER = "all_gather_single_autograd"  # torch 2.14's name; the GPU image's torch 2.11 lacks it
OLDER_GATHER = "all_gather_tensor_autograd"


def older_all_gather(self: torch.Tensor, gather_dim: int, group, tag: str = "") -> torch.Tensor:
    """The older function as torch 2.11 builds it: the differentiable all-gather op of the older
    `_c10d_functional_autograd` namespace along dim 0, waited on. (torch 2.14's function of this name only
    forwards to the newer one, by a global name that hiding the newer one would break.)"""
    assert gather_dim == 0, "the layer gathers along dim 0 only"
    group_name = _functional_collectives._resolve_group_name(group, tag)
    gathered = torch.ops._c10d_functional_autograd.all_gather_into_tensor(self, dist.get_world_size(group),
                                                                          group_name)
    return _functional_collectives.wait_tensor(gathered)


def without_the_newer_gather() -> types.ModuleType:
    """torch.distributed._functional_collectives as a torch without `all_gather_single_autograd` has it:
    a copy of the module without that name, whose older function is `older_all_gather`."""
    names = {name: value for name, value in vars(_functional_collectives).items() if name != NEWER_GATHER}
    older = types.ModuleType(_functional_collectives.__name__)
    older.__dict__.update(names)
    setattr(older, OLDER_GATHER, older_all_gather)
    return older


def older_gather_worker(rank: int, port: int, out_dir: str) -> None:
    """The compiled layer where torch has only the older functional all-gather: compiled.py imports the
    module it gathers with from torch.distributed at every trace, which here holds the copy without the
    newer function. Records Dynamo's graphs and breaks, and the same steps eager and compiled (aot_eager:
    the functional collectives and custom ops traced, no C compiler needed)."""
    _join(rank, port, 2)
    try:
        torch.distributed._functional_collectives = without_the_newer_gather()
        from torch.distributed import _functional_collectives as seen  # what compiled.py's import finds

        results = {"hidden": not hasattr(seen, NEWER_GATHER), "older": getattr(seen, OLDER_GATHER) is older_all_gather}
        x, _ = global_batch(0)
        explained = torch._dynamo.explain(build())(x[:SPLITS[rank]])
        results.update(graphs=explained.graph_count, graph_breaks=explained.graph_break_count,
                       break_reasons=[str(reason.reason) for reason in explained.break_reasons])
        torch._dynamo.reset()
        model = build()
        results["eager"] = train(model, model, rank)
        model = build()
        results["compiled"] = train(model, torch.compile(model, backend="aot_eager", fullgraph=True), rank)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        torch.distributed._functional_collectives = _functional_collectives
        dist.destroy_process_group()
