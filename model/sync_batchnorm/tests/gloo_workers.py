"""Processes for the package's gloo tests: each function here runs in a spawned child, which imports it by
this module's name (the tests folder is on sys.path through the pytest config's `pythonpath`; the test
files themselves are imported by path, under names a child could not import)."""
from __future__ import annotations

import contextlib
import copy
import datetime
import gc
import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from sync_batchnorm import SyncDivergenceError, SynchronizedBatchNorm2d, convert_model, functions
from sync_batchnorm import name_synchronized_layers
from sync_batchnorm.functions import reads_stall_the_device

WORLD_SIZE = 2
SPLITS = [3, 5]
CHANNELS = 4
STEPS = 3
LEARNING_RATE = 0.1
TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def global_batch(step: int, dtype=torch.float64):
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(sum(SPLITS), CHANNELS, 5, 6, generator=generator, dtype=dtype) * (1 + step) + 2
    upstream = torch.randn(x.shape, generator=generator, dtype=dtype)
    return x, upstream


def initial_layer(dtype=torch.float64, cls=SynchronizedBatchNorm2d) -> nn.Module:
    layer = cls(CHANNELS).to(dtype)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        layer.weight.copy_(torch.rand(CHANNELS, generator=generator, dtype=dtype) + 0.5)
        layer.bias.copy_(torch.randn(CHANNELS, generator=generator, dtype=dtype))
    return layer


@contextlib.contextmanager
def _forbid_host_reads():
    """Make every Tensor -> Python read raise (on CUDA each would wait for the device queue)."""
    names = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")
    saved = {name: getattr(torch.Tensor, name) for name in names}
    calls: list[str] = []

    def guard(name):
        def read(self, *args, **kwargs):
            calls.append(name)
            raise AssertionError(f"Tensor.{name} called on the synchronized path")
        return read

    for name in names:
        setattr(torch.Tensor, name, guard(name))
    try:
        yield calls
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def _join(rank: int, port: int, world_size: int, timeout_s: float = TIMEOUT_S) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def numerics_worker(rank: int, port: int, out_dir: str) -> None:
    """Three SGD steps on per-rank batches of SPLITS, a probe that must read nothing back to the host, a
    large-mean input, and the layer inside DistributedDataParallel."""
    _join(rank, port, WORLD_SIZE)
    try:
        layer = initial_layer()
        start = sum(SPLITS[:rank])
        results = {}
        for step in range(STEPS):
            x, upstream = global_batch(step)
            chunk = x[start:start + SPLITS[rank]].clone().requires_grad_()
            y = layer(chunk)
            y.backward(upstream[start:start + SPLITS[rank]])
            grads = torch.stack([layer.weight.grad, layer.bias.grad])
            dist.all_reduce(grads)  # what DDP does (up to its 1/world_size averaging)
            results[f"y{step}"] = y.detach()
            results[f"dx{step}"] = chunk.grad
            results[f"dparams{step}"] = grads
            with torch.no_grad():
                layer.weight.sub_(LEARNING_RATE * grads[0])
                layer.bias.sub_(LEARNING_RATE * grads[1])
                layer.weight.grad = layer.bias.grad = None
        x, upstream = global_batch(STEPS)
        chunk = x[start:start + SPLITS[rank]].clone().requires_grad_()
        probe = copy.deepcopy(layer)  # the reference comparison below reads `layer`'s running statistics
        # as on CUDA, where a read waits for the device: the divergence labels are copied asynchronously
        functions.reads_stall_the_device = lambda tensor: True
        with _forbid_host_reads() as host_reads:
            with contextlib.suppress(AssertionError):
                probe(chunk).backward(upstream[start:start + SPLITS[rank]])
        functions.reads_stall_the_device = reads_stall_the_device
        results["host_reads"] = host_reads
        results["running_mean"] = layer.running_mean.clone()
        results["running_var"] = layer.running_var.clone()
        results["num_batches_tracked"] = layer.num_batches_tracked.clone()

        # float32 inputs with mean 1e4 and std 1 still normalize to std 1
        big = SynchronizedBatchNorm2d(CHANNELS, affine=False)
        generator = torch.Generator().manual_seed(rank)
        results["large_mean_output"] = big(torch.randn(SPLITS[rank], CHANNELS, 8, 8, generator=generator) + 1e4)

        # the same layer inside DistributedDataParallel
        model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Conv2d(3, CHANNELS, 1).double(), initial_layer()))
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p) * 0.5 + 1)
        x, upstream = global_batch(0)
        inputs = x[start:start + SPLITS[rank], :3]
        (model(inputs) * upstream[start:start + SPLITS[rank]]).sum().backward()
        results["ddp_grads"] = [p.grad.clone() for p in model.parameters()]
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        del model
        gc.collect()  # DDP sits in reference cycles: a live DDP during destroy_process_group aborts gloo at exit
        dist.barrier()
    finally:
        dist.destroy_process_group()


