"""The one place where `model.norm` becomes normalization layers (detectron2's get_norm is the model).

`norm_layers(kind)` returns (backbone norm, head norm); each is a callable
`(num_channels, *, eps=1e-5, momentum=0.1) -> nn.Module`, so a backbone whose pretrained recipe uses
other BatchNorm settings (MobileNetV3: eps 1e-3, momentum 0.01) passes them the same way for every kind:

- `syncbn`: SynchronizedBatchNorm2d everywhere (one device: plain F.batch_norm);
- `bn`: nn.BatchNorm2d everywhere (per-device statistics);
- `frozen_bn`: torchvision's FrozenBatchNorm2d in the backbone (fixed pretrained statistics and affine
  parameters; momentum does not apply), SynchronizedBatchNorm2d in the randomly initialized head, since
  frozen statistics only make sense for pretrained layers.
"""
from __future__ import annotations

from typing import Callable, Protocol

from torch import nn
from torchvision.ops import FrozenBatchNorm2d

from model.sync_batchnorm import SynchronizedBatchNorm2d


class NormLayer(Protocol):
    def __call__(self, num_channels: int, *, eps: float = 1e-5, momentum: float = 0.1) -> nn.Module: ...


def _batch_norm(num_channels: int, *, eps: float = 1e-5, momentum: float = 0.1) -> nn.Module:
    return nn.BatchNorm2d(num_channels, eps=eps, momentum=momentum)


def _synchronized(num_channels: int, *, eps: float = 1e-5, momentum: float = 0.1) -> nn.Module:
    return SynchronizedBatchNorm2d(num_channels, eps=eps, momentum=momentum)


def _frozen(num_channels: int, *, eps: float = 1e-5, momentum: float = 0.1) -> nn.Module:
    del momentum  # frozen statistics are never updated
    return FrozenBatchNorm2d(num_channels, eps=eps)


# kind -> (backbone norm, head norm); the kinds are engine.config's `model.norm` choices
_LAYERS: dict[str, tuple[Callable[..., nn.Module], Callable[..., nn.Module]]] = {
    "syncbn": (_synchronized, _synchronized),
    "bn": (_batch_norm, _batch_norm),
    "frozen_bn": (_frozen, _synchronized),
}


def norm_layers(kind: str) -> tuple[NormLayer, NormLayer]:
    """(backbone norm layer, head norm layer) for `model.norm` = `kind` (validated by the config)."""
    return _LAYERS[kind]


def norm_kinds() -> tuple[str, ...]:
    """The kinds this factory builds (a test checks they equal the config's choices)."""
    return tuple(_LAYERS)


def synchronizes_statistics(kind: str) -> bool:
    """Whether a model built with `kind` has BatchNorm layers that reduce over devices and processes."""
    return any(layer is _synchronized for layer in _LAYERS[kind])
