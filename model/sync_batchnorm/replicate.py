"""DataParallel with a replication callback, which synchronized layers use to find each other.

After `DataParallel.replicate` makes the per-device copies, `execute_replication_callbacks` calls
`module.__data_parallel_replicate__(ctx, copy_id)` on every sub-module that defines it; copies of the
same sub-module share one `CallbackContext`, copy 0 first. Replicas may also be made some other way
(e.g. `copy.deepcopy` on CPU in tests): only the callback protocol matters.

`DataParallelWithCallback` also guards `parallel_apply`: a replica whose forward raises aborts the
synchronization rounds of every synchronized layer, so the other replicas raise instead of waiting, and a
replica whose forward ends while the others wait at an exchange it never made raises SyncDivergenceError
in all of them (divergence.py).
"""
from __future__ import annotations

import functools
import itertools
import weakref
from typing import Any, Sequence

import torch
from torch import nn
from torch.nn.parallel import DataParallel
from torch.nn.parallel.parallel_apply import parallel_apply

from .divergence import ExchangeLedger

__all__ = [
    "CallbackContext",
    "execute_replication_callbacks",
    "DataParallelWithCallback",
    "patch_replication_callback",
    "abort_synchronization",
    "AbortingReplica",
]


class CallbackContext:
    """Shared by the copies of one sub-module during one replication (attributes set freely).

    Set here: `module_path` (the sub-module's path in the master copy) and `exchange_ledger` (one
    ExchangeLedger for the whole replication: the order of the synchronized layers' exchanges).
    """


def execute_replication_callbacks(modules: Sequence[nn.Module]) -> ExchangeLedger:
    """Run `__data_parallel_replicate__(ctx, copy_id)` on each sub-module of each replica.

    `modules[0]` is the master copy. All replicas must have the same module structure. Returns the round's
    ExchangeLedger (also kept on the master copy for `DataParallelWithCallback.parallel_apply`).
    """
    master_copy = modules[0]
    ledger = ExchangeLedger(_aborter(weakref.ref(master_copy)))
    contexts = []
    for path, _ in master_copy.named_modules():
        context = CallbackContext()
        context.module_path, context.exchange_ledger = path, ledger
        contexts.append(context)
    master_copy._sync_exchange_ledger = ledger
    for copy_id, replica in enumerate(modules):
        sub_modules = list(replica.modules())
        if len(sub_modules) != len(contexts):
            raise ValueError(
                f"replica {copy_id} has {len(sub_modules)} sub-modules but the master copy has "
                f"{len(contexts)}: replicas must share one structure"
            )
        for context, sub_module in zip(contexts, sub_modules):
            callback = getattr(sub_module, "__data_parallel_replicate__", None)
            if callback is not None:
                callback(context, copy_id)
    return ledger


def _aborter(master_copy: weakref.ref) -> Any:
    # a weak reference: replicas hold the ledger, and a cycle through it would keep their (device) tensors
    # alive until the garbage collector runs
    def abort(cause: BaseException) -> None:
        master = master_copy()
        if master is not None:
            abort_synchronization(master, cause)
    return abort


def abort_synchronization(master_copy: nn.Module, cause: BaseException) -> None:
    """Abort the current round of every synchronized layer of `master_copy` (copy 0)."""
    for sub_module in master_copy.modules():
        master = getattr(sub_module, "_sync_master", None)
        if master is not None:
            master.abort(cause)


def _autocast_state(device_type: str) -> tuple[str, bool, torch.dtype, bool]:
    """(device type, enabled, dtype, cache enabled) of this thread's autocast for `device_type`."""
    return (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type),
            torch.is_autocast_cache_enabled())


class AbortingReplica:
    """Callable wrapper around a replica: if its forward raises, abort every sync round first.

    `autocast`: the caller's autocast state (`_autocast_state`), re-entered in the replica's thread.
    Autocast is thread-local, and torch's parallel_apply re-enters it in each thread with `enabled=` but
    not the dtype, so bf16 autocast silently became the device's default, fp16, in every replica.
    `copy_id`: the replica's number; with the round's `ledger`, a forward that ends while other replicas
    wait at an exchange this one never made raises SyncDivergenceError in all of them.
    """

    def __init__(self, replica: nn.Module, master_copy: nn.Module, *,
                 autocast: tuple[str, bool, torch.dtype, bool] | None = None, copy_id: int = 0,
                 ledger: ExchangeLedger | None = None) -> None:
        self.replica = replica
        self.master_copy = master_copy
        self.autocast = autocast
        self.copy_id = copy_id
        self.ledger = ledger

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            if self.autocast is not None and self.autocast[1]:
                device_type, _, dtype, cache_enabled = self.autocast
                with torch.autocast(device_type, dtype=dtype, cache_enabled=cache_enabled):
                    output = self.replica(*args, **kwargs)
            else:
                output = self.replica(*args, **kwargs)
            if self.ledger is not None:
                self.ledger.finish(self.copy_id)
            return output
        except BaseException as error:
            abort_synchronization(self.master_copy, error)
            raise


def _device_type(module: nn.Module) -> str:
    tensor = next(itertools.chain(module.parameters(), module.buffers()), None)
    return tensor.device.type if tensor is not None else "cuda"


def _guarded_parallel_apply(replicas: Sequence[nn.Module], inputs, kwargs, device_ids) -> list:
    state = _autocast_state(_device_type(replicas[0])) if replicas else None
    ledger = getattr(replicas[0], "_sync_exchange_ledger", None) if replicas else None
    guarded = [AbortingReplica(replica, replicas[0], autocast=state, copy_id=copy_id, ledger=ledger)
               for copy_id, replica in enumerate(replicas)]
    return parallel_apply(guarded, inputs, kwargs, device_ids)


class DataParallelWithCallback(DataParallel):
    """`nn.DataParallel` that runs the replication callbacks after every `replicate`.

    Use it exactly like DataParallel; synchronized BatchNorm layers inside then reduce their
    statistics over all replicas.
    """

    def replicate(self, module: nn.Module, device_ids: Sequence[int]) -> list[nn.Module]:
        modules = super().replicate(module, device_ids)
        execute_replication_callbacks(modules)
        return modules

    def parallel_apply(self, replicas, inputs, kwargs) -> list:
        return _guarded_parallel_apply(replicas, inputs, kwargs, self.device_ids[: len(replicas)])


def patch_replication_callback(data_parallel: DataParallel) -> None:
    """Give an existing `nn.DataParallel` instance the behaviour of DataParallelWithCallback.

    ```
    model = nn.DataParallel(model, device_ids=[0, 1])
    patch_replication_callback(model)
    ```
    """
    if not isinstance(data_parallel, DataParallel):
        raise ValueError(f"patch_replication_callback expects an nn.DataParallel, got {type(data_parallel).__name__}")
    original_replicate = data_parallel.replicate

    @functools.wraps(original_replicate)
    def replicate_with_callbacks(module, device_ids):
        modules = original_replicate(module, device_ids)
        execute_replication_callbacks(modules)
        return modules

    def guarded_parallel_apply(replicas, inputs, kwargs):
        return _guarded_parallel_apply(replicas, inputs, kwargs, data_parallel.device_ids[: len(replicas)])

    data_parallel.replicate = replicate_with_callbacks
    data_parallel.parallel_apply = guarded_parallel_apply

