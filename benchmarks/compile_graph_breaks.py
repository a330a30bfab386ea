"""Graph breaks of torch.compile at the synchronized BatchNorm layers, before and after the compiled path.

    .venv/bin/python -m benchmarks.compile_graph_breaks        # about a minute on 2 cores

`torch._dynamo.explain` (Dynamo only: no code generation, so nothing here is timed) on two gloo processes
over loopback and on one process, for three models: a conv-BN-ReLU-conv-BN net, and the DeepLabV3+ / ResNet-18
that `build_model` makes with `norm=syncbn`. "before" is the layer as it was: the eager path while tracing
(`syncseg.model.sync_batchnorm.batchnorm.is_compiling` patched to say no, so the layer never takes
model/sync_batchnorm/compiled.py). "before, layer excluded" is what torch.compile could make of that layer
at best where it synchronizes: its forward behind `torch.compiler.disable`, a graph break at each call.
"after" is the package as it is. Rank 0 prints the table; both ranks trace, since the layers' collectives
need both. Dynamo's recompilation warnings (the "before" layer's frames hit its recompile limit) are
silenced; the counts are as explain() reports them.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import socket
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from syncseg.engine.config import ModelConfig
from syncseg.model.builder import build_model
from syncseg.model.sync_batchnorm import SynchronizedBatchNorm2d, batchnorm, name_synchronized_layers, set_sbn_eps_mode


class ConvNet(nn.Module):
    """conv -> BN -> ReLU -> conv -> BN (a class of its own, as a model's forward is)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), SynchronizedBatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 1), SynchronizedBatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn2(self.conv2(self.bn1(self.conv1(x)).relu()))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "conv-BN-ReLU-conv-BN": lambda: name_synchronized_layers(ConvNet()),
    "DeepLabV3+ ResNet-18": lambda: build_model(ModelConfig(backbone="resnet18", head_channels=16, aspp_rates=(1,),
                                                            norm="syncbn"), 6),
}


@contextlib.contextmanager
def variant(name: str):
    """The layer as `name` has it: 'after' (as it is), 'before' (the eager path while tracing), 'excluded'
    (the eager path behind torch.compiler.disable)."""
    cls = batchnorm._SynchronizedBatchNorm
    saved_check, saved_forward = batchnorm.is_compiling, cls.forward
    if name in ("before", "excluded"):
        batchnorm.is_compiling = lambda: False
    if name == "excluded":
        cls.forward = torch.compiler.disable(saved_forward)
    try:
        yield
    finally:
        batchnorm.is_compiling, cls.forward = saved_check, saved_forward


def explain(model: nn.Module, x: torch.Tensor) -> str:
    """'graphs / breaks' as torch._dynamo.explain counts them, or the error Dynamo raised."""
    torch._dynamo.reset()
    try:
        result = torch._dynamo.explain(model.train())(x)
    except Exception as error:  # noqa: BLE001 - the measurement is what Dynamo does, errors included
        return f"fails: {type(error).__name__}"
    return f"{result.graph_count} / {result.graph_break_count}"


def measure(setting: str, synchronized: bool = True) -> list[tuple[str, str, dict[str, str]]]:
    """One row per model; 'excluded' only where the layer takes the synchronized path."""
    rows = []
    x = torch.randn(2, 3, 32, 32)
    for model_name, make in MODELS.items():
        layers = sum(isinstance(m, SynchronizedBatchNorm2d) for m in make().modules())
        cells = {"excluded": "-"}
        for name in ("before", "excluded", "after") if synchronized else ("before", "after"):
            with variant(name):
                cells[name] = explain(make(), x)
        rows.append((f"{model_name} ({layers} layers)", setting, cells))
    return rows


def print_table(rows) -> None:
    heads = ("model", "where", "before", "before, layer excluded", "after")
    table = [heads] + [(model, setting, c["before"], c["excluded"], c["after"]) for model, setting, c in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(heads))]
    print(f"torch {torch.__version__}: graphs / graph breaks from torch._dynamo.explain")
    for row in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)))


def _rank(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    try:
        rows = measure("2 gloo processes")
    finally:
        dist.destroy_process_group()
    if rank == 0:
        set_sbn_eps_mode("clamp")  # on one process only 'clamp' takes the synchronized path
        rows += measure("1 process, eps 'clamp'")
        set_sbn_eps_mode("plus")
        rows += measure("1 process", synchronized=False)  # plain F.batch_norm, before and after
        print_table(rows)


def main() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(_rank, args=(port,), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
