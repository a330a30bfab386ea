"""build_model(model_cfg, num_classes) and unwrap_model; matching a state dict to a model is model/weights.py's.

The settings come from a validated `model` config section (syncseg.engine.config.ModelConfig); nothing here
re-checks them. Normalization (`model.norm`) is chosen by model/norm.py.

Key names: for `deeplabv3`, our state dict keys equal torchvision's DeepLabV3 keys (`backbone.*`,
`classifier.*`, `aux_classifier.*`) without any mapping, so `deeplabv3_resnet50/101(...).state_dict()`
and `deeplabv3_mobilenet_v3_large(...).state_dict()` load directly (syncseg.model.weights.load_segmentation_weights).
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from syncseg.lazy_registry import load_object
from syncseg.model.backbones import build_backbone
from syncseg.model.deeplab import DeepLab
from syncseg.model.heads import DeepLabV3Head, DeepLabV3PlusHead, FCNHead, aspp_rates_for
from syncseg.model.input_channels import RGB
from syncseg.model.norm import NormLayer, norm_layers
from syncseg.model.registry import HEADS
from syncseg.model.sync_batchnorm import name_synchronized_layers

logger = logging.getLogger(__name__)


def build_deeplabv3_head(backbone: nn.Module, num_classes: int, rates: tuple[int, ...], channels: int,
                         norm_layer: NormLayer, *, dropout: float) -> nn.Module:
    """model.arch=deeplabv3: ASPP on the backbone's `out` features."""
    return DeepLabV3Head(backbone.out_channels, num_classes, atrous_rates=rates, channels=channels,
                         norm_layer=norm_layer, dropout=dropout)


def build_deeplabv3plus_head(backbone: nn.Module, num_classes: int, rates: tuple[int, ...], channels: int,
                             norm_layer: NormLayer, *, dropout: float) -> nn.Module:
    """model.arch=deeplabv3plus: ASPP plus the decoder that also reads the `low_level` features."""
    return DeepLabV3PlusHead(
        backbone.out_channels, num_classes, low_level_channels=backbone.low_level_channels, atrous_rates=rates,
        channels=channels, norm_layer=norm_layer, dropout=dropout,
    )


def build_model(model_cfg: Any, num_classes: int, *, in_channels: int = RGB,
                channels_last: bool | None = None) -> DeepLab:
    """A DeepLab network for `model_cfg` (syncseg.engine.config.ModelConfig) predicting `num_classes` classes from
    images of `in_channels` channels (data.in_channels; other than 3 adapts the backbone's first
    convolution: model/input_channels.py).

    forward(x: normalized float N x in_channels x H x W) -> {"out": logits N x num_classes x H x W} plus "aux" when
    model_cfg.aux_loss. Pretrained backbone weights are loaded here (model_cfg.pretrained_backbone);
    model_cfg.init_checkpoint is left to the trainer (syncseg.model.weights.load_segmentation_weights). Raises ValueError for
    a class count that is not a positive integer, FileNotFoundError for missing weight files.
    `channels_last`: the layout the caller resolved for model_cfg.channels_last (syncseg.engine.devices.
    resolve_channels_last: "auto" depends on device and precision); None takes model_cfg.channels_last as
    given, "auto" as the usual layout.
    """
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"num_classes={num_classes!r} must be a positive integer")
    arch = model_cfg.arch
    channels = int(model_cfg.head_channels)
    backbone_norm, head_norm = norm_layers(model_cfg.norm)
    rates = aspp_rates_for(model_cfg.output_stride, tuple(model_cfg.aspp_rates))
    backbone = build_backbone(
        model_cfg.backbone,
        output_stride=model_cfg.output_stride,
        norm_layer=backbone_norm,
        pretrained=str(model_cfg.pretrained_backbone or "none"),
        in_channels=in_channels,
    )
    build_head = load_object(HEADS.get(arch))
    classifier = build_head(backbone, num_classes, rates, channels, head_norm, dropout=model_cfg.aspp_dropout)
    aux_classifier = FCNHead(backbone.aux_channels, num_classes, norm_layer=head_norm) if model_cfg.aux_loss else None
    if channels_last is None:
        channels_last = model_cfg.channels_last is True
    model = DeepLab(backbone, classifier, aux_classifier=aux_classifier, channels_last=channels_last)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    # module paths ("backbone.layer1.0.bn1") that a divergence between processes names, the same on every rank
    name_synchronized_layers(model)
    logger.info(
        "built %s/%s OS%d norm=%s aux=%s: %.2fM parameters",
        arch, model_cfg.backbone, model_cfg.output_stride, model_cfg.norm, bool(model_cfg.aux_loss),
        sum(p.numel() for p in model.parameters()) / 1e6,
    )
    return model


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside DataParallel / DistributedDataParallel wrappers (nested ones too)."""
    while isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        model = model.module
    return model
