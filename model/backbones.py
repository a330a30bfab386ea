"""Feature extractors for DeepLab: torchvision ResNets, MobileNetV2 and MobileNetV3-Large with an output stride
of 8 or 16, or 32: the torchvision network as it is, nothing dilated (timm encoders: model/timm_encoder.py).

Every backbone is built from torchvision's own definition, so torchvision's ImageNet state dicts load
strictly into it (after dropping the ImageNet classifier; MobileNet keys also lose their `features.`
prefix). `forward(x)` returns a dict of feature maps:

- `low_level`: output stride 4 (ResNet layer1, MobileNet block 3), for the DeepLabV3+ decoder;
- `aux`: ResNet layer3 / MobileNetV2 block 13 (output stride 8 or 16; 16 at 32) / MobileNetV3 block 4
  (output stride 8, torchvision's choice), for the FCN aux head;
- `out`: the last stage, at the requested output stride (MobileNetV2: the 320-channel block 17; the
  1x1 conv to 1280 channels belongs to the classifier, as in the MobileNetV2 paper's DeepLabV3).

Each backbone exposes `low_level_channels`, `aux_channels` and `out_channels`.

How output stride becomes dilation (the "atrous" conversion), all in this file:

- ResNet-50/101 (Bottleneck): torchvision's `replace_stride_with_dilation`.
- ResNet-18/34 (BasicBlock): torchvision refuses dilation, so `_dilate_basic_stage` converts the built
  stage: the strided block keeps its previous dilation on conv1 with stride 1, every later 3x3 conv
  (conv2 of that block and both convs of the following blocks) gets the new dilation. This is the exact
  atrous conversion: in eval mode the dilated network's output subsampled by 2 (or 4) equals the
  undilated network's output, which the tests check.
- MobileNetV2: the same exact conversion, block by block as TensorFlow DeepLab does it: once the output
  stride is reached, a block's stride-2 depthwise conv gets stride 1 and the current dilation, and
  the blocks after it twice that.
- MobileNetV3-Large: torchvision's convention (`dilated=True`): every depthwise conv of a dilated stage,
  the formerly strided one included, gets the stage's dilation. Output stride 16 dilates the last stage
  by 2 (identical to `mobilenet_v3_large(dilated=True)`); 8 also dilates the stride-16 stage by 2 and
  the last stage by 4.
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlparse

import torch
import torchvision
from torch import Tensor, nn
from torchvision.models.resnet import BasicBlock, ResNet

from syncseg.lazy_registry import load_object
from syncseg.model.input_channels import RGB, adapt_input_channels
from syncseg.model.norm import NormLayer
from syncseg.model.registry import BACKBONES
from syncseg.model.timm_encoder import build_timm_backbone, timm_model_name

logger = logging.getLogger(__name__)

class ResNetBackbone(nn.Module):
    """The convolutional part of a torchvision ResNet (no avgpool / fc); module names equal torchvision's."""

    def __init__(self, resnet: ResNet) -> None:
        super().__init__()
        self.conv1 = resnet.conv1
        self.bn1 = resnet.bn1
        self.relu = resnet.relu
        self.maxpool = resnet.maxpool
        self.layer1 = resnet.layer1
        self.layer2 = resnet.layer2
        self.layer3 = resnet.layer3
        self.layer4 = resnet.layer4
        expansion = 4 if not isinstance(resnet.layer1[0], BasicBlock) else 1
        self.low_level_channels = 64 * expansion
        self.aux_channels = 256 * expansion
        self.out_channels = 512 * expansion

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        low_level = self.layer1(x)
        aux = self.layer3(self.layer2(low_level))
        out = self.layer4(aux)
        return {"low_level": low_level, "aux": aux, "out": out}


