"""Named divergence: replicas or processes that call the synchronized layers differently raise, not hang.

Every statistics exchange is labelled with the layer's identity (its module path, set by
`name_synchronized_layers`, `convert_model` or `DataParallelWithCallback`) and the layer's call count.

* Thread replicas (DataParallelWithCallback): every synchronized layer of one replication shares an
  `ExchangeLedger`. A replica records each exchange before it waits; the first replica at exchange #k
  sets what #k is, and a replica that arrives there with another layer or call count (or whose forward
  ends while others wait at #k) aborts the round: every replica raises `SyncDivergenceError` at once.
* torch.distributed: the sums each process already all-reduces carry six more numbers, `label_values`:
  for the layer's key (the low bits of a hash of its path) and for its call count, the value v, v^2 and
  (rank in the group) * v. All processes agree exactly when n * sum(v^2) == sum(v)^2 (Cauchy-Schwarz),
  and the values are small enough (`label_bits`) that every sum is an exact integer in float64 at any
  world size, so the check has no false alarm and the bytes do not grow with the world. Where the
  processes split into two labels (an extra branch, a second call: the common case) the same sums give
  both labels, how many ranks hold each and the sum of their ranks, so every process names the ranks
  and layers in one identical message (`check_label_sums`); other splits are reported by what this
  process called. On CPU the sums are read at once; on an accelerator they are copied to the host
  asynchronously and checked at the layer's next synchronized call, so the forward never waits for the
  device.

Both label only the exchanges themselves: two processes whose layers' sums differ in length (other
channel counts) cannot meet in one all_reduce at all (gloo aborts the process), and a process whose
forward ends while another still calls a layer meets that call with its backward; neither can be told
apart on the wire without another collective (TORCH_DISTRIBUTED_DEBUG=DETAIL adds one that names them).
"""
from __future__ import annotations

import hashlib
import threading
from typing import Callable, Sequence

import torch

__all__ = ["SyncDivergenceError", "ExchangeLedger", "layer_key", "check_gathered_labels", "check_label_sums"]


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


# --- labels carried in an all-reduce: sums whose size does not depend on the world size -----------------
LABEL_WIDTH = 6  # key: v, v^2, rank * v; call count: the same three


def label_bits(world: int) -> int:
    """How many low bits of the key and of the call count a process of a `world`-process group sends: few
    enough that world * v^2 and world^2 * v stay below 2**53, so every sum is an exact integer in float64."""
    world_bits = max(1, (world - 1).bit_length())  # world <= 2**world_bits
    return min((53 - world_bits) // 2, 53 - 2 * world_bits)


def label_values(key: int, call: int, index: int, world: int) -> list[int]:
    """What a process adds to the group's label sums: its layer key's and call count's low bits v, each as
    (v, v^2, index * v), where `index` is its rank in the group."""
    mask = (1 << label_bits(world)) - 1
    values = []
    for v in (key & mask, call & mask):
        values += [v, v * v, index * v]
    return values


def _split(sums: Sequence[int], own: int, world: int) -> list[tuple[int, int, int]] | None:
    """One field's groups from its sums (v, v^2, index * v over the group) and this process's v: [(v, how
    many ranks, sum of their indices)], one group if all agree, two if exactly two values reconstruct
    consistently; None when the split cannot be told from the sums (three or more values)."""
    total, squares, weighted = sums
    all_indices = world * (world - 1) // 2
    if world * squares == total * total:
        return [(own, world, all_indices)]
    d1, d2 = total - world * own, squares - world * own * own
    if d1 == 0 or d2 % d1:
        return None
    other = d2 // d1 - own
    if other < 0 or other == own:
        return None
    count, rest = divmod(d1, other - own)
    indices, rest2 = divmod(weighted - own * all_indices, other - own)
    if rest or rest2 or not 1 <= count < world or (world - count) * own * own + count * other * other != squares:
        return None
    return [(own, world - count, all_indices - indices), (other, count, indices)]


def _members(count: int, indices: int, other: tuple[int, int] | None, world: int) -> list[int] | None:
    """A group's indices where the sums fix them: one member, or every index but the other group's one."""
    if count == 1:
        return [indices]
    if other is not None and other[0] == 1:
        return [i for i in range(world) if i != other[1]]
    return None


def check_label_sums(sums: Sequence[float], key: int, call: int, index: int, world: int,
                     ranks: Callable[[], Sequence[int]], describe: Callable[[int, int], str]) -> None:
    """Raise SyncDivergenceError unless every process of the group sent the label this one sent (`key`,
    `call`, its `index` in the group of `world`). `sums`: the group's sums of `label_values` (on the host);
    `ranks()`: the global rank of each index; `describe(bits_value, bits)`: the layer whose key's low
    `bits` are `bits_value`."""
    sums = [int(round(float(value))) for value in sums]
    own = label_values(key, call, index, world)
    bits = label_bits(world)
    keys, calls = _split(sums[0:3], own[0], world), _split(sums[3:6], own[3], world)
    if keys is not None and calls is not None and len(keys) == len(calls) == 1:
        return
    half = 1 << (bits - 1)

    def call_number(value: int) -> int:  # the full call count, from its low bits and this process's
        return call + ((value - own[3] + half) % (1 << bits)) - half

    groups = None  # [(key bits, call bits, count, index sum)], this process's group first
    if keys is not None and calls is not None:
        if len(calls) == 1:
            groups = [(k, own[3], count, indices) for k, count, indices in keys]
        elif len(keys) == 1:
            groups = [(own[0], c, count, indices) for c, count, indices in calls]
        elif [group[1:] for group in keys] == [group[1:] for group in calls]:
            groups = [(k, c, count, indices) for (k, count, indices), (c, _, _) in zip(keys, calls)]
    global_ranks = list(ranks())
    if groups is None:
        raise SyncDivergenceError(
            f"synchronized BatchNorm exchange diverged across processes: rank {global_ranks[index]} called "
            f"{describe(own[0], bits)} (call {call}) but not all {world} ranks of its group called that layer "
            f"and call (more than two different calls met at this exchange); {_ADVICE}")
    parts = []
    for position, (k, c, count, indices) in enumerate(groups):
        other = groups[1 - position]
        members = _members(count, indices, (other[2], other[3]), world)
        parts.append((members, k, c, count))
    parts.sort(key=lambda part: (min(part[0]) if part[0] else world, part[1], part[2]))
    text = []
    for members, k, c, count in parts:
        if members is None:
            who = f"{count} ranks"
        elif len(members) > 8:
            missing = sorted(set(range(world)) - set(members))
            who = f"the {len(members)} ranks other than rank {', '.join(str(global_ranks[i]) for i in missing)}"
        else:
            who = _who("rank", [global_ranks[i] for i in members])
        text.append(f"{who} called {describe(k, bits)} (call {call_number(c)})")
    raise SyncDivergenceError(
        f"synchronized BatchNorm exchange diverged across processes: {' but '.join(text)}; {_ADVICE}")
