"""Synchronized BatchNorm for DataParallel replicas and torch.distributed processes.

Standalone: depends on torch and the standard library only.
"""
from .batchnorm import SynchronizedBatchNorm1d, SynchronizedBatchNorm2d, SynchronizedBatchNorm3d
from .conversion import adopt_norm_state, convert_model, revert_model
from .comm import FutureResult, SlavePipe, SyncAbortedError, SyncMaster
from .replicate import (
    CallbackContext,
    DataParallelWithCallback,
    execute_replication_callbacks,
    patch_replication_callback,
)

__all__ = [
    "SynchronizedBatchNorm1d",
    "SynchronizedBatchNorm2d",
    "SynchronizedBatchNorm3d",
    "adopt_norm_state",
    "convert_model",
    "revert_model",
    "FutureResult",
    "SlavePipe",
    "SyncMaster",
    "SyncAbortedError",
    "CallbackContext",
    "DataParallelWithCallback",
    "execute_replication_callbacks",
    "patch_replication_callback",
]
