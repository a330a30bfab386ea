"""Named divergence: replicas or processes that call the synchronized layers differently raise, not hang.

Every statistics exchange is labelled with the layer's identity (its module path, set by
`name_synchronized_layers`, `convert_model` or `DataParallelWithCallback`) and the layer's call count.

* Thread replicas (DataParallelWithCallback): every synchronized layer of one replication shares an
  `ExchangeLedger`. A replica records each exchange before it waits; the first replica at exchange #k
  sets what #k is, and a replica that arrives there with another layer or call count (or whose forward
  ends while others wait at #k) aborts the round: every replica raises `SyncDivergenceError` at once.
* torch.distributed: the row each process already all-gathers carries two more numbers, the layer's key
  (48 bits of a hash of its path, exact in float64) and its call count, so every process sees every
  process's label and all raise the same message at the same exchange. On CPU the labels are read at
  once; on an accelerator they are copied to the host asynchronously and checked at the layer's next
  synchronized call, so the forward never waits for the device.

Both label only the exchanges themselves: two processes whose layers' rows differ in length (other
channel counts) cannot meet in one all_gather at all (gloo aborts the process), and a process whose
forward ends while another still calls a layer meets that call with its backward; neither can be told
apart on the wire without another collective (TORCH_DISTRIBUTED_DEBUG=DETAIL adds one that names them).
"""
from __future__ import annotations

import hashlib
import threading
from typing import Callable, Sequence

import torch

__all__ = ["SyncDivergenceError", "ExchangeLedger", "layer_key", "check_gathered_labels"]


class SyncDivergenceError(RuntimeError):
    """Replicas or processes called the synchronized layers in another order or another number of times."""


_ADVICE = ("every replica and process must call the synchronized layers in the same order and the same number "
           "of times (a branch taken on some of them only?)")


def layer_key(label: str) -> int:
    """48 bits of a hash of `label`: the same on every process, exact as a float64."""
    return int.from_bytes(hashlib.blake2b(label.encode(), digest_size=6).digest(), "big")


def _who(kind: str, ids: Sequence[int]) -> str:
    return f"{kind}{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))}"


class ExchangeLedger:
    """The order of exchanges of one replication round, shared by all synchronized layers of all replicas.

    `abort(error)` fails every layer's rendezvous of the round (DataParallelWithCallback's
    abort_synchronization), so replicas waiting elsewhere raise too.
    """

    def __init__(self, abort: Callable[[BaseException], None]) -> None:
        self._abort = abort
        self._lock = threading.Lock()
        self._first: list[tuple[str, int, list[int]]] = []  # exchange #k: (layer, call, replicas seen there)
        self._made: dict[int, int] = {}  # replica -> exchanges made
        self._finished: dict[int, int] = {}  # replica -> exchanges made when its forward ended
        self._error: SyncDivergenceError | None = None  # the first divergence: every replica raises it

    def record(self, copy_id: int, layer: str, call: int) -> None:
        """Replica `copy_id` is about to make its next exchange, `call` of `layer`; raises on divergence."""
        with self._lock:
            if self._error is not None:
                raise SyncDivergenceError(str(self._error))
            index = self._made.get(copy_id, 0)
            self._made[copy_id] = index + 1
            if index == len(self._first):
                self._first.append((layer, call, [copy_id]))
                error = self._error = self._ended_before(index)
            else:
                first_layer, first_call, replicas = self._first[index]
                if (first_layer, first_call) == (layer, call):
                    replicas.append(copy_id)
                    error = None
                else:
                    error = SyncDivergenceError(
                        f"synchronized BatchNorm exchange #{index + 1} diverged: {_who('replica', replicas)} called "
                        f"{first_layer} (call {first_call}) but replica {copy_id} called {layer} (call {call}); "
                        f"{_ADVICE}")
            self._error = error
        if error is not None:
            self._abort(error)
            raise error

    def finish(self, copy_id: int) -> None:
        """Replica `copy_id`'s forward returned; raises if another replica waits at an exchange it never made."""
        with self._lock:
            if self._error is not None:
                raise SyncDivergenceError(str(self._error))
            self._finished[copy_id] = self._made.get(copy_id, 0)
            error = self._error = self._ended_before(len(self._first) - 1) if self._first else None
        if error is not None:
            self._abort(error)
            raise error

    def _ended_before(self, index: int) -> SyncDivergenceError | None:
        ended = sorted(copy_id for copy_id, made in self._finished.items() if made <= index)
        if not ended:
            return None
        layer, call, replicas = self._first[index]
        made = self._finished[ended[0]]
        return SyncDivergenceError(
            f"synchronized BatchNorm exchange #{index + 1} diverged: {_who('replica', replicas)} called {layer} "
            f"(call {call}) but {_who('replica', ended)} ended the forward after {made} exchange(s); {_ADVICE}")


def check_gathered_labels(labels: torch.Tensor, ranks: Callable[[], Sequence[int]],
                          describe: Callable[[int], str]) -> None:
    """Raise SyncDivergenceError unless every row of `labels` ((processes, 2): key, call count, on the
    host) is the same. `ranks()`: the global rank of each row; `describe(key)`: the layer's name."""
    rows = [(int(key), int(call)) for key, call in labels.tolist()]
    if len(set(rows)) <= 1:
        return
    groups: dict[tuple[int, int], list[int]] = {}
    for rank, row in zip(ranks(), rows):
        groups.setdefault(row, []).append(rank)
    parts = [f"{_who('rank', members)} called {describe(key)} (call {call})" for (key, call), members in groups.items()]
    raise SyncDivergenceError(
        f"synchronized BatchNorm exchange diverged across processes: {' but '.join(parts)}; {_ADVICE}")
