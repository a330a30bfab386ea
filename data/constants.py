"""The plain values the data modules and the config schema share: the ignore label, image format limits,
the normalization defaults. The standard library only, so `syncseg.engine.config` reads them without
importing torch, cv2 or albumentations (tests/engine/test_light_import.py)."""
from __future__ import annotations

from typing import Sequence

# masks (syncseg.data.masks): the target of a data.label_map / data.class_colors entry for unlabeled pixels
IGNORE = "ignore"
LabelTarget = int | str  # a class index, or IGNORE
IGNORE_INDEX = 255  # data.ignore_index's default: the mask value that no loss or metric counts

# images (syncseg.data.images)
RGB_CHANNELS = 3  # data.in_channels' default
MAX_CHANNELS = 128  # data.in_channels' limit: cv2 (resize, flip: the augmentations) refuses images of more
MAX_8BIT, MAX_16BIT = 255, 65535  # data.max_value's default and its largest value
COLOUR_READER_CHANNELS = 4  # the most channels the 8-bit RGB reader (cv2's colour decode) takes from a file: RGBA

# normalization (syncseg.data.transforms.normalize_batch): data.mean and data.std's defaults
IMAGENET_MEAN = (0.485, 0.456, 0.406)  # 0-1 units (x / data.max_value), RGB
IMAGENET_STD = (0.229, 0.224, 0.225)

# the start-up warnings (syncseg.data.checks, syncseg.data.masks): files quoted in one; the rest are counted
NAMED_FILES = 3


def height_width(size: int | Sequence[int]) -> tuple[int, int]:
    """(height, width) of a pixel size given as one integer (a square) or as a pair."""
    if isinstance(size, int):
        return size, size
    height, width = size
    return int(height), int(width)
