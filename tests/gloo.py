"""What the multi-process tests share: a free loopback port and a bounded gloo process group."""
from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_gloo(rank: int, world_size: int, port: int, *, timeout_s: float = 60) -> None:
    """Join the gloo group of `world_size` processes on 127.0.0.1:`port`; every collective is bounded by
    `timeout_s` (a hung peer fails the test instead of hanging it)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


# What the ranks of the app's multi-process tests import before their worker runs (start_ranks).
_SERVER_ENVIRONMENT: dict[str, str] | None = None  # os.environ when this process's forkserver started
PRELOAD = ["torch", "torch.distributed", "torchvision", "pytest", "syncseg.model.sync_batchnorm",
           "syncseg.engine.distributed", "syncseg.engine.launch_hints"]


def start_method() -> str:
    """"forkserver" where the platform has it, else "spawn". Either way each rank is a fresh process that never
    ran a test (no process group, torch's defaults), but the forkserver imports torch, torchvision and the
    engine's distributed module once per pytest worker and forks every rank from there, where "spawn" starts a
    new interpreter per rank that imports them again (~3 CPU-s a rank: test_large_world's 16 ranks took
    42 CPU-s)."""
    global _SERVER_ENVIRONMENT
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    if _SERVER_ENVIRONMENT is None:  # the server starts with the first forkserver process, right after this
        mp.set_forkserver_preload(PRELOAD)
        _SERVER_ENVIRONMENT = dict(os.environ)
    # a forkserver's ranks get the environment it started with, not the caller's: where a test changed the
    # environment since (monkeypatch.setenv), its ranks are spawned and see the change
    return "forkserver" if _test_independent(os.environ) == _test_independent(_SERVER_ENVIRONMENT) else "spawn"


def _test_independent(environment) -> dict[str, str]:
    """The environment without PYTEST_CURRENT_TEST, which pytest sets to each test's name as it runs it: compared
    with it, every test but the one that started the server spawned its ranks."""
    return {key: value for key, value in environment.items() if key != "PYTEST_CURRENT_TEST"}


def start_ranks(worker, args: tuple, nprocs: int, *, join: bool = True):
    """torch.multiprocessing.start_processes(worker, args, nprocs) with start_method(): `join=True` waits
    and raises the first rank's exception, as mp.spawn does; `join=False` returns the context."""
    return mp.start_processes(worker, args=args, nprocs=nprocs, join=join, start_method=start_method())


def environment_worker(rank: int, name: str, out: str) -> None:
    """A rank that writes what it sees of the environment variable `name` (tests/test_gloo.py)."""
    with open(out, "w") as file:
        file.write(os.environ.get(name, "<unset>"))