# What the rank processes import before their worker runs: the forkserver imports it once, and every rank is
# a fork of it (below). Inductor too (torch._inductor.compile_fx brings torch._dynamo and the code generators):
# the compiled tests' ranks otherwise each imported it, and on a fresh venv, with no bytecode written yet, four
# ranks compiled the same modules at once (the package's tests, empty inductor cache: 89 -> 77 s and 158 -> 130
# busy core-seconds with the venv's bytecode absent, 71.5 -> 59 s and 128 -> 103 with it).
PRELOAD = ["torch", "torch.distributed", "torch._inductor.compile_fx", "sync_batchnorm", "gloo_workers",
           "compile_workers"]
_SERVER_ENVIRONMENT: dict[str, str] | None = None  # os.environ when this process's forkserver started


def start_method() -> str:
    """"forkserver" where the platform has it, else "spawn". Either way each rank is a fresh process that
    never ran a test (no process group, no layer state, torch's defaults), but a forkserver imports torch
    and this package once per test session and forks every rank from there, where "spawn" starts a new
    interpreter that imports them again for each rank: on a 2-core machine ~2.5 CPU-s a rank, ~40 ranks in
    this suite."""
    global _SERVER_ENVIRONMENT
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    if _SERVER_ENVIRONMENT is None:  # the server starts with the first forkserver process, right after this
        mp.set_forkserver_preload(PRELOAD)
        _SERVER_ENVIRONMENT = dict(os.environ)
    # a forkserver's ranks get the environment it started with: after a change to it, spawn (a change of
    # PYTEST_CURRENT_TEST, each test's name as pytest runs it, aside: compared with it, every test but the
    # one that started the server spawned its ranks)
    return "forkserver" if _test_independent(os.environ) == _test_independent(_SERVER_ENVIRONMENT) else "spawn"


def _test_independent(environment) -> dict[str, str]:
    return {key: value for key, value in environment.items() if key != "PYTEST_CURRENT_TEST"}


