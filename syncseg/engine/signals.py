"""Stop requests: SIGINT/SIGTERM become a flag the training loop reads after each step, agreed by all ranks.

Schedulers stop a job by signalling its whole process group (Slurm's scancel and preemption,
Kubernetes, systemd, `timeout`, torchrun itself; Ctrl-C sends SIGINT the same way). The loop finishes
the step in progress, saves last.pt at that step and returns; a loop between steps (PreciseBN, a
validation, the TensorBoard grid) ends at its next batch. train.py then exits with 128 + the signal
number, so the scheduler records an unfinished job.

Under torch.distributed every process must stop at the same iteration (one stopping early would leave
the others waiting in a collective), so after each step (and between the batches of those loops) the
processes take the maximum of their flags: one float in a CPU all-reduce (gloo, also in NCCL jobs, whose
process group carries a gloo backend for CPU tensors), so agreeing never waits for a GPU. A request that
arrives during step k stops every process at k; one that arrives after a process has joined step k's
agreement stops them at the next one.

Later signals change nothing: a second SIGTERM (torchrun forwards one after the group's own) and an
impatient second Ctrl-C are logged, and the stop the first one asked for is still saved (every loop
answers it within a batch), so the exit status stays 128 + the first signal. Raising KeyboardInterrupt
there would abandon the save and, under torch.distributed, leave this process's collectives unmatched.
SIGQUIT (Ctrl-\\) or SIGKILL abort without saving.
"""
from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

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
            logger.warning("received SIGINT again: already stopping at the next batch to save last.pt "
                           "(SIGQUIT, Ctrl-\\, aborts without saving)")

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    @property
    def requested(self) -> bool:
        """Whether this process received a signal (no communication: for work only this process does)."""
        return self.received is not None

    def agreed(self) -> bool:
        """Whether every process stops now. Under torch.distributed every process must call it the same
        number of times (once per step, once per batch of a loop between steps): each call is one CPU
        all-reduce."""
        if not is_dist():
            return self.received is not None
        flag = torch.tensor([float(self.received or 0)])  # CPU: the gloo backend, no wait for a GPU
        received = int(all_reduce_max(flag).item())  # the signal number that any process received
        self.received = self.received or received or None
        return received != 0


class Stopped(Exception):
    """Raised by until_stop when `should_stop()` said to stop."""


def until_stop(batches: Iterable[Any], should_stop: Callable[[], bool] | None) -> Iterator[Any]:
    """The items of `batches` (a sized iterable), asking `should_stop()` before each; raises Stopped when
    it says to stop. Under torch.distributed the processes' `batches` may differ in length, so every
    process asks as often as the longest has items (`should_stop` is a collective: StopRequest.agreed)."""
    if should_stop is None:
        yield from batches
        return
    rounds = int(all_reduce_max(torch.tensor([len(batches)]))[0])  # type: ignore[arg-type]
    iterator = iter(batches)
    for _ in range(rounds):
        if should_stop():
            raise Stopped
        batch = next(iterator, None)
        if batch is not None:
            yield batch
