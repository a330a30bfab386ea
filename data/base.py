"""File-backed segmentation datasets: decoding, validation, bad-sample policy, palettes.

A sample on disk is an RGB image (any format cv2 reads) and a single-channel index PNG of the same
size (palette PNGs are read as indices, never as colors). Each dataset subclass only lists its
(image, mask) pairs and its class names; this module does the rest.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, Sequence

import cv2
import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from data.transforms import IGNORE_INDEX, to_tensors

logger = logging.getLogger(__name__)

Transform = Callable[[np.ndarray, np.ndarray], tuple[torch.Tensor, torch.Tensor]]

_IMAGE_READ_FLAGS = cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION  # masks ignore EXIF too


class BadSampleError(ValueError):
    """An image/mask pair that cannot be used; the message names the file and the problem."""


def bit_palette(num_colors: int) -> np.ndarray:
    """The Pascal VOC color map (bits of the index spread over R, G, B): num_colors x 3 uint8."""
    palette = np.zeros((num_colors, 3), dtype=np.uint8)
    for index in range(num_colors):
        value, red, green, blue = index, 0, 0, 0
        for bit in range(8):
            red |= ((value >> 0) & 1) << (7 - bit)
            green |= ((value >> 1) & 1) << (7 - bit)
            blue |= ((value >> 2) & 1) << (7 - bit)
            value >>= 3
        palette[index] = (red, green, blue)
    return palette


IGNORE_COLOR = (224, 224, 192)  # VOC's cream for its 255 "void" label: apart from every class and from black


def palette_table(palette: np.ndarray, *, ignore_index: int = IGNORE_INDEX) -> np.ndarray:
    """256 x 3 uint8 colours by label value: `palette` (num_classes x 3) for the classes, IGNORE_COLOR
    at `ignore_index` (when it is not a class index), black for every other value."""
    palette = np.asarray(palette, dtype=np.uint8).reshape(-1, 3)[:256]
    table = np.zeros((256, 3), dtype=np.uint8)
    table[: len(palette)] = palette
    if len(palette) <= ignore_index < 256:
        table[ignore_index] = IGNORE_COLOR
    return table


def palette_image(mask: np.ndarray, palette: np.ndarray, *, ignore_index: int = IGNORE_INDEX) -> Image.Image:
    """HxW class-index mask -> PIL image in P mode colored by `palette` (num_classes x 3). The pixel
    values stay the labels (the ignore value included); only the colours are the palette's, with
    `ignore_index` in IGNORE_COLOR as in VOC's own PNGs and other values past the palette black."""
    mask = np.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"palette_image expects an HxW mask, got shape {mask.shape}")
    if mask.size and (mask.min() < 0 or mask.max() > 255):
        raise ValueError(f"palette_image: mask values must be in [0, 255], got [{mask.min()}, {mask.max()}]")
    image = Image.fromarray(mask.astype(np.uint8), mode="P")
    image.putpalette(palette_table(palette, ignore_index=ignore_index).reshape(-1).tolist())
    return image


_JPEG_START, _JPEG_END = b"\xff\xd8", b"\xff\xd9"
_JPEG_TAIL = 4096  # where the end marker must be; tools append at most a little padding after it


def read_image(path: str | os.PathLike, *, exif_orientation: bool = False) -> np.ndarray:
    """HxWx3 uint8 RGB; BadSampleError naming the file if it is missing, not an image, or a JPEG cut
    short (decoders fill the missing part in gray silently). Training data ignores the EXIF orientation,
    like the masks drawn on the stored pixels; `exif_orientation=True` applies it (photos to predict:
    a phone's portrait shot is stored sideways with an orientation tag)."""
    try:
        data = np.fromfile(os.fspath(path), dtype=np.uint8)
    except OSError as error:
        raise BadSampleError(f"cannot read image '{path}': {error.strerror or error}") from None
    if data[:2].tobytes() == _JPEG_START and _JPEG_END not in data[-_JPEG_TAIL:].tobytes():
        raise BadSampleError(f"image '{path}' is a truncated JPEG (no end marker: a partial download or copy?); "
                             "replace the file")
    flags = cv2.IMREAD_COLOR_RGB if exif_orientation else _IMAGE_READ_FLAGS
    image = cv2.imdecode(data, flags) if data.size else None
    if image is None:
        raise BadSampleError(f"cannot read image '{path}' (empty, truncated or not an image)")
    return image


