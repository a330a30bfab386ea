"""build_model(model_cfg, num_classes), optimizer parameter groups and fine-tuning weight loading.

The settings come from a validated `model` config section (engine.config.ModelConfig); nothing here
re-checks them. Normalization (`model.norm`) is chosen by model/norm.py.

Key names: for `deeplabv3`, our state dict keys equal torchvision's DeepLabV3 keys (`backbone.*`,
`classifier.*`, `aux_classifier.*`) without any mapping, so `deeplabv3_resnet50/101(...).state_dict()`
and `deeplabv3_mobilenet_v3_large(...).state_dict()` load directly (`load_segmentation_weights`).
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from model.backbones import build_backbone
from model.deeplab import DeepLab
from model.heads import DeepLabV3Head, DeepLabV3PlusHead, FCNHead, aspp_rates_for
from model.norm import NormLayer, norm_layers

logger = logging.getLogger(__name__)


def _build_deeplabv3_head(backbone: nn.Module, num_classes: int, rates: tuple[int, ...], channels: int,
                          norm_layer: NormLayer) -> nn.Module:
    return DeepLabV3Head(backbone.out_channels, num_classes, atrous_rates=rates, channels=channels,
                         norm_layer=norm_layer)


def _build_deeplabv3plus_head(backbone: nn.Module, num_classes: int, rates: tuple[int, ...], channels: int,
                              norm_layer: NormLayer) -> nn.Module:
    return DeepLabV3PlusHead(
        backbone.out_channels, num_classes, low_level_channels=backbone.low_level_channels, atrous_rates=rates,
        channels=channels, norm_layer=norm_layer,
    )


# model.arch -> head constructor; the names are engine.config's model.arch choices
HEADS = {"deeplabv3": _build_deeplabv3_head, "deeplabv3plus": _build_deeplabv3plus_head}


def build_model(model_cfg: Any, num_classes: int) -> DeepLab:
    """A DeepLab network for `model_cfg` (engine.config.ModelConfig) predicting `num_classes` classes.

    forward(x: normalized float N x 3 x H x W) -> {"out": logits N x num_classes x H x W} plus "aux" when
    model_cfg.aux_loss. Pretrained backbone weights are loaded here (model_cfg.pretrained_backbone);
    model_cfg.init_checkpoint is left to the trainer (load_segmentation_weights). Raises ValueError for
    a class count that is not a positive integer, FileNotFoundError for missing weight files.
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


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside DataParallel / DistributedDataParallel wrappers (nested ones too)."""
    while isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        model = model.module
    return model


def build_param_groups(model: nn.Module, *, lr: float, head_lr_mult: float, weight_decay: float) -> list[dict]:
    """Optimizer parameter groups: "backbone" at `lr`, "head" (everything else) at `lr * head_lr_mult`.

    Each group: {"name", "params", "lr", "weight_decay"}. Only parameters with requires_grad are included;
    a group without any is left out. DataParallel / DistributedDataParallel wrappers are looked through.
    """
    model = unwrap_model(model)
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
    model = unwrap_model(model)
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
