"""convert_model / revert_model: swap nn.BatchNorm*d and SynchronizedBatchNorm*d in a module tree.

The swapped layers share the original parameters and buffers (the same tensors), so a converted
model trains the weights it was given, and a reverted one exports the trained weights as they are.
"""
from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .batchnorm import SynchronizedBatchNorm1d, SynchronizedBatchNorm2d, SynchronizedBatchNorm3d
from .replicate import DataParallelWithCallback

__all__ = ["adopt_norm_state", "convert_model", "revert_model"]

_TO_SYNC = {nn.BatchNorm1d: SynchronizedBatchNorm1d, nn.BatchNorm2d: SynchronizedBatchNorm2d,
            nn.BatchNorm3d: SynchronizedBatchNorm3d}
_TO_PLAIN = {sync: plain for plain, sync in _TO_SYNC.items()}


def adopt_norm_state(new: nn.Module, old: nn.Module) -> nn.Module:
    """Make the norm layer `new` stand in for `old`: the same parameter and buffer tensors (weight, bias,
    running statistics, counter), `old`'s train/eval mode and its forward hooks. Where `new` keeps a
    tensor as a buffer that `old` has as a parameter (a frozen layer), the values are copied instead."""
    for name in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
        if not hasattr(old, name) or not hasattr(new, name):
            continue  # e.g. a frozen layer without a batch counter
        if name in new._buffers and name in old._parameters:
            getattr(new, name).copy_(getattr(old, name).detach())
        else:
            setattr(new, name, getattr(old, name))
    new.train(old.training)
    for hook_dict in ("_forward_hooks", "_forward_pre_hooks"):
        getattr(new, hook_dict).update(getattr(old, hook_dict))
    return new


def _swap_norm(module: _BatchNorm, new_class: type) -> _BatchNorm:
    """A `new_class` layer sharing `module`'s parameters and buffers (same tensors, same flags)."""
    new = new_class(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
    return adopt_norm_state(new, module)


def _replace(module: nn.Module, mapping: dict[type, type]) -> nn.Module:
    new_class = mapping.get(type(module))
    if new_class is not None:
        return _swap_norm(module, new_class)
    for name, child in module.named_children():
        replacement = _replace(child, mapping)
        if replacement is not child:
            setattr(module, name, replacement)
    return module


def _data_parallel_options(module: nn.DataParallel) -> dict:
    # Without an accelerator DataParallel stores no output_device; pass on what it has.
    return {"device_ids": module.device_ids, "output_device": getattr(module, "output_device", None),
            "dim": getattr(module, "dim", 0)}


def convert_model(module: nn.Module) -> nn.Module:
    """Replace every nn.BatchNorm1d/2d/3d by its synchronized twin, sharing parameters and buffers.

    An `nn.DataParallel` becomes a `DataParallelWithCallback` with the same device_ids, output_device
    and dim. Returns the converted module (the input module is modified in place where possible).
    """
    if isinstance(module, nn.DataParallel):
        inner = _replace(module.module, _TO_SYNC)
        return DataParallelWithCallback(inner, **_data_parallel_options(module))
    return _replace(module, _TO_SYNC)


def revert_model(module: nn.Module) -> nn.Module:
    """Replace every SynchronizedBatchNorm*d by nn.BatchNorm*d (for export), sharing tensors.

    A `DataParallelWithCallback` becomes a plain `nn.DataParallel` over the reverted module.
    """
    if isinstance(module, DataParallelWithCallback):
        inner = _replace(module.module, _TO_PLAIN)
        return nn.DataParallel(inner, **_data_parallel_options(module))
    return _replace(module, _TO_PLAIN)
