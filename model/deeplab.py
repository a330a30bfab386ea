"""DeepLab: backbone features -> head logits -> bilinear upsampling to the input resolution."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn
from torch.nn import functional as F


class DeepLab(nn.Module):
    """A DeepLabV3 / V3+ segmentation network.

    `forward(x)` takes a normalized float tensor N x 3 x H x W (cast to the model's dtype) and returns
    {"out": logits N x C x H x W} plus "aux" (same shape) when an aux classifier is present and `aux` is
    true (inference passes aux=False: it reads "out" only, and the aux head is ~4% of a ResNet-50
    DeepLabV3's forward); logits are upsampled bilinearly
    (align_corners=False) to the input's H x W, whatever the output stride. Attribute names
    (`backbone`, `classifier`, `aux_classifier`) equal torchvision's DeepLabV3, so for the deeplabv3
    architecture torchvision's state dict keys are ours unchanged. With `channels_last` the input is
    converted to the channels-last memory format (the module itself must be converted by the caller,
    as build_model does).
    """

    def __init__(
        self,
        backbone: nn.Module,
        classifier: nn.Module,
        *,
        aux_classifier: Optional[nn.Module] = None,
        channels_last: bool = False,
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.classifier = classifier
        self.aux_classifier = aux_classifier
        self.channels_last = channels_last

    def forward(self, x: Tensor, aux: bool = True) -> dict[str, Tensor]:
        if x.dim() != 4:
            raise ValueError(f"DeepLab expects a batch N x 3 x H x W, got a tensor of shape {tuple(x.shape)}")
        dtype = next(self.classifier.parameters()).dtype
        if x.dtype != dtype and x.is_floating_point():  # a float64 model (numeric checks) takes float32 inputs
            x = x.to(dtype)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        size = x.shape[-2:]
        features = self.backbone(x)
        result = {"out": F.interpolate(self.classifier(features), size=size, mode="bilinear", align_corners=False)}
        if self.aux_classifier is not None and aux:
            result["aux"] = F.interpolate(self.aux_classifier(features), size=size, mode="bilinear",
                                          align_corners=False)
        return result
