"""The model's extension points: backbones (model.backbone), heads (model.arch) and norms (model.norm).

Each registry maps a config value to its builder, named by a "package.module:function" string (or the
callable itself, for a user's own entry), so this module imports no torch: the config schema and --help
read the names from here. The contracts (docs/extending.md):

- backbone: `build(name, *, output_stride, norm_layer) -> nn.Module` whose forward(x) returns
  {"low_level", "aux", "out"} feature maps and which has `low_level_channels`, `aux_channels`,
  `out_channels`; `imagenet_weights` names torchvision's weight enum for pretrained_backbone=imagenet.
  `timm:<name>` is a family: any timm encoder (syncseg.model.timm_encoder checks the name).
- head: `build(backbone, num_classes, rates, channels, norm_layer, *, dropout) -> nn.Module` mapping
  the backbone's feature dict to logits at the feature resolution.
- norm: a (backbone norm, head norm) pair of `(num_channels, *, eps, momentum) -> nn.Module` callables.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from syncseg.lazy_registry import Registry

TIMM_PREFIX = "timm:"  # model.backbone values with this prefix name a timm encoder


@dataclass(frozen=True)
class BackboneEntry:
    """A model.backbone value: its builder and, when torchvision has them, its ImageNet weights."""

    build: str | Callable[..., Any]
    imagenet_weights: str = ""  # a torchvision weight enum, e.g. "ResNet50_Weights.IMAGENET1K_V1"


BACKBONES: Registry[BackboneEntry] = Registry("model.backbone")
HEADS: Registry[str | Callable[..., Any]] = Registry("model.arch")
NORMS: Registry[str | Callable[..., Any]] = Registry("model.norm")


def register_backbone(name: str, build: str | Callable[..., Any], *, imagenet_weights: str = "") -> BackboneEntry:
    """Make `name` a valid model.backbone value built by `build` (the contract above)."""
    return BACKBONES.register(name, BackboneEntry(build, imagenet_weights))


_RESNET = "syncseg.model.backbones:build_resnet"
# torchvision's V1 weights: the classic recipes, the ones torchvision's own DeepLabV3 builders use
register_backbone("resnet18", _RESNET, imagenet_weights="ResNet18_Weights.IMAGENET1K_V1")
register_backbone("resnet34", _RESNET, imagenet_weights="ResNet34_Weights.IMAGENET1K_V1")
register_backbone("resnet50", _RESNET, imagenet_weights="ResNet50_Weights.IMAGENET1K_V1")
register_backbone("resnet101", _RESNET, imagenet_weights="ResNet101_Weights.IMAGENET1K_V1")
register_backbone("mobilenet_v2", "syncseg.model.backbones:build_mobilenet_v2",
                  imagenet_weights="MobileNet_V2_Weights.IMAGENET1K_V1")
register_backbone("mobilenet_v3_large", "syncseg.model.backbones:build_mobilenet_v3_large",
                  imagenet_weights="MobileNet_V3_Large_Weights.IMAGENET1K_V1")
BACKBONES.register_family(TIMM_PREFIX, BackboneEntry("syncseg.model.timm_encoder:build_timm_backbone"),
                          meaning="a timm encoder")

HEADS.register("deeplabv3", "syncseg.model.builder:build_deeplabv3_head")
HEADS.register("deeplabv3plus", "syncseg.model.builder:build_deeplabv3plus_head")

NORMS.register("syncbn", "syncseg.model.norm:SYNCBN_LAYERS")
NORMS.register("bn", "syncseg.model.norm:BN_LAYERS")
NORMS.register("frozen_bn", "syncseg.model.norm:FROZEN_BN_LAYERS")
