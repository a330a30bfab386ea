"""DeepLab heads: ASPP with image pooling, the DeepLabV3 head, the DeepLabV3+ decoder and the FCN aux head.

The normalization layer is injected (`norm_layer(num_channels) -> nn.Module`). Module layouts and names
of ASPP, the DeepLabV3 head and the FCN head equal torchvision's (`torchvision.models.segmentation`), so
torchvision DeepLabV3 state dicts load without renaming and give the same outputs.

Heads take the backbone's feature dict (`low_level`, `aux`, `out`, see model/backbones.py) and return
logits at the resolution of the features they use.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from syncseg.model.atrous import AtrousConv2d
from syncseg.model.norm import NormLayer

# The one place where output stride becomes ASPP rates (DeepLabV3 paper, section 4.1).
_ASPP_RATES = {32: (3, 6, 9), 16: (6, 12, 18), 8: (12, 24, 36)}


def aspp_rates_for(output_stride: int, rates: Sequence[int] = ()) -> tuple[int, ...]:
    """ASPP dilation rates: `rates` when given, else 6/12/18 at output stride 16, 12/24/36 at 8, 3/6/9 at 32."""
    if rates:
        return tuple(int(rate) for rate in rates)
    return _ASPP_RATES[output_stride]


class ASPPConv(nn.Sequential):
    """3x3 atrous conv (without the taps that read only padding where that pays: model/atrous.py), norm, ReLU."""

    def __init__(self, in_channels: int, out_channels: int, *, dilation: int, norm_layer: NormLayer) -> None:
        super().__init__(
            AtrousConv2d(in_channels, out_channels, dilation=dilation),
            norm_layer(out_channels),
            nn.ReLU(),
        )


class ASPPPooling(nn.Sequential):
    """Image-level branch: global average pool, 1x1 conv, norm, ReLU, broadcast to the input's size.

    One image in a training batch: the norm sees one value per channel, where batch statistics do not
    exist (nn.BatchNorm2d raises "Expected more than 1 value per channel"). When the statistics would
    come from that one image only (a plain nn.BatchNorm2d, or a synchronized BatchNorm that runs alone:
    no DataParallel replica, no torch.distributed group of more than one process), the norm normalizes
    with its running statistics for that step, as in eval mode: the running statistics are not updated,
    its weight and bias still train. Training only with batch 1 thus keeps this norm an affine map that
    behaves the same in training and evaluation. In every other case the norm runs as usual, so the
    replicas of a synchronized BatchNorm always agree on whether to synchronize (one skipping the
    rendezvous would hang the others) and reduce over all devices' images. Eval mode is unaffected:
    outputs equal torchvision's ASPPPooling.
    """

    def __init__(self, in_channels: int, out_channels: int, *, norm_layer: NormLayer) -> None:
        super().__init__(
            nn.AdaptiveAvgPool2d(1),
            nn.Conv2d(in_channels, out_channels, 1, bias=False),
            norm_layer(out_channels),
            nn.ReLU(),
        )

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        size = x.shape[-2:]
        pooled = self[1](self[0](x))
        norm = self[2]
        single_value = self.training and pooled.shape[0] * pooled.shape[2] * pooled.shape[3] == 1
        if single_value and _uses_running_stats_fallback(norm):
            pooled = F.batch_norm(
                pooled, norm.running_mean, norm.running_var, norm.weight, norm.bias, False, 0.0, norm.eps
            )
        else:
            pooled = norm(pooled)
        pooled = self[3](pooled)
        return F.interpolate(pooled, size=size, mode="bilinear", align_corners=False)


def _uses_running_stats_fallback(norm: nn.Module) -> bool:
    """True when a training-mode `norm` would take batch statistics from this one image alone: a
    BatchNorm with running statistics that does not synchronize (a plain nn.BatchNorm2d, or a
    synchronized one that `synchronizes()` says runs alone)."""
    if not isinstance(norm, nn.modules.batchnorm._BatchNorm) or norm.running_mean is None:
        return False  # e.g. FrozenBatchNorm2d: already uses fixed statistics
    synchronizes = getattr(norm, "synchronizes", None)
    return synchronizes is None or not synchronizes()


class ASPP(nn.Module):
    """Atrous spatial pyramid pooling: 1x1 conv, one 3x3 conv per rate, image pooling; concat, 1x1 project.

    Input N x in_channels x h x w, output N x out_channels x h x w.
    """

    def __init__(
        self,
        in_channels: int,
        atrous_rates: Sequence[int],
        *,
        out_channels: int = 256,
        norm_layer: NormLayer = nn.BatchNorm2d,
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        branches: list[nn.Module] = [
            nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, bias=False), norm_layer(out_channels), nn.ReLU())
        ]
        branches += [ASPPConv(in_channels, out_channels, dilation=rate, norm_layer=norm_layer) for rate in atrous_rates]
        branches.append(ASPPPooling(in_channels, out_channels, norm_layer=norm_layer))
        self.convs = nn.ModuleList(branches)
        self.project = nn.Sequential(
            nn.Conv2d(len(branches) * out_channels, out_channels, 1, bias=False),
            norm_layer(out_channels),
            nn.ReLU(),
            nn.Dropout(dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.project(torch.cat([branch(x) for branch in self.convs], dim=1))


class DeepLabV3Head(nn.Sequential):
    """ASPP on `out`, 3x3 conv, norm, ReLU, 1x1 classifier (torchvision's DeepLabHead layout)."""

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        *,
        atrous_rates: Sequence[int],
        channels: int = 256,
        norm_layer: NormLayer = nn.BatchNorm2d,
        dropout: float = 0.5,
    ) -> None:
        super().__init__(
            ASPP(in_channels, atrous_rates, out_channels=channels, norm_layer=norm_layer, dropout=dropout),
            nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            norm_layer(channels),
            nn.ReLU(),
            nn.Conv2d(channels, num_classes, 1),
        )

    def forward(self, features: dict[str, Tensor]) -> Tensor:  # type: ignore[override]
        x = features["out"]
        for module in self:
            x = module(x)
        return x


