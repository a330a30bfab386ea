"""The one place where `model.norm` becomes normalization layers (detectron2's get_norm is the model).

`norm_layers(kind)` returns (backbone norm, head norm); each is a callable
`(num_channels, *, eps=1e-5, momentum=0.1) -> nn.Module`, so a backbone whose pretrained recipe uses
other BatchNorm settings (MobileNetV3: eps 1e-3, momentum 0.01) passes them the same way for every kind:

- `syncbn`: SynchronizedBatchNorm2d everywhere (one device: plain F.batch_norm);
- `bn`: nn.BatchNorm2d everywhere (per-device statistics);
- `frozen_bn`: torchvision's FrozenBatchNorm2d in the backbone (fixed pretrained statistics and affine
  parameters; momentum does not apply), SynchronizedBatchNorm2d in the randomly initialized head, since
  frozen statistics only make sense for pretrained layers.

A network built elsewhere (a timm encoder) gets the backbone norm with `adopt_batch_norms`: each of its
BatchNorm2d layers is replaced by that norm with the same eps, momentum and tensors; timm's
BatchNormAct2d (a BatchNorm2d that also applies its `drop` and `act`) becomes the norm's `...Act2d`
twin below, with the same state-dict keys.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch import nn
from torchvision.ops import FrozenBatchNorm2d

from syncseg.lazy_registry import load_object
from syncseg.model.registry import NORMS
from syncseg.model.sync_batchnorm import SynchronizedBatchNorm2d, adopt_norm_state


class NormLayer(Protocol):
    def __call__(self, num_channels: int, *, eps: float = 1e-5, momentum: float = 0.1) -> nn.Module: ...


def _batch_norm(num_channels: int, *, eps: float = 1e-5, momentum: float = 0.1) -> nn.Module:
    return nn.BatchNorm2d(num_channels, eps=eps, momentum=momentum)


def _synchronized(num_channels: int, *, eps: float = 1e-5, momentum: float = 0.1) -> nn.Module:
    return SynchronizedBatchNorm2d(num_channels, eps=eps, momentum=momentum)


def _frozen(num_channels: int, *, eps: float = 1e-5, momentum: float = 0.1) -> nn.Module:
    del momentum  # frozen statistics are never updated
    return FrozenBatchNorm2d(num_channels, eps=eps)


# (backbone norm, head norm) of each model.norm kind (syncseg.model.registry.NORMS names them)
SYNCBN_LAYERS = (_synchronized, _synchronized)
BN_LAYERS = (_batch_norm, _batch_norm)
FROZEN_BN_LAYERS = (_frozen, _synchronized)


def norm_layers(kind: str) -> tuple[NormLayer, NormLayer]:
    """(backbone norm layer, head norm layer) for `model.norm` = `kind` (validated by the config)."""
    return load_object(NORMS.get(kind))


def synchronizes_statistics(kind: str) -> bool:
    """Whether a model built with `kind` has BatchNorm layers that reduce over devices and processes."""
    return any(layer is _synchronized for layer in norm_layers(kind))


class _ThenDropAndActivation:
    """Mixin: the norm, then `self.drop` and `self.act` (timm's BatchNormAct2d order)."""

    drop: nn.Module
    act: nn.Module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.drop(super().forward(x)))  # type: ignore[misc]


class SynchronizedBatchNormAct2d(_ThenDropAndActivation, SynchronizedBatchNorm2d):
    """SynchronizedBatchNorm2d, then drop and act: what a timm BatchNormAct2d becomes under `syncbn`."""


class FrozenBatchNormAct2d(_ThenDropAndActivation, FrozenBatchNorm2d):
    """FrozenBatchNorm2d, then drop and act: what a timm BatchNormAct2d becomes under `frozen_bn`."""


def _synchronized_act(num_channels: int, *, eps: float, momentum: float) -> nn.Module:
    return SynchronizedBatchNormAct2d(num_channels, eps=eps, momentum=momentum)


def _frozen_act(num_channels: int, *, eps: float, momentum: float) -> nn.Module:
    del momentum  # frozen statistics are never updated
    return FrozenBatchNormAct2d(num_channels, eps=eps)


# backbone norm layer -> its twin that also applies timm's drop and act
_WITH_ACTIVATION = {_synchronized: _synchronized_act, _frozen: _frozen_act}


def _replacement(norm: nn.BatchNorm2d, layer: Callable[..., nn.Module]) -> nn.Module:
    assert norm.affine and norm.track_running_stats, f"unsupported BatchNorm2d settings in {norm!r}"
    momentum = 0.1 if norm.momentum is None else norm.momentum
    with_activation = hasattr(norm, "act") and hasattr(norm, "drop")
    if with_activation:
        new = _WITH_ACTIVATION[layer](norm.num_features, eps=norm.eps, momentum=momentum)
        new.drop, new.act = norm.drop, norm.act
    else:
        new = layer(norm.num_features, eps=norm.eps, momentum=momentum)
    return adopt_norm_state(new, norm)  # the swap convert_model does: same tensors, mode and hooks


def adopt_batch_norms(module: nn.Module, norm_layer: Callable[..., nn.Module]) -> nn.Module:
    """Give a network built elsewhere (a timm encoder) the backbone norm `norm_layer` of `norm_layers`:
    every nn.BatchNorm2d (subclasses included) is replaced, in place, keeping its eps, momentum and
    tensors. With `bn` (or nn.BatchNorm2d itself) the network already has it and is returned as is."""
    if norm_layer in (_batch_norm, nn.BatchNorm2d):
        return module
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d):
            setattr(module, name, _replacement(child, norm_layer))
        else:
            adopt_batch_norms(child, norm_layer)
    return module
