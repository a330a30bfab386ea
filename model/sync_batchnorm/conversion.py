"""convert_model / revert_model: swap nn.BatchNorm*d and SynchronizedBatchNorm*d in a module tree; name and
group the synchronized layers of a tree.

The swapped layers share the original parameters and buffers (the same tensors), so a converted
model trains the weights it was given, and a reverted one exports the trained weights as they are.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .batchnorm import SynchronizedBatchNorm1d, SynchronizedBatchNorm2d, SynchronizedBatchNorm3d
from .batchnorm import _SynchronizedBatchNorm
from .replicate import DataParallelWithCallback

__all__ = ["adopt_norm_state", "convert_model", "revert_model", "patch_sync_batchnorm", "synchronized_layers",
           "name_synchronized_layers"]

_TO_SYNC = {nn.BatchNorm1d: SynchronizedBatchNorm1d, nn.BatchNorm2d: SynchronizedBatchNorm2d,
            nn.BatchNorm3d: SynchronizedBatchNorm3d}
_TO_PLAIN = {sync: plain for plain, sync in _TO_SYNC.items()}
_NO_GROUP = object()  # convert_model's default: leave each layer's process group as it is


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


def synchronized_layers(module: nn.Module) -> Iterator[tuple[str, _SynchronizedBatchNorm]]:
    """(path, layer) for every SynchronizedBatchNorm*d in `module` (itself included), paths as named_modules."""
    for path, sub_module in module.named_modules():
        if isinstance(sub_module, _SynchronizedBatchNorm):
            yield path, sub_module


def name_synchronized_layers(module: nn.Module) -> nn.Module:
    """Name every synchronized layer of `module` by its path in it (`layer.sync_name`), which a divergence
    error then names; every layer also learns its siblings' names, so a process can name a layer that
    another process called. convert_model and DataParallelWithCallback do this; call it yourself for a model
    built with the layers directly and trained with torchrun (unnamed layers are told by class and width).
    Returns `module`."""
    layers = list(synchronized_layers(module))
    names: dict[int, str] = {}
    for path, layer in layers:
        layer.sync_name = path or type(layer).__name__
        names[layer._sync_key] = layer.sync_name
    for _, layer in layers:
        layer.sync_names = names
    return module


def convert_model(module: nn.Module, process_group: Any = _NO_GROUP) -> nn.Module:
    """Replace every nn.BatchNorm1d/2d/3d by its synchronized twin, sharing parameters and buffers, and name
    every synchronized layer by its path (name_synchronized_layers).

    `process_group`: the torch.distributed group every synchronized layer of the result reduces over
    (None: the whole world); left as each layer has it when not given.
    An `nn.DataParallel` becomes a `DataParallelWithCallback` with the same device_ids, output_device
    and dim. Returns the converted module (the input module is modified in place where possible).
    """
    if isinstance(module, nn.DataParallel):
        return DataParallelWithCallback(convert_model(module.module, process_group), **_data_parallel_options(module))
    converted = name_synchronized_layers(_replace(module, _TO_SYNC))
    if process_group is not _NO_GROUP:
        for _, layer in synchronized_layers(converted):
            layer.process_group = process_group
    return converted


def revert_model(module: nn.Module) -> nn.Module:
    """Replace every SynchronizedBatchNorm*d by nn.BatchNorm*d (for export), sharing tensors.

    A `DataParallelWithCallback` becomes a plain `nn.DataParallel` over the reverted module.
    """
    if isinstance(module, DataParallelWithCallback):
        inner = _replace(module.module, _TO_PLAIN)
        return nn.DataParallel(inner, **_data_parallel_options(module))
    return _replace(module, _TO_PLAIN)


@contextlib.contextmanager
def patch_sync_batchnorm() -> Iterator[None]:
    """Within the block, `nn.BatchNorm1d/2d/3d` are the synchronized classes (models built there get them);
    restored on exit, also after an exception. As in the original package."""
    saved = nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d = (SynchronizedBatchNorm1d, SynchronizedBatchNorm2d,
                                                      SynchronizedBatchNorm3d)
    try:
        yield
    finally:
        nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d = saved
