"""Inference: whole image or sliding window, with multi-scale and flip test-time augmentation.

`predict_batch(model, images, ...)` (uint8 or uint16 images) is the one entry point of validation, eval.py,
the TensorBoard grid and predict.py: it normalizes (data.max_value, data.mean, data.std), autocasts (eval.amp)
and predicts with the eval section's mode, window, stride, scales and flip. `predict` is the part that takes
normalized images.

All variants return logits at the input resolution; augmented passes are averaged as logits (not
probabilities). A scale of exactly 1.0 does no resizing, so `scales=(1.0,)` is plain inference, and a
sliding window at least as large as the image is one whole-image pass.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from syncseg.data.transforms import height_width, normalize_batch, window_starts
from syncseg.engine.devices import autocast_for
from syncseg.model.deeplab import DeepLab

logger = logging.getLogger(__name__)


def _forward(model: nn.Module, images: torch.Tensor, num_classes: int) -> torch.Tensor:
    """The model's logits (float32) resized to the input size (a DeepLab skips its aux head: unused here)."""
    output = model(images, aux=False) if isinstance(model, DeepLab) else model(images)
    if isinstance(output, Mapping):
        output = output["out"]
    if output.ndim != 4 or output.shape[1] != num_classes:
        raise ValueError(f"model returned logits of shape {tuple(output.shape)}, expected N x {num_classes} x H x W "
                         f"(num_classes={num_classes})")
    output = output.float()
    if output.shape[-2:] != images.shape[-2:]:
        output = F.interpolate(output, size=images.shape[-2:], mode="bilinear", align_corners=False)
    return output


