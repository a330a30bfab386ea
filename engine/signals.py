"""Stop requests: SIGINT/SIGTERM become a flag the training loop reads after each step, agreed by all ranks.

Under torch.distributed every process must stop at the same iteration (one stopping early would
leave the others waiting in a collective), so the flag is summed over the processes. The sum is read
one step late, so reading it never waits for the slowest process.
"""
from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import torch

from engine.distributed import all_reduce_sum, is_dist

logger = logging.getLogger(__name__)


class StopRequest:
    """Context manager: installs SIGINT/SIGTERM handlers (main thread only) and restores the previous
    ones on exit. `received` is the first signal number; a second SIGINT interrupts at once."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self._pending: torch.Tensor | None = None

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum
        logger.warning("received %s: finishing the current step, then saving last.pt", signal.Signals(signum).name)

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def agreed(self) -> bool:
        """Whether every process stops now (call once per step on every process)."""
        if not is_dist():
            return self.received is not None
        flag = torch.tensor([1.0 if self.received else 0.0], device=self.device)
        all_reduce_sum(flag)
        previous, self._pending = self._pending, flag
        return previous is not None and previous.item() > 0
