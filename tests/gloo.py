"""What the multi-process tests share: a free loopback port and a bounded gloo process group."""
from __future__ import annotations

import datetime
import socket

import torch.distributed as dist


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