def read_index_mask(path: str | os.PathLike) -> np.ndarray:
    """HxW uint8 class indices from a single-channel PNG (palette 'P' or grayscale 'L'/'I;16')."""
    try:
        with Image.open(path) as image:
            mode = image.mode
            if mode not in ("P", "L", "I", "I;16"):
                raise BadSampleError(
                    f"mask '{path}' is a {mode} image; expected a single-channel index PNG "
                    "(palette or grayscale, pixel value = class index, 255 = ignore)"
                )
            mask = np.asarray(image)
    except BadSampleError:
        raise
    except (OSError, SyntaxError, ValueError) as error:
        raise BadSampleError(f"cannot read mask '{path}': {error}") from None
    if mask.dtype != np.uint8:
        if mask.size and (mask.min() < 0 or mask.max() > 255):
            raise BadSampleError(
                f"mask '{path}' has values in [{mask.min()}, {mask.max()}]; expected class indices or 255"
            )
        mask = mask.astype(np.uint8)
    return mask


class SegmentationDataset(Dataset):
    """(image, mask) file pairs -> (uint8 tensor 3xHxW, int64 tensor HxW with `ignore_index` = ignore).

    Raw mask values map to class indices through one 256-entry lookup: without `label_map` the raw
    values 0..num_classes-1 are the classes; with it (e.g. Cityscapes labelIds -> trainIds) raw values
    below `num_raw_labels` map through the table, whose `label_map_ignore` entries mean "ignored". The
    raw value `raw_ignore` (default: `ignore_index`, the value the files use for unlabeled pixels)
    maps to `ignore_index`. Any other raw value makes a sample bad. A bad sample raises BadSampleError
    naming the file, or with `skip_bad_samples` logs a warning and yields the next good sample instead
    (`num_skipped` counts them in this process).
    """

    def __init__(
        self,
        samples: Sequence[tuple[Path, Path]],
        *,
        classes: Sequence[str],
        palette: np.ndarray,
        ignore_index: int = IGNORE_INDEX,
        raw_ignore: int | None = None,
        transform: Transform | None = None,
        skip_bad_samples: bool = False,
        label_map: np.ndarray | None = None,
        label_map_ignore: int | None = None,
        num_raw_labels: int | None = None,
        description: str = "dataset",
    ) -> None:
        self.classes = tuple(classes)
        self.palette = np.asarray(palette, dtype=np.uint8).reshape(-1, 3)
        if len(self.palette) < len(self.classes):
            raise ValueError(f"{description}: palette has {len(self.palette)} colors for {len(self.classes)} classes")
        self.palette = self.palette[: len(self.classes)]
        self.ignore_index = int(ignore_index)
        self.raw_ignore = self.ignore_index if raw_ignore is None else int(raw_ignore)
        self.transform = transform
        self.skip_bad_samples = skip_bad_samples
        self.description = description
        self.num_skipped = 0
        self._lookup, self._invalid_lut, self._num_valid_raw = self._lookup_tables(label_map, label_map_ignore,
                                                                                   num_raw_labels)
        self.samples = self._existing(list(samples))

    def _lookup_tables(self, label_map: np.ndarray | None, label_map_ignore: int | None,
                       num_raw_labels: int | None) -> tuple[np.ndarray | None, np.ndarray, int]:
        """(raw -> label table or None for the identity, raw -> 1 if invalid, number of valid raw labels)."""
        if label_map is None:
            num_valid = len(self.classes)
            lookup = np.arange(256, dtype=np.uint8)
        else:
            if num_raw_labels is None:
                raise ValueError("num_raw_labels is required with a label_map")
            num_valid = num_raw_labels
            lookup = np.asarray(label_map, dtype=np.uint8).reshape(256).copy()
            if label_map_ignore is not None:
                lookup[lookup == label_map_ignore] = self.ignore_index
        lookup[self.raw_ignore] = self.ignore_index
        invalid = np.ones(256, dtype=np.uint8)
        invalid[:num_valid] = 0
        invalid[self.raw_ignore] = 0
        identity = np.array_equal(lookup, np.arange(256, dtype=np.uint8))
        return (None if identity else lookup), invalid, num_valid

    def _existing(self, samples: list[tuple[Path, Path]]) -> list[tuple[Path, Path]]:
        kept = []
        for image_path, mask_path in samples:
            missing = [str(p) for p in (image_path, mask_path) if not os.path.isfile(p)]
            if not missing:
                kept.append((image_path, mask_path))
            elif self.skip_bad_samples:
                logger.warning("%s: skipping sample, file(s) not found: %s", self.description, ", ".join(missing))
            else:
                raise FileNotFoundError(
                    f"{self.description}: listed sample file(s) not found: {', '.join(missing)} "
                    "(set data.skip_bad_samples=true to skip them)"
                )
        if len(kept) < len(samples):
            logger.warning("%s: %d of %d listed samples skipped (missing files)",
                           self.description, len(samples) - len(kept), len(samples))
        if not kept:
            raise FileNotFoundError(f"{self.description}: no usable samples")
        return kept

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return len(self.samples)

    def name_of(self, index: int) -> str:
        """The image file stem of sample `index` (used to name saved predictions)."""
        return Path(self.samples[index][0]).stem

    def image_size(self, index: int) -> tuple[int, int]:
        """(height, width) of sample `index`'s image file, from its header (nothing is decoded)."""
        path = self.samples[index][0]
        try:
            with Image.open(path) as image:
                width, height = image.size
        except (OSError, SyntaxError) as error:
            raise BadSampleError(f"cannot read image '{path}': {error}") from None
        return height, width

    def load(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Decoded, validated and label-mapped (image HxWx3 uint8 RGB, mask HxW uint8); raises BadSampleError."""
        image_path, mask_path = self.samples[index]
        image = read_image(image_path)
        mask = read_index_mask(mask_path)
        if image.shape[:2] != mask.shape:
            raise BadSampleError(
                f"image '{image_path}' is {image.shape[1]}x{image.shape[0]} but mask '{mask_path}' is "
                f"{mask.shape[1]}x{mask.shape[0]} (width x height); they must match"
            )
        if mask.size and cv2.LUT(mask, self._invalid_lut).max():
            bad = np.unique(mask[self._invalid_lut[mask].astype(bool)])
            raise BadSampleError(
                f"mask '{mask_path}' has values {bad[:10].tolist()} outside [0, {self._num_valid_raw - 1}] "
                f"and != {self.raw_ignore} (the ignore label, data.ignore_index)"
            )
        if self._lookup is not None:
            mask = cv2.LUT(mask, self._lookup)
        return image, mask

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"{self.description}: index {index} out of range for {len(self)} samples")
        index %= len(self)
        for attempt in range(len(self)):
            current = (index + attempt) % len(self)
            try:
                image, mask = self.load(current)
            except BadSampleError as error:
                if not self.skip_bad_samples:
                    raise
                self.num_skipped += 1
                logger.warning("%s: skipping bad sample (%d skipped so far in this process): %s",
                               self.description, self.num_skipped, error)
                continue
            if self.transform is None:
                return to_tensors(image, mask)
            return self.transform(image, mask)
        raise BadSampleError(f"{self.description}: every one of the {len(self)} samples is bad")