def run_ranks(worker, out_dir: Path, *, world_size: int = WORLD_SIZE, args: tuple = (),
              timeout_s: float = TIMEOUT_S) -> list[dict]:
    """Run `worker(rank, port, out_dir, *args)` in `world_size` new processes; each saves rank{rank}.pt
    in out_dir, returned in rank order. Fails the test (after killing them) if they run past `timeout_s`."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    port = free_port()
    context = mp.start_processes(worker, args=(port, str(out_dir), *args), nprocs=world_size, join=False,
                                 start_method=start_method())
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=0.2):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"distributed workers did not finish within {timeout_s} s (hang)")
    return [torch.load(Path(out_dir) / f"rank{rank}.pt", weights_only=True) for rank in range(world_size)]


# --------------------------------------------------------------------------------------------------
# Divergence: one rank takes an extra branch.
# --------------------------------------------------------------------------------------------------
class Branchy(nn.Module):
    """stem -> (extra on the ranks in `extra_ranks`) -> head: a branch taken on some ranks only."""

    def __init__(self, extra_ranks: tuple[int, ...], stem_twice: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.stem, self.extra, self.head = (SynchronizedBatchNorm2d(CHANNELS) for _ in range(3))
        self.extra_ranks, self.stem_twice = extra_ranks, stem_twice

    def forward(self, x):
        x = self.stem(x)
        if dist.get_rank() in self.stem_twice:
            x = self.stem(x)
        if dist.get_rank() in self.extra_ranks:
            x = self.extra(x)
        return self.head(x)


def divergence_worker(rank: int, port: int, out_dir: str) -> None:
    """Record what each diverging forward raised, and how long after the forward began."""
    _join(rank, port, 2, timeout_s=30)  # a hang would end in gloo's timeout, far past the test's 5 s
    results = {}
    x = torch.randn(3, CHANNELS, 4, 4)
    try:
        for case, model in (("extra", Branchy(extra_ranks=(1,))), ("twice", Branchy((), stem_twice=(0,)))):
            name_synchronized_layers(model)
            start = time.monotonic()
            try:
                model(x)
                results[case] = "no error"
            except SyncDivergenceError as error:
                results[case] = str(error)
            results[f"{case}_seconds"] = time.monotonic() - start
        # where reading the labels would wait for a device (CUDA), the check comes at the layer's next call
        functions.reads_stall_the_device = lambda tensor: True
        model = name_synchronized_layers(Branchy(extra_ranks=(1,)))
        model.stem(x)
        (model.extra if rank == 1 else model.head)(x)  # diverges, unnoticed for now
        model.stem(x)
        try:
            (model.extra if rank == 1 else model.head)(x)
            results["deferred"] = "no error"
        except SyncDivergenceError as error:
            results["deferred"] = str(error)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# Sync groups: 4 ranks in 2 groups against two independent 2-rank runs.
# --------------------------------------------------------------------------------------------------
GROUP_SPLITS = [[2, 3], [4, 1]]  # per group, per rank in the group


def group_batch(group: int, step: int):
    generator = torch.Generator().manual_seed(1000 * group + step)
    x = torch.randn(sum(GROUP_SPLITS[group]), CHANNELS, 3, 5, generator=generator, dtype=torch.float64)
    x = x * (1 + group + step) + 3 * group
    return x, torch.randn(x.shape, generator=generator, dtype=torch.float64)


def _train_in_group(layer: nn.Module, group: int, member: int, process_group, compiled: bool = False) -> dict:
    """Two SGD steps of `layer` on this member's share of `group`'s batches; gradients summed in the group.
    `compiled`: through torch.compile (fullgraph, without code generation: the aot_eager backend)."""
    forward = torch.compile(layer, backend="aot_eager", fullgraph=True) if compiled else layer
    results = {}
    start = sum(GROUP_SPLITS[group][:member])
    for step in range(2):
        x, upstream = group_batch(group, step)
        chunk = x[start:start + GROUP_SPLITS[group][member]].clone().requires_grad_()
        y = forward(chunk)
        y.backward(upstream[start:start + GROUP_SPLITS[group][member]])
        grads = torch.stack([layer.weight.grad, layer.bias.grad])
        dist.all_reduce(grads, group=process_group)
        results.update({f"y{step}": y.detach(), f"dx{step}": chunk.grad, f"dparams{step}": grads})
        with torch.no_grad():
            layer.weight.sub_(LEARNING_RATE * grads[0])
            layer.bias.sub_(LEARNING_RATE * grads[1])
            layer.weight.grad = layer.bias.grad = None
    results.update(running_mean=layer.running_mean.clone(), running_var=layer.running_var.clone())
    return results


def assert_groups_match(grouped: list[dict], independent: list[dict]) -> None:
    """4 ranks in groups {0, 1}, {2, 3} give what the 2 ranks of an independent run give, within 1e-6."""
    for rank in range(4):
        group, member = divmod(rank, 2)
        got, expected = grouped[rank][group], independent[member][group]
        assert got.keys() == expected.keys()
        for key in got:
            torch.testing.assert_close(got[key], expected[key], rtol=1e-6, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {key}: {m}")


def groups_worker(rank: int, port: int, out_dir: str, world_size: int, compiled: bool = False) -> None:
    """world_size 4: groups {0, 1} and {2, 3}; group 0's layer takes process_group= when built, group 1's
    from convert_model; `compiled`: under torch.compile. world_size 2: both groups' runs, one after the
    other, each with a fresh layer."""
    _join(rank, port, world_size)
    try:
        results = {}
        if world_size == 4:
            own_group, _ = dist.new_subgroups(group_size=2)
            group, member = divmod(rank, 2)
            if group == 0:
                layer = initial_layer(cls=lambda channels: SynchronizedBatchNorm2d(channels, process_group=own_group))
            else:
                layer = convert_model(nn.Sequential(initial_layer(cls=nn.BatchNorm2d)), process_group=own_group)[0]
            results[group] = _train_in_group(layer, group, member, own_group, compiled)
        else:
            for group in range(2):
                results[group] = _train_in_group(initial_layer(), group, rank, None)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
