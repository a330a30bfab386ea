"""Processes for the torch.compile tests (test_compile.py): each function here runs in a spawned child (see
gloo_workers.py for why the workers live in modules of their own)."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from gloo_workers import Branchy, _join
from sync_batchnorm import SyncDivergenceError, SynchronizedBatchNorm2d, functions, name_synchronized_layers
from sync_batchnorm.functions import reads_stall_the_device

SPLITS = [3, 5]  # per rank: uneven on purpose
STEPS = 3
LEARNING_RATE = 0.5


class Net(nn.Module):
    """conv -> BN -> ReLU -> conv -> BN. A class of its own: Dynamo compiles a model's forward as one frame
    when it is user code (a bare nn.Sequential's forward would only be inlined from such a frame)."""

    def __init__(self, norm=SynchronizedBatchNorm2d) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 6, 3, padding=1), norm(6)
        self.conv2, self.bn2 = nn.Conv2d(6, 6, 1), norm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn2(self.conv2(self.bn1(self.conv1(x)).relu()))


def build(norm=SynchronizedBatchNorm2d) -> Net:
    torch.manual_seed(0)  # the same weights for every rank and for the reference with nn.BatchNorm2d
    return name_synchronized_layers(Net(norm))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(200 + step)
    x = torch.randn(sum(SPLITS), 3, 6, 7, generator=generator) * (1 + step) + 1
    return x, torch.randn(sum(SPLITS), 6, 6, 7, generator=generator)


def loss_share(output: torch.Tensor, upstream: torch.Tensor) -> torch.Tensor:
    """This rank's share of the global loss sum(output * upstream) / numel of the global batch."""
    return (output * upstream).sum() / (sum(SPLITS) * upstream[0].numel())


def train(model: nn.Module, forward, rank: int) -> dict:
    """STEPS SGD steps on this rank's share of each global batch, gradients summed over the ranks."""
    start = sum(SPLITS[:rank])
    results = {}
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    for step in range(STEPS):
        x, upstream = global_batch(step)
        loss = loss_share(forward(x[start:start + SPLITS[rank]]), upstream[start:start + SPLITS[rank]])
        loss.backward()
        for parameter in model.parameters():
            dist.all_reduce(parameter.grad)
        total = loss.detach().clone()
        dist.all_reduce(total)
        results[f"loss{step}"] = total
        results[f"grads{step}"] = [parameter.grad.clone() for parameter in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
    for name in ("bn1", "bn2"):
        layer = getattr(model, name)
        results[f"{name}_running"] = torch.stack([layer.running_mean, layer.running_var])
        results[f"{name}_calls"] = layer._exchange_calls
    return results


def compile_worker(rank: int, port: int, out_dir: str) -> None:
    """The graph breaks Dynamo reports for Net; the same training eager and compiled (fullgraph=True)."""
    _join(rank, port, 2)
    try:
        x, _ = global_batch(0)
        explained = torch._dynamo.explain(build())(x[:SPLITS[rank]])
        results = {"graphs": explained.graph_count, "graph_breaks": explained.graph_break_count,
                   "break_reasons": [str(reason.reason) for reason in explained.break_reasons]}
        torch._dynamo.reset()
        model = build()
        results["eager"] = train(model, model, rank)
        model = build()
        results["compiled"] = train(model, torch.compile(model, fullgraph=True), rank)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def divergence_worker(rank: int, port: int, out_dir: str) -> None:
    """A rank taking an extra branch in a compiled model, and one calling another layer where reading the
    labels would wait for a device (checked at the layer's next call)."""
    _join(rank, port, 2)
    try:
        results = {}
        model = name_synchronized_layers(Branchy(extra_ranks=(1,)))
        try:
            torch.compile(model)(torch.randn(3, 4, 4, 4))
            results["divergence"] = "no error"
        except SyncDivergenceError as error:
            results["divergence"] = str(error)
        functions.reads_stall_the_device = lambda tensor: True  # as on CUDA
        model = name_synchronized_layers(Branchy(extra_ranks=(1,)))
        swapped = torch.compile(lambda x: (model.extra if rank == 1 else model.head)(model.stem(x)))
        swapped(torch.randn(3, 4, 4, 4))  # diverges, unnoticed for now
        try:
            swapped(torch.randn(3, 4, 4, 4))
            results["deferred"] = "no error"
        except SyncDivergenceError as error:
            results["deferred"] = str(error)
        functions.reads_stall_the_device = reads_stall_the_device
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
