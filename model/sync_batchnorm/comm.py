"""Thread rendezvous between the replicas of one module under DataParallel.

Each synchronized layer owns a `SyncMaster`. When DataParallel replicates the model, copy 0 (the
master) starts a new round and every other copy registers a `SlavePipe`. In the forward pass every
slave sends its message through its pipe and waits; the master collects them, runs the master callback
once over all messages (ordered by copy id), and hands each slave its result through a `FutureResult`.

Failure handling, which the original package lacks: a replica that raises (anywhere in its forward)
aborts the round, so every replica still waiting raises `SyncAbortedError` at once instead of hanging
the step; a slave's own failure reaches the master through `SlavePipe.abort`. As a last resort a round
is bounded by `timeout` seconds as a whole (the master's wait for all slaves together, not per
message). The next round (the next `replicate`) starts clean.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from typing import Any, Callable

from .divergence import SyncDivergenceError

__all__ = ["FutureResult", "SlavePipe", "SyncMaster", "SyncAbortedError", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 300.0  # seconds a replica waits for the others before giving up

_ABORT = object()  # queue sentinel: wakes a waiting master when some replica failed


class SyncAbortedError(RuntimeError):
    """Raised in a replica whose synchronization partner failed or timed out."""


class FutureResult:
    """A one-slot result that one thread puts and another waits for (with a timeout)."""

    def __init__(self) -> None:
        self._condition = threading.Condition(threading.Lock())
        self._has_value = False
        self._value: Any = None
        self._exception: BaseException | None = None

    def put(self, result: Any) -> None:
        with self._condition:
            assert not self._has_value, "FutureResult.put called twice before get"
            self._value = result
            self._has_value = True
            self._condition.notify_all()

    def set_exception(self, exception: BaseException) -> None:
        """Make the current and every later `get` raise (until `reset`)."""
        with self._condition:
            self._exception = exception
            self._condition.notify_all()

    @property
    def failed(self) -> bool:
        return self._exception is not None

    def reset(self) -> None:
        with self._condition:
            self._has_value = False
            self._value = None
            self._exception = None

    def get(self, timeout: float | None = None) -> Any:
        """Wait for the result; raises SyncAbortedError on abort, TimeoutError after `timeout` s."""
        with self._condition:
            ready = self._condition.wait_for(lambda: self._has_value or self._exception is not None, timeout)
            if self._exception is not None:
                raise _aborted(self._exception)
            if not ready:
                raise TimeoutError(f"no synchronization result after {timeout} s: another replica did not arrive")
            value = self._value
            self._has_value = False
            self._value = None
            return value


def _aborted(cause: BaseException) -> BaseException:
    if isinstance(cause, SyncAbortedError):
        return cause
    if isinstance(cause, SyncDivergenceError):  # every replica raises the one message that names the layers
        return SyncDivergenceError(str(cause))
    error = SyncAbortedError(f"synchronization aborted because a replica failed: {type(cause).__name__}: {cause}")
    error.__cause__ = cause
    return error


class SlavePipe:
    """A slave replica's end of the rendezvous: send a message, receive the master's result.

    `SlavePipe(identifier, queue, result)` as in the original package; `timeout` bounds the wait for the
    result and `abort` (the master's SyncMaster.abort) lets this replica fail the whole round.
    """

    def __init__(self, identifier: int, message_queue: queue.Queue, result: FutureResult,
                 timeout: float = DEFAULT_TIMEOUT, abort: Callable[[BaseException], None] | None = None) -> None:
        self.identifier = identifier
        self.queue = message_queue
        self.result = result
        self.timeout = timeout
        self._abort = abort

    def run_slave(self, message: Any) -> Any:
        if self.result.failed:  # the round was aborted before this replica arrived
            return self.result.get(0)
        self.queue.put((self.identifier, message))
        return self.result.get(self.timeout)

    def abort(self, cause: BaseException) -> None:
        """Fail the round for every replica (this one raises `cause` itself)."""
        if self._abort is not None:
            self._abort(cause)
        else:  # a pipe made without the master's abort: wake the master, which fails the others
            self.queue.put(_ABORT)


class SyncMaster:
    """The master replica's end: gathers every slave's message, runs `master_callback` once.

    `master_callback(intermediates)` receives `[(copy_id, message), ...]` sorted by copy id (master
    first, id 0) and returns `[(copy_id, result), ...]` in the same order.
    """

    def __init__(self, master_callback: Callable[[list], list] | None = None, *, timeout: float = DEFAULT_TIMEOUT):
        self._master_callback = master_callback
        self.timeout = timeout
        self._init_runtime_state()

    def _init_runtime_state(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._registry: OrderedDict[int, FutureResult] = OrderedDict()
        self._lock = threading.Lock()
        self._aborted: BaseException | None = None

    # Pickling/deepcopy: the queue and locks are per-process runtime state, rebuilt empty.
    def __getstate__(self) -> dict:
        return {"master_callback": self._master_callback, "timeout": self.timeout}

    def __setstate__(self, state: dict) -> None:
        self._master_callback = state["master_callback"]
        self.timeout = state["timeout"]
        self._init_runtime_state()

    @property
    def nr_slaves(self) -> int:
        return len(self._registry)

    def start_round(self) -> None:
        """Forget the previous round's slaves, stale messages and abort state (called by copy 0)."""
        with self._lock:
            self._registry.clear()
            self._aborted = None
            while True:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break

    def register_slave(self, identifier: int) -> SlavePipe:
        with self._lock:
            future = FutureResult()
            self._registry[identifier] = future
            return SlavePipe(identifier, self._queue, future, self.timeout, abort=self.abort)

    def abort(self, cause: BaseException) -> None:
        """Fail the current round: every waiting (and later arriving) replica raises."""
        with self._lock:
            if self._aborted is not None:
                return
            self._aborted = cause
            futures = list(self._registry.values())
        self._queue.put(_ABORT)
        for future in futures:
            future.set_exception(cause)

    def run_master(self, master_message: Any) -> Any:
        """Collect all slave messages, run the callback, distribute results; returns the master's."""
        if self._aborted is not None:
            raise _aborted(self._aborted)
        intermediates = [(0, master_message)]
        deadline = time.monotonic() + self.timeout
        try:
            for _ in range(self.nr_slaves):
                try:
                    item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise TimeoutError(
                        f"synchronized layer waited {self.timeout} s for {self.nr_slaves} replicas; "
                        f"only {len(intermediates) - 1} arrived"
                    ) from None
                if item is _ABORT:
                    raise _aborted(self._aborted or SyncAbortedError("aborted"))
                intermediates.append(item)
            intermediates.sort(key=lambda pair: pair[0])
            results = self._master_callback(intermediates)
            assert [copy_id for copy_id, _ in results] == [copy_id for copy_id, _ in intermediates], (
                "the master callback must return one result per message, in copy-id order"
            )
        except BaseException as error:
            self.abort(error)
            raise
        for copy_id, result in results[1:]:
            self._registry[copy_id].put(result)
        return results[0][1]
