"""Synchronized BatchNorm: batch statistics reduced over every replica and every process.

In training, a `SynchronizedBatchNorm*d` normalizes with the mean and variance of the whole batch seen
by all replicas of `DataParallelWithCallback` (threads, any devices, CPU included) and all processes of
an initialized `torch.distributed` group (NCCL or gloo; the layer's `process_group`, else the world).
With neither, it is plain `F.batch_norm`, bit for bit `nn.BatchNorm*d`. In eval mode it uses the running
statistics like nn.BatchNorm.

The autograd graph of the synchronized path (one graph for every topology) is in functions.py; the
labels that name a divergence (the layer's path and call count) are divergence.py's. While torch.compile
traces the layer, the synchronized path is compiled.py's (functional collectives, no graph break); the
eager path does not change.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.compiler import is_compiling
from torch.nn.modules.batchnorm import _BatchNorm

from . import compiled, functions
from .comm import SyncMaster
from .divergence import check_label_sums, layer_key
from .functions import BackwardHandoff, CombineMeta, CombineStats, LocalStats, Normalize, StatsMessage

__all__ = [
    "SynchronizedBatchNorm1d",
    "SynchronizedBatchNorm2d",
    "SynchronizedBatchNorm3d",
    "set_sbn_eps_mode",
    "get_sbn_eps_mode",
]

EPS_MODES = ("plus", "clamp")
# The original package's process-wide switch (its API, hence module state): how eps enters a
# normalization with batch statistics. "plus" (the default here, and nn.BatchNorm's): 1/sqrt(var + eps);
# "clamp" (the original's default): 1/sqrt(max(var, eps)). Running statistics (eval) always use "plus".
_eps_mode = ["plus"]


def set_sbn_eps_mode(mode: str) -> None:
    """'plus' (default: 1/sqrt(var + eps), as nn.BatchNorm) or 'clamp' (1/sqrt(max(var, eps)), the original
    package's default), for every synchronized layer's training-mode normalization, on any topology."""
    if mode not in EPS_MODES:
        raise ValueError(f"set_sbn_eps_mode({mode!r}): the eps mode is one of {', '.join(map(repr, EPS_MODES))}")
    _eps_mode[0] = mode


def get_sbn_eps_mode() -> str:
    """The eps mode set by set_sbn_eps_mode ('plus' unless changed)."""
    return _eps_mode[0]


class _SynchronizedBatchNorm(_BatchNorm):
    """Base class; use SynchronizedBatchNorm1d/2d/3d. Same constructor and state dict as nn.BatchNorm."""

    _accepted_dims: tuple[int, ...] = ()
    _shape_hint = ""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device=None,
        dtype=None,
        *,
        process_group=None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        # torch.distributed group to reduce over; None: the whole world when torch.distributed is initialized
        self.process_group = process_group
        self._sync_master = SyncMaster(self._data_parallel_master)
        self._is_parallel = False
        self._parallel_id: int | None = None
        self._slave_pipe = None
        self._exchange_ledger = None
        self._exchange_calls = 0  # synchronized calls: this round's (thread replicas), else since creation
        self._pending_label_checks: list = []  # shared with this round's replicas (a shallow copy keeps it)
        self.sync_names: dict[int, str] = {}  # key -> path of every layer named with this one
        self.sync_name = None
        compiled.register(self)

    @property
    def sync_name(self) -> str | None:
        """The layer's module path, which divergence errors name (name_synchronized_layers sets it)."""
        return self._sync_name

    @sync_name.setter
    def sync_name(self, name: str | None) -> None:
        self._sync_name = name
        label = repr(name) if name is not None else f"an unnamed {type(self).__name__}({self.num_features})"
        self._sync_label, self._sync_key = label, layer_key(label)

    def _describe_key(self, key: int, bits: int = 64) -> str:
        """The layer whose key is `key`, or, with `bits`, whose key's low `bits` bits are `key`."""
        mask = (1 << bits) - 1
        if self._sync_key & mask == key:
            return self._sync_label
        name = next((name for full, name in self.sync_names.items() if full & mask == key), None)
        return repr(name) if name is not None else f"a layer this process cannot name (key {key:#x})"

    # --- state: runtime rendezvous objects never travel with the module ------------------------
    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for name, default in (("process_group", None), ("_exchange_ledger", None), ("_exchange_calls", 0),
                              ("_pending_label_checks", []), ("sync_names", {})):
            self.__dict__.setdefault(name, default)  # a layer pickled before these existed
        if "_sync_name" not in self.__dict__:
            self.sync_name = None
        compiled.register(self)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_slave_pipe"] = None
        state["_is_parallel"] = False
        state["_parallel_id"] = None
        state["_exchange_ledger"] = None
        state["_pending_label_checks"] = []
        return state

    @property
    def sync_timeout(self) -> float:
        """Seconds a replica waits for the others before raising (thread replicas)."""
        return self._sync_master.timeout

    @sync_timeout.setter
    def sync_timeout(self, seconds: float) -> None:
        self._sync_master.timeout = float(seconds)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() not in self._accepted_dims:
            dims = " or ".join(f"{d}D" for d in self._accepted_dims)
            raise ValueError(
                f"{type(self).__name__}: expected {dims} input of shape {self._shape_hint.format(C=self.num_features)}, "
                f"got {input.dim()}D input of shape {tuple(input.shape)}"
            )
        if input.size(1) != self.num_features:
            raise ValueError(
                f"{type(self).__name__}: expected {self.num_features} channels in dimension 1 "
                f"(shape {self._shape_hint.format(C=self.num_features)}), got shape {tuple(input.shape)}"
            )

    # --- replication protocol (DataParallelWithCallback / execute_replication_callbacks) --------
    def __data_parallel_replicate__(self, ctx, copy_id: int) -> None:
        self._is_parallel = True
        self._parallel_id = copy_id
        self._exchange_ledger = getattr(ctx, "exchange_ledger", None)
        self._exchange_calls = 0
        if self.sync_name is None and getattr(ctx, "module_path", None) is not None:
            self.sync_name = ctx.module_path
        if copy_id == 0:
            ctx.sync_master = self._sync_master
            self._sync_master.start_round()
            self._slave_pipe = None
        else:
            self._slave_pipe = ctx.sync_master.register_slave(copy_id)

    def _distributed_group(self):
        """The process group to reduce over in training, or None when not distributed."""
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None

    def _thread_exchange(self) -> Callable[[StatsMessage], Any] | None:
        if not self._is_parallel:
            return None
        if self._slave_pipe is not None:
            return self._slave_pipe.run_slave
        if self._parallel_id == 0 and self._sync_master.nr_slaves > 0:
            return self._sync_master.run_master
        return None

    def synchronizes(self) -> bool:
        """Whether a forward with batch statistics would now reduce over other replicas or processes.

        All replicas of one step agree on it, so a caller may branch on it without risking a hang.
        """
        return self._thread_exchange() is not None or self._distributed_group() is not None

    def _abort_round(self, error: BaseException) -> None:
        """Fail this step's rendezvous for every thread replica (they raise at once instead of waiting)."""
        if self._slave_pipe is not None:
            self._slave_pipe.abort(error)
        elif self._is_parallel and self._parallel_id == 0:
            self._sync_master.abort(error)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        try:
            self._check_input_dim(input)
        except ValueError as error:
            self._abort_round(error)
            raise
        # Running-statistics bookkeeping exactly as nn.BatchNorm.
        average_factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            average_factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        track = not self.training or self.track_running_stats
        running_mean = self.running_mean if track else None
        running_var = self.running_var if track else None

        if use_batch_stats and self.synchronizes():
            if is_compiling():  # torch.compile is tracing: the traceable path
                return compiled.forward(self, input, average_factor, running_mean, running_var,
                                        get_sbn_eps_mode() == "clamp")
            exchange = self._thread_exchange()
            self._exchange_calls += 1
            if exchange is not None and self._exchange_ledger is not None:
                try:
                    self._exchange_ledger.record(self._parallel_id, self._sync_label, self._exchange_calls)
                except BaseException as error:
                    self._abort_round(error)
                    raise
            return self._forward_synchronized(input, exchange, average_factor, running_mean, running_var)
        if use_batch_stats and get_sbn_eps_mode() == "clamp":  # F.batch_norm only adds eps
            if is_compiling():
                return compiled.forward(self, input, average_factor, running_mean, running_var, True)
            return self._forward_synchronized(input, None, average_factor, running_mean, running_var)
        return F.batch_norm(
            input, running_mean, running_var, self.weight, self.bias, use_batch_stats, average_factor, self.eps
        )

    def _forward_synchronized(
        self,
        input: torch.Tensor,
        exchange: Callable[[StatsMessage], Any] | None,
        average_factor: float,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
    ) -> torch.Tensor:
        """Normalize with statistics merged through `exchange` (None: this replica alone, plus any
        torch.distributed group). Updates running statistics in place with the global values."""
        self._check_pending_labels()
        clamp = get_sbn_eps_mode() == "clamp"
        handoff = BackwardHandoff()
        with torch.autocast(device_type=input.device.type, enabled=False):
            local = LocalStats.apply(input, handoff)
            message = StatsMessage(handoff.local_count, local)
            if exchange is None:
                global_stats, total_count = self._data_parallel_master([(0, message)])[0][1]
            else:
                global_stats, total_count = exchange(message)
            if isinstance(total_count, torch.Tensor):
                total_count = total_count.to(input.device)  # a device-to-device copy at most, no host sync
            handoff.total_count = total_count
            stats = global_stats.detach()
            handoff.mean = stats[0]
            handoff.invstd = torch.rsqrt(stats[1].clamp_min(self.eps) if clamp else stats[1] + self.eps)
            handoff.weight = self.weight.detach().to(stats.dtype) if self.weight is not None else torch.ones_like(stats[0])
            output = Normalize.apply(input, global_stats, self.weight, self.bias, handoff, self.eps, clamp)
        self._update_running_stats(global_stats[0], global_stats[1], total_count, average_factor, running_mean,
                                   running_var)
        return output

    @staticmethod
    def _update_running_stats(mean: torch.Tensor, var: torch.Tensor, total_count: int | torch.Tensor,
                              average_factor: float, running_mean: torch.Tensor | None,
                              running_var: torch.Tensor | None) -> None:
        """Running statistics, in place, from the global mean and biased variance over total_count values."""
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                mean, var = mean.detach(), var.detach()
                unbiased = var * (total_count / (total_count - 1))
                running_mean.mul_(1 - average_factor).add_(mean.to(running_mean.dtype), alpha=average_factor)
                running_var.mul_(1 - average_factor).add_(unbiased.to(running_var.dtype), alpha=average_factor)

    def _data_parallel_master(self, intermediates: list[tuple[int, StatsMessage]]) -> list[tuple[int, Any]]:
        """Merge every replica's statistics (runs once per step, in the master replica's thread)."""
        meta = CombineMeta(group=self._distributed_group(), label=(self._sync_key, self._exchange_calls))
        counts = tuple(message.count for _, message in intermediates)
        outputs = CombineStats.apply(meta, counts, *(message.stats for _, message in intermediates))
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        if meta.label_sums is not None:
            self._check_labels(meta.label_sums, meta.group, meta.label)
        # More than one value here means more than one in total: only a process holding at most one
        # value per channel needs the global count (a host sync, in this rare case only).
        if meta.local_count <= 1 and (meta.group is None or int(round(float(meta.total_count))) <= 1):
            total = meta.total_count if meta.group is None else int(round(float(meta.total_count)))
            raise self._too_few_values(total, len(intermediates), meta.group is not None)
        return [(copy_id, (stats, meta.total_count)) for (copy_id, _), stats in zip(intermediates, outputs)]

    @staticmethod
    def _too_few_values(total: int, replicas: int, distributed: bool) -> ValueError:
        """The error of a training forward with at most one value per channel over the whole reduction."""
        return ValueError(f"Expected more than 1 value per channel when training, got {total} in total over "
                          f"{replicas} replica(s)" + (" and all processes" if distributed else ""))

    # --- divergence across processes: every process checks every process's label ------------------
    def _check_labels(self, label_sums: torch.Tensor, group, label: tuple[int, int]) -> None:
        """Raise SyncDivergenceError if the processes of `group` called different layers at this exchange
        (`label_sums`: the group's sums of divergence.label_values; `label`: this process's (key, call)):
        at once where reading the sums costs nothing (CPU), else at this layer's next synchronized call,
        from an asynchronous copy, so that the forward never waits for the device."""
        own = (*label, dist.get_rank(group), dist.get_world_size(group))
        if not functions.reads_stall_the_device(label_sums):
            self._check_label_sums(label_sums.tolist(), group, own)
            return
        host = label_sums.to("cpu", non_blocking=True, copy=True)
        event = None
        if label_sums.is_cuda:
            event = torch.cuda.Event()
            event.record()
        if len(self._pending_label_checks) < 8:  # unchecked ones beyond that wait for the earlier ones
            self._pending_label_checks.append((host, event, group, own))

    def _check_label_sums(self, sums: list[float], group, own: tuple[int, int, int, int]) -> None:
        check_label_sums(sums, *own, lambda: dist.get_process_group_ranks(group), self._describe_key)

    def _check_pending_labels(self) -> None:
        # DataParallel replicas share this list (a shallow copy of the layer): copy 0 alone reads and pops it,
        # or two threads could check one entry or pop another's (a race between [0] and pop(0))
        if self._is_parallel and self._parallel_id != 0:
            return
        while self._pending_label_checks:
            host, event, group, own = self._pending_label_checks[0]
            if event is not None and not event.query():
                return
            self._pending_label_checks.pop(0)
            self._check_label_sums(host.tolist(), group, own)


class SynchronizedBatchNorm1d(_SynchronizedBatchNorm):
    """BatchNorm1d over (N, C) or (N, C, L) input, statistics synchronized across replicas/processes."""

    _accepted_dims = (2, 3)
    _shape_hint = "(N, {C}) or (N, {C}, L)"


class SynchronizedBatchNorm2d(_SynchronizedBatchNorm):
    """BatchNorm2d over (N, C, H, W) input, statistics synchronized across replicas/processes."""

    _accepted_dims = (4,)
    _shape_hint = "(N, {C}, H, W)"


class SynchronizedBatchNorm3d(_SynchronizedBatchNorm):
    """BatchNorm3d over (N, C, D, H, W) input, statistics synchronized across replicas/processes."""

    _accepted_dims = (5,)
    _shape_hint = "(N, {C}, D, H, W)"