class DeepLabV3PlusHead(nn.Module):
    """DeepLabV3+ decoder: ASPP on `out`, upsampled to `low_level` (output stride 4), concatenated with a
    48-channel projection of `low_level`, two 3x3 convs (norm, ReLU), 1x1 classifier.

    Returns logits at the low-level features' resolution.
    """

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        *,
        low_level_channels: int,
        atrous_rates: Sequence[int],
        channels: int = 256,
        low_level_projection: int = 48,
        norm_layer: NormLayer = nn.BatchNorm2d,
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        self.aspp = ASPP(in_channels, atrous_rates, out_channels=channels, norm_layer=norm_layer, dropout=dropout)
        self.low_level_project = nn.Sequential(
            nn.Conv2d(low_level_channels, low_level_projection, 1, bias=False),
            norm_layer(low_level_projection),
            nn.ReLU(),
        )
        self.decoder = nn.Sequential(
            nn.Conv2d(channels + low_level_projection, channels, 3, padding=1, bias=False),
            norm_layer(channels),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1, bias=False),
            norm_layer(channels),
            nn.ReLU(),
        )
        self.to_logits = nn.Conv2d(channels, num_classes, 1)

    def forward(self, features: dict[str, Tensor]) -> Tensor:
        low_level = self.low_level_project(features["low_level"])
        x = self.aspp(features["out"])
        x = F.interpolate(x, size=low_level.shape[-2:], mode="bilinear", align_corners=False)
        return self.to_logits(self.decoder(torch.cat([x, low_level], dim=1)))


class FCNHead(nn.Sequential):
    """Auxiliary head on `aux`: 3x3 conv to in_channels // 4, norm, ReLU, dropout 0.1, 1x1 classifier."""

    def __init__(self, in_channels: int, num_classes: int, *, norm_layer: NormLayer = nn.BatchNorm2d) -> None:
        inter_channels = in_channels // 4
        super().__init__(
            nn.Conv2d(in_channels, inter_channels, 3, padding=1, bias=False),
            norm_layer(inter_channels),
            nn.ReLU(),
            nn.Dropout(0.1),
            nn.Conv2d(inter_channels, num_classes, 1),
        )

    def forward(self, features: dict[str, Tensor]) -> Tensor:  # type: ignore[override]
        x = features["aux"]
        for module in self:
            x = module(x)
        return x
