"""Synchronized BatchNorm for DataParallel replicas and torch.distributed processes.

The API of vacancy/Synchronized-BatchNorm-PyTorch (MIT), plus: torch.distributed processes and sync
groups, aborts instead of hangs, and errors that name the layers when replicas or processes diverge.
Standalone: depends on torch and the standard library only. README.md beside this file is its manual.
"""
from .batchnorm import (
    SynchronizedBatchNorm1d,
    SynchronizedBatchNorm2d,
    SynchronizedBatchNorm3d,
    get_sbn_eps_mode,
    set_sbn_eps_mode,
)
from .batchnorm_reimpl import BatchNorm2dReimpl
from .comm import DEFAULT_TIMEOUT, FutureResult, SlavePipe, SyncAbortedError, SyncMaster
from .conversion import (
    adopt_norm_state,
    convert_model,
    name_synchronized_layers,
    patch_sync_batchnorm,
    revert_model,
    synchronized_layers,
)
from .divergence import ExchangeLedger, SyncDivergenceError, check_gathered_labels, check_label_sums, layer_key
from .replicate import (
    AbortingReplica,
    CallbackContext,
    DataParallelWithCallback,
    abort_synchronization,
    execute_replication_callbacks,
    patch_replication_callback,
)

__version__ = "0.2.0"

__all__ = [
    "SynchronizedBatchNorm1d",
    "SynchronizedBatchNorm2d",
    "SynchronizedBatchNorm3d",
    "set_sbn_eps_mode",
    "get_sbn_eps_mode",
    "BatchNorm2dReimpl",
    "DEFAULT_TIMEOUT",
    "FutureResult",
    "SlavePipe",
    "SyncMaster",
    "SyncAbortedError",
    "adopt_norm_state",
    "convert_model",
    "revert_model",
    "patch_sync_batchnorm",
    "synchronized_layers",
    "name_synchronized_layers",
    "ExchangeLedger",
    "SyncDivergenceError",
    "check_gathered_labels",
    "check_label_sums",
    "layer_key",
    "AbortingReplica",
    "CallbackContext",
    "DataParallelWithCallback",
    "abort_synchronization",
    "execute_replication_callbacks",
    "patch_replication_callback",
]
