"""build_model(model_cfg, num_classes), optimizer parameter groups and fine-tuning weight loading.

Normalization (`model.norm`):
- `syncbn`: SynchronizedBatchNorm2d everywhere (one device: plain F.batch_norm);
- `bn`: nn.BatchNorm2d everywhere (per-device statistics);
- `frozen_bn`: the backbone's BatchNorm layers become torchvision's FrozenBatchNorm2d (fixed pretrained
  statistics and affine parameters, nothing trainable); the randomly initialized head keeps
  SynchronizedBatchNorm2d, since frozen statistics only make sense for pretrained layers.

Key names: for `deeplabv3`, our state dict keys equal torchvision's DeepLabV3 keys (`backbone.*`,
`classifier.*`, `aux_classifier.*`) without any mapping, so `deeplabv3_resnet50/101(...).state_dict()`
and `deeplabv3_mobilenet_v3_large(...).state_dict()` load directly (`load_segmentation_weights`).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

import torch
from torch import Tensor, nn
from torchvision.ops import FrozenBatchNorm2d

from model.backbones import BACKBONES, OUTPUT_STRIDES, build_backbone
from model.deeplab import DeepLab
from model.heads import DeepLabV3Head, DeepLabV3PlusHead, FCNHead, aspp_rates_for

logger = logging.getLogger(__name__)

NORMS = ("syncbn", "bn", "frozen_bn")


def _build_deeplabv3_head(backbone: nn.Module, num_classes: int, rates: tuple[int, ...], channels: int,
                          norm_layer: Callable[[int], nn.Module]) -> nn.Module:
    return DeepLabV3Head(backbone.out_channels, num_classes, atrous_rates=rates, channels=channels,
                         norm_layer=norm_layer)


def _build_deeplabv3plus_head(backbone: nn.Module, num_classes: int, rates: tuple[int, ...], channels: int,
                              norm_layer: Callable[[int], nn.Module]) -> nn.Module:
    return DeepLabV3PlusHead(
        backbone.out_channels, num_classes, low_level_channels=backbone.low_level_channels, atrous_rates=rates,
        channels=channels, norm_layer=norm_layer,
    )


HEADS = {"deeplabv3": _build_deeplabv3_head, "deeplabv3plus": _build_deeplabv3plus_head}


def _norm_layers(norm: str) -> tuple[Callable[..., nn.Module], Callable[..., nn.Module]]:
    """(backbone norm layer, head norm layer) for `model.norm`."""
    if norm == "bn":
        return nn.BatchNorm2d, nn.BatchNorm2d
    if norm not in NORMS:
        raise ValueError(f"model.norm={norm!r} is not one of {', '.join(NORMS)}")
    from model.sync_batchnorm import SynchronizedBatchNorm2d

    if norm == "frozen_bn":
        return FrozenBatchNorm2d, SynchronizedBatchNorm2d
    return SynchronizedBatchNorm2d, SynchronizedBatchNorm2d


def build_model(model_cfg: Any, num_classes: int) -> DeepLab:
    """A DeepLab network for `model_cfg` (engine.config.ModelConfig) predicting `num_classes` classes.

    forward(x: normalized float N x 3 x H x W) -> {"out": logits N x num_classes x H x W} plus "aux" when
    model_cfg.aux_loss. Pretrained backbone weights are loaded here (model_cfg.pretrained_backbone);
    model_cfg.init_checkpoint is left to the trainer (load_segmentation_weights). Raises ValueError for
    invalid settings, FileNotFoundError for missing weight files.
    """
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"num_classes={num_classes!r} must be a positive integer")
    arch = model_cfg.arch
    if arch not in HEADS:
        raise ValueError(f"model.arch={arch!r} is not one of {', '.join(HEADS)}")
    if model_cfg.backbone not in BACKBONES:
        raise ValueError(f"model.backbone={model_cfg.backbone!r} is not one of {', '.join(BACKBONES)}")
    if model_cfg.output_stride not in OUTPUT_STRIDES:
        raise ValueError(
            f"model.output_stride={model_cfg.output_stride} is not one of {', '.join(map(str, OUTPUT_STRIDES))}"
        )
    channels = int(model_cfg.head_channels)
    if channels < 1:
        raise ValueError(f"model.head_channels={channels} must be > 0")
    backbone_norm, head_norm = _norm_layers(model_cfg.norm)
    rates = aspp_rates_for(model_cfg.output_stride, tuple(model_cfg.aspp_rates))
    backbone = build_backbone(
        model_cfg.backbone,
        output_stride=model_cfg.output_stride,
        norm_layer=backbone_norm,
        pretrained=str(model_cfg.pretrained_backbone or "none"),
    )
    classifier = HEADS[arch](backbone, num_classes, rates, channels, head_norm)
    aux_classifier = FCNHead(backbone.aux_channels, num_classes, norm_layer=head_norm) if model_cfg.aux_loss else None
    channels_last = bool(model_cfg.channels_last)
    model = DeepLab(backbone, classifier, aux_classifier=aux_classifier, channels_last=channels_last)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    logger.info(
        "built %s/%s OS%d norm=%s aux=%s: %.2fM parameters",
        arch, model_cfg.backbone, model_cfg.output_stride, model_cfg.norm, bool(model_cfg.aux_loss),
        sum(p.numel() for p in model.parameters()) / 1e6,
    )
    return model


def _unwrap(model: nn.Module) -> nn.Module:
    while isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        model = model.module
    return model


def build_param_groups(model: nn.Module, *, lr: float, head_lr_mult: float, weight_decay: float) -> list[dict]:
    """Optimizer parameter groups: "backbone" at `lr`, "head" (everything else) at `lr * head_lr_mult`.

    Each group: {"name", "params", "lr", "weight_decay"}. Only parameters with requires_grad are included;
    a group without any is left out. DataParallel / DistributedDataParallel wrappers are looked through.
    """
    model = _unwrap(model)
    backbone = getattr(model, "backbone", None)
    if backbone is None:
        raise ValueError(f"build_param_groups expects a model with a 'backbone' attribute, got {type(model).__name__}")
    backbone_ids = {id(p) for p in backbone.parameters()}
    groups = {"backbone": [], "head": []}
    for parameter in model.parameters():
        if parameter.requires_grad:
            groups["backbone" if id(parameter) in backbone_ids else "head"].append(parameter)
    rates = {"backbone": lr, "head": lr * head_lr_mult}
    return [
        {"name": name, "params": params, "lr": rates[name], "weight_decay": weight_decay}
        for name, params in groups.items()
        if params
    ]


def _logits_keys(model: nn.Module) -> set[str]:
    """State-dict keys of the last conv of `classifier` and `aux_classifier` (their outputs are classes)."""
    keys = set()
    for head_name in ("classifier", "aux_classifier"):
        head = getattr(model, head_name, None)
        if head is None:
            continue
        convs = [name for name, module in head.named_modules() if isinstance(module, nn.Conv2d)]
        if convs:
            keys |= {f"{head_name}.{convs[-1]}.weight", f"{head_name}.{convs[-1]}.bias"}
    return keys


def load_segmentation_weights(model: nn.Module, state_dict: Mapping[str, Tensor]) -> list[str]:
    """Load a segmentation state dict (ours or torchvision's DeepLabV3) for fine-tuning; return skipped keys.

    Keys of the final classifier convs (`classifier` and `aux_classifier`) whose shapes differ, i.e. the
    number of classes changed, are skipped (logged, returned sorted); those layers keep their fresh
    initialization. Any other shape mismatch, missing key or unexpected key raises ValueError. A
    `module.` prefix on every key (a DataParallel state dict) is stripped.
    """
    model = _unwrap(model)
    if state_dict and all(key.startswith("module.") for key in state_dict):
        state_dict = {key[len("module."):]: value for key, value in state_dict.items()}
    own = model.state_dict()
    logits_keys = _logits_keys(model)
    skipped, mismatched = [], []
    for key, value in state_dict.items():
        if key in own and own[key].shape != value.shape:
            (skipped if key in logits_keys else mismatched).append(key)
    if mismatched:
        details = "; ".join(f"{k}: checkpoint {tuple(state_dict[k].shape)} vs model {tuple(own[k].shape)}"
                            for k in mismatched[:10])
        raise ValueError(
            f"segmentation weights do not fit the model ({len(mismatched)} shape mismatches outside the "
            f"classifier; different backbone or head width?): {details}"
        )
    filtered = {key: value for key, value in state_dict.items() if key not in skipped}
    result = model.load_state_dict(filtered, strict=False)
    missing = [key for key in result.missing_keys if key not in skipped]
    if missing or result.unexpected_keys:
        raise ValueError(
            "segmentation weights do not match the model (different architecture, backbone or aux_loss?): "
            f"missing keys ({len(missing)}): {', '.join(missing[:10])}; "
            f"unexpected keys ({len(result.unexpected_keys)}): {', '.join(result.unexpected_keys[:10])}"
        )
    if skipped:
        logger.info("fine-tuning: kept the fresh classifier for %s (number of classes differs)", ", ".join(skipped))
    return sorted(skipped)
