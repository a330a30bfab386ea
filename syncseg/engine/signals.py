"""Stop requests: SIGINT/SIGTERM become a flag the training loop reads after each step, agreed by all ranks.

Schedulers stop a job by signalling its whole process group (Slurm's scancel and preemption,
Kubernetes, systemd, `timeout`, torchrun itself; Ctrl-C sends SIGINT the same way). The loop finishes
the step in progress, saves last.pt at that step and returns; a validation in progress ends at its next
batch. train.py then exits with 128 + the signal number, so the scheduler records an unfinished job.

Under torch.distributed every process must stop at the same iteration (one stopping early would leave
the others waiting in a collective), so after each step (and between validation batches) the processes
take the maximum of their flags: one float in a CPU all-reduce (gloo, also in NCCL jobs, whose process
group carries a gloo backend for CPU tensors), so agreeing never waits for a GPU. A request that arrives
during step k stops every process at k; one that arrives after a process has joined step k's agreement
stops them at k + 1.

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

from syncseg.engine.distributed import all_reduce_max, is_dist

logger = logging.getLogger(__name__)


class StopRequest:
    """Context manager: installs SIGINT/SIGTERM handlers (main thread only) and restores the previous
    ones on exit. `received` is the first signal number."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.iteration = 0  # the step in progress, for the log line (the training loop keeps it current)
        self._previous: dict[int, Any] = {}
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
            logger.warning("received %s during iteration %d: finishing it, then saving last.pt",
                           signal.Signals(signum).name, self.iteration)
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
        """Whether every process stops now. Under torch.distributed every process must call it the same
        number of times (once per step, once per validation batch): each call is one CPU all-reduce."""
        if not is_dist():
            return self.received is not None
        flag = torch.tensor([float(self.received or 0)])  # CPU: the gloo backend, no wait for a GPU
        received = int(all_reduce_max(flag).item())  # the signal number that any process received
        self.received = self.received or received or None
        return received != 0