def _slide(model: nn.Module, variants: list[torch.Tensor], *, num_classes: int, window_size: tuple[int, int],
           stride: tuple[int, int], window_batch: int) -> list[torch.Tensor]:
    """Sliding-window logits of each tensor in `variants` (one shape N x C x H x W: an image and its
    flip). Windows of all variants go through the model together, `window_batch` images per forward
    pass; each variant's overlapping logits are summed in window order and averaged."""
    batch, _, height, width = variants[0].shape
    (window_h, window_w), (stride_h, stride_w) = window_size, stride
    if window_h >= height and window_w >= width:
        return [_forward(model, variant, num_classes) for variant in variants]
    crop_h, crop_w = min(window_h, height), min(window_w, width)
    positions = [(top, left) for top in window_starts(height, window_h, stride_h)
                 for left in window_starts(width, window_w, stride_w)]
    counts = variants[0].new_zeros((1, 1, height, width), dtype=torch.float32)
    for top, left in positions:
        counts[:, :, top:top + crop_h, left:left + crop_w] += 1
    logits = [variant.new_zeros((batch, num_classes, height, width), dtype=torch.float32) for variant in variants]
    windows = [(index, top, left) for index in range(len(variants)) for top, left in positions]
    per_pass = max(1, window_batch // batch)
    for first in range(0, len(windows), per_pass):
        chunk = windows[first:first + per_pass]
        pieces = torch.cat([variants[index][:, :, top:top + crop_h, left:left + crop_w] for index, top, left in chunk])
        for (index, top, left), piece in zip(chunk, _forward(model, pieces, num_classes).split(batch)):
            logits[index][:, :, top:top + crop_h, left:left + crop_w] += piece
    return [variant_logits / counts for variant_logits in logits]


@torch.no_grad()
def predict(
    model: nn.Module,
    images: torch.Tensor,
    *,
    num_classes: int,
    mode: str,
    window_size: int | Sequence[int],
    stride: int | Sequence[int],
    scales: Sequence[float],
    flip: bool,
    window_batch: int,
) -> torch.Tensor:
    """Logits N x num_classes x H x W (float32) for normalized float images N x C x H x W.

    mode "whole" runs the model on the full image; "slide" on windows of `window_size` (height, width;
    one integer: a square) every `stride` pixels (likewise per axis, <= the window), overlapping logits
    averaged; the windows of an image and of its flip go through the model `window_batch` images at a
    time. Each scale in `scales` (positive)
    resizes the image (bilinear), runs `mode`, and resizes the logits back; with `flip` every scale
    also runs on the horizontally flipped image (logits flipped back). All passes are averaged. The
    settings are an eval config section's (`eval_settings(syncseg.engine.config.EvalConfig)`, validated there). The model is
    used as given (call model.eval() first). Raises ValueError for images that are not N x C x H x W
    floats.
    """
    if images.ndim != 4:
        raise ValueError(f"predict: images must be N x C x H x W, got shape {tuple(images.shape)}")
    if not images.is_floating_point():
        raise ValueError(f"predict: images must be normalized float tensors, got {images.dtype} "
                         "(use syncseg.data.transforms.normalize_batch)")
    height, width = images.shape[-2:]
    window_size, stride = height_width(window_size), height_width(stride)
    total = None
    passes = 0
    for scale in scales:
        if scale == 1.0:
            scaled = images
        else:
            size = (max(1, round(height * scale)), max(1, round(width * scale)))
            scaled = F.interpolate(images, size=size, mode="bilinear", align_corners=False)
        variants = [scaled, scaled.flip(-1)] if flip else [scaled]
        if mode == "whole":
            outputs = [_forward(model, variant, num_classes) for variant in variants]
        else:
            outputs = _slide(model, variants, num_classes=num_classes, window_size=window_size, stride=stride,
                             window_batch=window_batch)
        for flipped, logits in zip((False, True), outputs):
            if flipped:
                logits = logits.flip(-1)
            if logits.shape[-2:] != (height, width):
                logits = F.interpolate(logits, size=(height, width), mode="bilinear", align_corners=False)
            total = logits if total is None else total + logits
            passes += 1
    return total / passes if passes > 1 else total


def eval_settings(eval_cfg: Any) -> dict[str, Any]:
    """`predict`'s keyword arguments from an eval config section (syncseg.engine.config.EvalConfig)."""
    return {"mode": eval_cfg.mode, "window_size": eval_cfg.window_size, "stride": eval_cfg.stride,
            "scales": tuple(eval_cfg.scales), "flip": bool(eval_cfg.flip), "window_batch": eval_cfg.window_batch}


@torch.no_grad()
def predict_batch(model: nn.Module, images: torch.Tensor, *, num_classes: int, data_cfg: Any, eval_cfg: Any,
                  long_side: int = 0, output_size: tuple[int, int] | None = None) -> torch.Tensor:
    """Logits N x num_classes x H x W (float32) for uint8 / uint16 images N x C x H x W on the model's device.

    Normalized with data_cfg.max_value, mean and std (syncseg.data.transforms.normalize_batch), run under
    eval_cfg.amp's autocast (syncseg.engine.devices) by `predict` with eval_cfg's mode, window_size, stride, scales,
    flip and window_batch (an syncseg.engine.config.EvalConfig; its defaults are the schema's). `long_side` > 0 first
    resizes the image so its long side is that many pixels (data.base_size for raw photos); the logits come
    back at `output_size` (height, width; default: the input's size). The model is used as given (eval mode is
    the caller's).
    """
    height, width = images.shape[-2:]
    inputs = normalize_batch(images, data_cfg.mean, data_cfg.std, max_value=data_cfg.max_value)
    if long_side > 0 and max(height, width) != long_side:
        scale = long_side / max(height, width)
        size = (max(1, round(height * scale)), max(1, round(width * scale)))
        inputs = F.interpolate(inputs, size=size, mode="bilinear", align_corners=False)
    with autocast_for(images.device, eval_cfg.amp):
        logits = predict(model, inputs, num_classes=num_classes, **eval_settings(eval_cfg))
    size = tuple(output_size) if output_size is not None else (height, width)
    if logits.shape[-2:] != size:
        logits = F.interpolate(logits.float(), size=size, mode="bilinear", align_corners=False)
    return logits
