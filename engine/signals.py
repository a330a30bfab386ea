"""Stop requests: SIGINT/SIGTERM become a flag the training loop reads after each step, agreed by all ranks.

Schedulers stop a job by signalling its whole process group (Slurm's scancel and preemption,
Kubernetes, systemd, `timeout`, torchrun itself; Ctrl-C sends SIGINT the same way). The loop finishes
the step, saves last.pt and returns; train.py then exits with 128 + the signal number, so the
scheduler records an unfinished job.

Under torch.distributed every process must stop at the same iteration (one stopping early would
leave the others waiting in a collective), so the flag is summed over the processes. The sum is read
one step late, so reading it never waits for the slowest process.

A second SIGTERM (torchrun forwards one after the group's own) is ignored. A second SIGINT interrupts
at once (KeyboardInterrupt), except during a save, where it waits until the file is complete.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
from typing import Any, Iterator

import torch
import torch.distributed as dist

from engine.distributed import is_dist

logger = logging.getLogger(__name__)


class StopRequest:
    """Context manager: installs SIGINT/SIGTERM handlers (main thread only) and restores the previous
    ones on exit. `received` is the first signal number."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self._pending: torch.Tensor | None = None
        self._saving = False
        self._interrupt_after_save = False

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum
            logger.warning("received %s: finishing the current step, then saving last.pt",
                           signal.Signals(signum).name)
        elif signum == signal.SIGINT:
            if self._saving:
                self._interrupt_after_save = True
            else:
                raise KeyboardInterrupt

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    @contextlib.contextmanager
    def deferring_interrupts(self) -> Iterator[None]:
        """A second SIGINT inside this block takes effect when the block ends (a save completes)."""
        self._saving = True
        try:
            yield
        finally:
            self._saving = False
        if self._interrupt_after_save:
            raise KeyboardInterrupt

    def agreed(self) -> bool:
        """Whether every process stops now (call once per step on every process)."""
        if not is_dist():
            return self.received is not None
        flag = torch.tensor([float(self.received or 0)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # the signal number that any process received
        previous, self._pending = self._pending, flag
        if previous is None or previous.item() == 0:
            return False
        self.received = self.received or int(previous.item())
        return True