class MobileNetBackbone(nn.Sequential):
    """torchvision MobileNet `features` blocks (keys `0.*`, `1.*`, ...: torchvision's DeepLabV3 backbone
    keys); `low_level`, `aux` and `out` are the outputs of the blocks at the given indices (out: the last)."""

    def __init__(self, blocks: list[nn.Module], *, low_level_index: int, aux_index: int) -> None:
        super().__init__(*blocks)
        self.low_level_index = low_level_index
        self.aux_index = aux_index
        self.out_index = len(self) - 1
        self.low_level_channels = self[low_level_index].out_channels
        self.aux_channels = self[aux_index].out_channels
        self.out_channels = self[self.out_index].out_channels

    def forward(self, x: Tensor) -> dict[str, Tensor]:  # type: ignore[override]
        result = {}
        for index, block in enumerate(self):
            x = block(x)
            if index == self.low_level_index:
                result["low_level"] = x
            if index == self.aux_index:
                result["aux"] = x
        result["out"] = x
        return result


def _dilate_conv(conv: nn.Conv2d, dilation: int) -> None:
    """Stride 1, the given dilation, and the padding that keeps the spatial size ('same' for odd kernels)."""
    kernel = conv.kernel_size[0]
    conv.stride = (1, 1)
    conv.dilation = (dilation, dilation)
    conv.padding = ((kernel - 1) // 2 * dilation,) * 2


def _dilate_basic_stage(stage: nn.Sequential, *, previous_dilation: int, dilation: int) -> None:
    """Atrous conversion of a strided BasicBlock stage (see the module docstring)."""
    first = stage[0]
    _dilate_conv(first.conv1, previous_dilation)
    _dilate_conv(first.conv2, dilation)
    if first.downsample is not None:
        first.downsample[0].stride = (1, 1)
    for block in list(stage)[1:]:
        _dilate_conv(block.conv1, dilation)
        _dilate_conv(block.conv2, dilation)


# output stride -> which of ResNet's layer2/3/4 trade their stride for dilation
_DILATED_STAGES = {32: [False, False, False], 16: [False, False, True], 8: [False, True, True]}


def build_resnet(name: str, *, output_stride: int, norm_layer: NormLayer) -> ResNetBackbone:
    """torchvision's ResNet `name` (resnet18/34/50/101) at `output_stride`."""
    dilate = _DILATED_STAGES[output_stride]
    constructor = getattr(torchvision.models, name)
    if name in ("resnet18", "resnet34"):
        resnet = constructor(weights=None, norm_layer=norm_layer)
        current = 1
        for stage, flag in zip((resnet.layer2, resnet.layer3, resnet.layer4), dilate):
            if flag:
                _dilate_basic_stage(stage, previous_dilation=current, dilation=current * 2)
                current *= 2
    else:
        resnet = constructor(weights=None, replace_stride_with_dilation=dilate, norm_layer=norm_layer)
    return ResNetBackbone(resnet)


def _spatial_convs(block: nn.Module) -> list[nn.Conv2d]:
    return [module for module in block.modules() if isinstance(module, nn.Conv2d) and module.kernel_size[0] > 1]


def build_mobilenet_v2(name: str, *, output_stride: int, norm_layer: NormLayer) -> MobileNetBackbone:
    """torchvision's MobileNetV2 without its last 1x1 conv, at `output_stride` (`name`: its registered name)."""
    network = torchvision.models.mobilenet_v2(weights=None, norm_layer=norm_layer)
    blocks = list(network.features)[:-1]  # without the 1x1 conv to 1280 channels
    strided = [i for i, block in enumerate(blocks) if any(c.stride == (2, 2) for c in _spatial_convs(block))]
    # strided == [0, 2, 4, 7, 14]: output strides 2, 4, 8, 16, 32
    current_stride, dilation = 1, 1
    for index, block in enumerate(blocks):
        stride = 2 if index in strided else 1
        if current_stride < output_stride:
            current_stride *= stride
            continue
        for conv in _spatial_convs(block):
            _dilate_conv(conv, dilation)
        dilation *= stride
    return MobileNetBackbone(blocks, low_level_index=strided[2] - 1, aux_index=strided[4] - 1)


def build_mobilenet_v3_large(name: str, *, output_stride: int, norm_layer: NormLayer) -> MobileNetBackbone:
    """torchvision's MobileNetV3-Large at `output_stride` (`name`: its registered name)."""
    # torchvision's MobileNetV3 BatchNorm settings (eps 1e-3, momentum 0.01) are part of the pretrained recipe.
    norm = functools.partial(norm_layer, eps=0.001, momentum=0.01)
    network = torchvision.models.mobilenet_v3_large(weights=None, norm_layer=norm)
    blocks = list(network.features)
    # Blocks whose stride moves to the next output stride (torchvision marks them `_is_cn`).
    stage_starts = [i for i, block in enumerate(blocks) if getattr(block, "_is_cn", False)]
    # stage_starts == [2, 4, 7, 13]: output strides 4, 8, 16, 32; aux at torchvision's position ("C2", OS 8)
    backbone = MobileNetBackbone(blocks, low_level_index=stage_starts[1] - 1, aux_index=stage_starts[1])
    last_start = stage_starts[-1]
    dilations = {range(last_start, len(backbone) - 1): 2}
    if output_stride == 32:
        dilations = {}
    elif output_stride == 8:
        dilations = {range(stage_starts[-2], last_start): 2, range(last_start, len(backbone) - 1): 4}
    for blocks_range, dilation in dilations.items():
        for index in blocks_range:
            for conv in _spatial_convs(backbone[index]):
                _dilate_conv(conv, dilation)
    return backbone


def build_backbone(name: str, *, output_stride: int, norm_layer: NormLayer, pretrained: str = "none",
                   in_channels: int = RGB) -> nn.Module:
    """A backbone by name with randomly initialized or pretrained weights, for images of `in_channels`
    channels (other than 3: the first convolution is adapted, model/input_channels.py).

    `name` and `output_stride` (8 or 16) are values the config validated; `timm:<name>` is a timm encoder
    (model/timm_encoder.py). pretrained: "none" (torchvision's random init), "imagenet" (torchvision's
    ImageNet checkpoint from the local torch hub cache, see `imagenet_weights_file`; never downloaded),
    or a path to a state dict. Raises ValueError for mismatching weights, FileNotFoundError for a
    missing weights file.
    """
    backbone = _build_rgb_backbone(name, output_stride=output_stride, norm_layer=norm_layer, pretrained=pretrained)
    adapt_input_channels(backbone, in_channels, name=name,
                         weights="random" if pretrained in ("", "none") else f"pretrained: {pretrained}")
    return backbone


def _build_rgb_backbone(name: str, *, output_stride: int, norm_layer: NormLayer, pretrained: str) -> nn.Module:
    timm_name = timm_model_name(name)
    if timm_name is not None:
        return build_timm_backbone(timm_name, output_stride=output_stride, norm_layer=norm_layer,
                                   pretrained=pretrained)
    backbone = load_object(BACKBONES.get(name).build)(name, output_stride=output_stride, norm_layer=norm_layer)
    if pretrained in ("", "none"):
        return backbone
    if pretrained == "imagenet":
        path = imagenet_weights_file(name)
        load_backbone_weights(backbone, _read_state_dict(path), source=str(path), strict=True)
    else:
        path = Path(pretrained)
        if not path.is_file():
            raise FileNotFoundError(
                f"model.pretrained_backbone: backbone weights file '{path}' not found; "
                "expected 'none', 'imagenet' or the path to a state dict file"
            )
        load_backbone_weights(backbone, _read_state_dict(path), source=str(path), strict=False)
    return backbone


def imagenet_weights_file(name: str) -> Path:
    """Where torchvision's ImageNet checkpoint for `name` must be: <torch hub dir>/checkpoints/<file name>.

    That is where torchvision itself caches it (`$TORCH_HOME/hub/checkpoints`, by default
    ~/.cache/torch/hub/checkpoints). Raises FileNotFoundError naming the file and the folder when absent.
    """
    enum_name = BACKBONES.get(name).imagenet_weights
    if not enum_name:
        raise ValueError(f"model.pretrained_backbone=imagenet: backbone '{name}' names no torchvision ImageNet "
                         "weights; give the path to a state dict file or model.pretrained_backbone=none")
    weights = torchvision.models.get_weight(enum_name)
    file_name = os.path.basename(urlparse(weights.url).path)
    folder = Path(torch.hub.get_dir()) / "checkpoints"
    path = folder / file_name
    if not path.is_file():
        raise FileNotFoundError(
            f"ImageNet weights for backbone '{name}' ({enum_name}) not found: expected the file "
            f"'{file_name}' in '{folder}' (set TORCH_HOME to change the folder). Nothing is downloaded at run "
            f"time: fetch {weights.url} on a machine with network access and copy it there, or set "
            "model.pretrained_backbone=none"
        )
    return path


def unwrap_state_dict(loaded: Any) -> tuple[dict[str, Tensor] | None, str]:
    """The state dict in a loaded weights file: the object itself, or its "state_dict" or "model" entry
    (how training scripts commonly wrap one), and where it was ("" for the object itself). (None, "")
    when there is no non-empty mapping of names to tensors."""
    where = ""
    if isinstance(loaded, Mapping):
        for key in ("state_dict", "model"):
            if isinstance(loaded.get(key), Mapping):
                loaded, where = loaded[key], key
                break
    if not isinstance(loaded, Mapping) or not loaded or not all(
            isinstance(key, str) and isinstance(value, Tensor) for key, value in loaded.items()):
        return None, ""
    return dict(loaded), where


def _read_state_dict(path: Path) -> dict[str, Tensor]:
    # model/ may not import syncseg/engine/checkpoint_file.py (import rule), so this is the one torch.load outside it.
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # corrupt / not a torch file
        raise ValueError(f"backbone weights file '{path}' could not be read as a state dict: {error}") from None
    state_dict, _ = unwrap_state_dict(loaded)
    if state_dict is None:
        raise ValueError(f"backbone weights file '{path}' does not hold a state dict (a mapping of names to tensors)")
    return state_dict


def to_backbone_keys(backbone: nn.Module, state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Map a torchvision classification state dict onto backbone keys.

    ResNet: drop `fc.*`. MobileNet: drop `classifier.*` and the blocks the backbone leaves out
    (MobileNetV2's last 1x1 conv), and strip the `features.` prefix. Keys of a DeepLab checkpoint's
    backbone (`backbone.` prefix) lose that prefix. Other keys pass unchanged.
    """
    mapped = {}
    is_mobilenet = isinstance(backbone, MobileNetBackbone)
    for key, value in state_dict.items():
        if key.startswith("backbone."):
            key = key[len("backbone."):]
        if not is_mobilenet and key.startswith("fc."):
            continue
        if is_mobilenet:
            if key.startswith("classifier."):
                continue
            if key.startswith("features."):
                key = key[len("features."):]
                if int(key.split(".")[0]) >= len(backbone):
                    continue
        mapped[key] = value
    return mapped


def load_backbone_weights(
    backbone: nn.Module, state_dict: Mapping[str, Tensor], *, source: str = "state dict", strict: bool = True
) -> None:
    """Load (torchvision-style) weights into a backbone, see `to_backbone_keys`.

    Shape mismatches always raise ValueError. Missing / unexpected keys raise when `strict`, else they are
    logged as warnings.
    """
    mapped = to_backbone_keys(backbone, state_dict)
    own = backbone.state_dict()
    mismatched = [
        f"{key}: file {tuple(value.shape)} vs model {tuple(own[key].shape)}"
        for key, value in mapped.items()
        if key in own and own[key].shape != value.shape
    ]
    if mismatched:
        raise ValueError(
            f"backbone weights '{source}' do not fit the {type(backbone).__name__} "
            f"({len(mismatched)} shape mismatches; wrong backbone name?): " + "; ".join(mismatched[:10])
        )
    result = backbone.load_state_dict(mapped, strict=False)
    problems = []
    if result.missing_keys:
        problems.append(f"missing keys ({len(result.missing_keys)}): {', '.join(result.missing_keys[:10])}")
    if result.unexpected_keys:
        problems.append(f"unexpected keys ({len(result.unexpected_keys)}): {', '.join(result.unexpected_keys[:10])}")
    if problems and strict:
        raise ValueError(f"backbone weights '{source}' do not match the backbone: " + "; ".join(problems))
    for problem in problems:
        logger.warning("backbone weights '%s': %s", source, problem)
    logger.info("loaded backbone weights from '%s' (%d tensors)", source, len(mapped))
