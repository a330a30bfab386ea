"""`export.py --format onnx --deepness`: an ONNX file the QGIS Deepness plugin runs as a segmentation model.

What the plugin does with a "Segmentor" (its processing/models: model_base.py, segmentor.py,
preprocessing_utils.py): it reads one input of shape (batch, channels, tile, tile) and takes the tile size
from the input's last two dimensions, so they are static and square (its output check compares the
output's height and width, which dynamic dimensions would fail); older releases also expect batch 1, newer
ones read a static batch as the batch they send. It feeds tiles of the map as float32 NCHW divided by 255,
then standardized by the standardization_mean/std keys where newer releases find them (not written here:
the model normalizes, which every release runs the same); it reads the single output as (batch, classes,
tile, tile) class confidences in 0..1. Its metadata keys (JSON-encoded values): model_type, class_names (a
dict of consecutive ids from 0), resolution (cm per pixel), tile_size, tiles_overlap (percent of the
tile), optionally seg_thresh.

So the file holds the plugin's side of the contract: `DeepnessModel` multiplies its input by 255 (back to
the raster's values, 8- or 16-bit alike), applies the checkpoint's own normalization (x / data.max_value,
then (x - mean) / std), runs the network and returns softmax probabilities; batch 1. A syncseg
`--runtime` refuses the file (its input and output differ from a plain export's).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn

PLUGIN_SCALE = 255.0  # the plugin divides every tile by 255, whatever the raster's bit depth
DEFAULT_OVERLAP = 15  # percent; the plugin's panel default is about this


class DeepnessModel(nn.Module):
    """The plugin's input (N x C x T x T, raster values / 255) -> class probabilities N x K x T x T."""

    def __init__(self, logits_model: nn.Module, *, max_value: float, mean: Sequence[float],
                 std: Sequence[float]) -> None:
        super().__init__()
        self.logits_model = logits_model
        channels = len(mean)
        scale = torch.full((channels,), PLUGIN_SCALE / float(max_value))
        mean_t, std_t = torch.tensor(list(mean), dtype=torch.float32), torch.tensor(list(std), dtype=torch.float32)
        # x * 255 / max_value - mean, over std: one multiply and one add per channel
        self.register_buffer("gain", (scale / std_t).view(1, channels, 1, 1))
        self.register_buffer("offset", (-mean_t / std_t).view(1, channels, 1, 1))

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.logits_model(tiles * self.gain + self.offset), dim=1)


def deepness_metadata(*, classes: Sequence[str], tile: int, overlap: int, resolution: float | None,
                      threshold: float | None) -> dict[str, Any]:
    """The plugin's metadata keys (export_model JSON-encodes every value that is not a string, so strings
    are given JSON-encoded here: the plugin json.loads each value)."""
    import json

    metadata: dict[str, Any] = {
        "model_type": json.dumps("Segmentor"),
        "class_names": {str(index): name for index, name in enumerate(classes)},
        "tile_size": int(tile),
        "tiles_overlap": int(overlap),
        "deepness": True,  # syncseg's --runtime refuses the file (its input is not a plain export's)
    }
    if resolution is not None:
        metadata["resolution"] = float(resolution)
    if threshold is not None:
        metadata["seg_thresh"] = float(threshold)
    return metadata


def check_options(size: tuple[int, int], overlap: int, resolution: float | None, threshold: float | None) -> int:
    """The tile size of `size` (height, width); ValueError naming the flag for what the plugin cannot take."""
    if size[0] != size[1]:
        raise ValueError(f"--size {size[0]},{size[1]}: the Deepness plugin runs square tiles; give --size N,N "
                         "(or one integer)")
    if not 0 <= overlap < 100:
        raise ValueError(f"--tiles-overlap {overlap}: expected a percentage of the tile in 0..99")
    if resolution is not None and not resolution > 0:
        raise ValueError(f"--resolution {resolution}: expected the model's centimetres per pixel, above 0")
    if threshold is not None and not 0.0 <= threshold <= 1.0:
        raise ValueError(f"--seg-threshold {threshold}: expected a probability in 0..1")
    return size[0]


def merged(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """syncseg's export metadata with the plugin's keys on top, the input and output lines rewritten."""
    out = {**base, **extra}
    out["input"] = (f"float32 1 x {base['in_channels']} x T x T: the raster's values / 255 (the Deepness plugin's "
                    "tiles; mean 0 and std 1 in its panel), normalized inside the model")
    out["output"] = "float32 1 x C x T x T class probabilities (softmax); argmax over C is the class index"
    return out
