"""A backbone's first convolution for images of other than 3 channels (data.in_channels).

Every backbone is built, and its pretrained weights loaded, for RGB; then its first convolution (the
first Conv2d of the network, the one that reads the image) takes `in_channels` channels with filters
made from its RGB ones, timm's rule, so the pretrained features stay:

- 1 channel: the sum of the R, G and B filters (a grey image x gives what the RGB image (x, x, x) gave);
- any other count N: the R, G, B filters repeated cyclically (R, G, B, R, G, ...) and scaled by 3 / N
  (an image whose channels repeat R, G, B gives what the RGB image gave, when 3 divides N).

The convolution keeps its class, stride, padding and bias; only its weight (and `in_channels`) change.
"""
from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)

RGB = 3


def first_convolution(network: nn.Module) -> tuple[str, nn.Conv2d]:
    """(module path, module) of the first nn.Conv2d of `network` in module order: a backbone's stem."""
    for name, module in network.named_modules():
        if isinstance(module, nn.Conv2d):
            return name, module
    raise ValueError(f"{type(network).__name__} has no Conv2d to take the image")


def rgb_filters_for(weight: Tensor, in_channels: int) -> Tensor:
    """out x 3 x kh x kw RGB filters -> out x in_channels x kh x kw by the module docstring's rule, in
    the weight's dtype."""
    if weight.shape[1] != RGB:
        raise ValueError(f"expected RGB filters (out x 3 x kh x kw), got shape {tuple(weight.shape)}")
    if in_channels == 1:
        return weight.sum(dim=1, keepdim=True)
    cyclic = torch.arange(in_channels, device=weight.device) % RGB
    return weight[:, cyclic] * (RGB / in_channels)


def describe_rule(in_channels: int) -> str:
    if in_channels == 1:
        return "the sum of its RGB filters"
    return f"its RGB filters repeated cyclically and scaled by 3/{in_channels}"


def adapt_input_channels(backbone: nn.Module, in_channels: int, *, name: str, weights: str) -> None:
    """Make `backbone`'s first convolution (RGB) take `in_channels` channels (see the module docstring),
    in place; logs one line. Nothing changes for 3. `name` (model.backbone) and `weights` (where its
    weights came from) are for the log line and errors. ValueError when that convolution does not read
    3 channels or is grouped (nothing to adapt from)."""
    if in_channels == RGB:
        return
    path, conv = first_convolution(backbone)
    if conv.in_channels != RGB or conv.groups != 1:
        raise ValueError(f"model.backbone={name}: its first convolution '{path}' takes {conv.in_channels} channel(s) "
                         f"in {conv.groups} group(s), not RGB, so it cannot be adapted to data.in_channels="
                         f"{in_channels}; choose another backbone")
    with torch.no_grad():
        conv.weight = nn.Parameter(rgb_filters_for(conv.weight.detach(), in_channels))
    conv.in_channels = in_channels
    logger.info("model.backbone=%s: first convolution '%s' adapted from 3 to %d input channel(s) "
                "(data.in_channels): %s (%s weights)", name, path, in_channels, describe_rule(in_channels), weights)
