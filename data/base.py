"""File-backed segmentation datasets: decoding, validation, bad-sample policy, palettes.

A sample on disk is an image (8-bit RGB in any format cv2 reads, or the data.in_channels /
data.max_value format of syncseg.data.images) and a mask of the same size: a single-channel
index PNG (palette PNGs are read as indices, never as colors) or, with data.class_colors, a colour-coded
one (syncseg.data.masks reads both through one table). Each dataset subclass only lists its (image, mask) pairs
and its class names; this module does the rest.
"""
from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from syncseg.data.checks import image_format_warnings, repeated_names_warning, stored_formats
from syncseg.data.images import ImageFormat, read_image, read_stored_image, starts_as_tiff, tiff_layout
from syncseg.data.masks import BadSampleError, LabelTarget, MaskDecoder, MaskSampleReport, inspect_masks, read_index_mask
from syncseg.data.palettes import palette_table
from syncseg.data.transforms import IGNORE_INDEX, to_tensors

logger = logging.getLogger(__name__)

Transform = Callable[[np.ndarray, np.ndarray], tuple[torch.Tensor, torch.Tensor]]


def mask_encoding(data_cfg: Any) -> dict[str, Any]:
    """data.label_map and data.class_colors as keyword arguments, as every file-backed dataset takes them."""
    return {"label_map": data_cfg.label_map, "class_colors": data_cfg.class_colors}


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


class SegmentationDataset(Dataset):
    """(image, mask) file pairs -> (image tensor CxHxW, int64 tensor HxW with `ignore_index` = ignore).

    Images are read in `image_format` (syncseg.data.images.ImageFormat: 8-bit RGB by default, uint8 3xHxW).

    Masks become labels through one syncseg.data.masks.MaskDecoder: without `raw_table` the raw values
    0..num_classes-1 are the classes; with it (e.g. Cityscapes labelIds -> trainIds) raw values below
    `num_raw_labels` map through the table, whose `raw_table_ignore` entries mean "ignored". The raw
    value `raw_ignore` (default: `ignore_index`, the value the files use for unlabeled pixels) maps to
    `ignore_index`. The user's `label_map` entries (data.label_map: raw value -> class or "ignore")
    override all of that for the values they list; `reduce_zero_label` (data.reduce_zero_label) reads
    raw 0 as ignored and k as class k-1; `class_colors` (data.class_colors) reads colour-coded masks.
    Any other raw value or colour makes a sample bad. A bad sample raises BadSampleError naming the
    file, or with `skip_bad_samples` logs a warning and yields the next good sample instead
    (`num_skipped` counts them in this process).

    `listed_in` names the list file the samples come from (names listed twice there are a warning) and
    `listing_warnings` are a subclass's findings about its files; both end in `listing_warnings`, which
    check_data_at_start logs and verify_dataset prints (nothing is logged here: a dataset is built in
    more places than the start of training).
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
        raw_table: np.ndarray | None = None,
        raw_table_ignore: int | None = None,
        num_raw_labels: int | None = None,
        label_map: Sequence[tuple[int, LabelTarget]] = (),
        reduce_zero_label: bool = False,
        class_colors: Sequence[tuple[Sequence[int], LabelTarget]] = (),
        description: str = "dataset",
        image_format: ImageFormat = ImageFormat(),
        listed_in: str | None = None,
        listing_warnings: Sequence[str] = (),
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
        self.image_format = image_format
        self.num_skipped = 0
        self.masks = MaskDecoder(num_classes=len(self.classes), ignore_index=self.ignore_index,
                                 raw_ignore=self.raw_ignore, raw_table=raw_table, raw_table_ignore=raw_table_ignore,
                                 num_raw_labels=num_raw_labels, label_map=label_map,
                                 reduce_zero_label=reduce_zero_label, class_colors=class_colors)
        self.samples = self._existing(list(samples))
        repeated = None if listed_in is None else repeated_names_warning(
            [Path(image).stem for image, _ in samples], description=description, listed_in=listed_in)
        self.listing_warnings = [*listing_warnings, *([repeated] if repeated else [])]

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
        if starts_as_tiff(path):  # tifffile reads any band count's header; Pillow refuses (and logs) many
            try:
                layout = tiff_layout(path)
                return layout.height, layout.width
            except BadSampleError:
                pass  # a header tifffile does not parse: Pillow's turn
        try:
            with Image.open(path) as image:
                width, height = image.size
        except (OSError, SyntaxError) as error:
            if self.image_format.is_rgb8:
                raise BadSampleError(f"cannot read image '{path}': {error}") from None
            return read_stored_image(path).shape[:2]
        return height, width

    def load(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Decoded, validated and label-mapped (image HxWxC in `image_format`, mask HxW uint8); raises
        BadSampleError."""
        image_path, mask_path = self.samples[index]
        image = read_image(image_path, self.image_format)
        raw = self.masks.read_raw(mask_path)
        if image.shape[:2] != raw.shape:
            raise BadSampleError(
                f"image '{image_path}' is {image.shape[1]}x{image.shape[0]} but mask '{mask_path}' is "
                f"{raw.shape[1]}x{raw.shape[0]} (width x height); they must match"
            )
        return image, self.masks.to_labels(raw, mask_path)

    def _spread(self, limit: int) -> list[int]:
        """`limit` sample indices spread evenly over the split (all when limit <= 0)."""
        count = len(self) if limit <= 0 else min(limit, len(self))
        return np.unique(np.linspace(0, len(self) - 1, count).round().astype(int)).tolist() if count else []

    def inspect_masks(self, limit: int) -> MaskSampleReport:
        """syncseg.data.masks.inspect_masks on `limit` masks spread evenly over the split (all when limit <= 0)."""
        return inspect_masks([self.samples[i][1] for i in self._spread(limit)], self.masks,
                             description=self.description)

    def inspect_images(self, limit: int) -> list[str]:
        """syncseg.data.checks.image_format_warnings for the same `limit` images as inspect_masks, read as their
        files store them."""
        formats = stored_formats(self.samples[i][0] for i in self._spread(limit))
        return image_format_warnings(formats, self.image_format, description=self.description)

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


START_CHECK_MASKS = 32  # samples per split that the start of training decodes: a second or so, even for Cityscapes


def check_data_at_start(dataset: Dataset, *, limit: int = START_CHECK_MASKS) -> MaskSampleReport | None:
    """Look at a file-backed dataset before training, so that what would train wrong is said now, once, in
    the validation split too, not at the first step or the first validation: its listing
    (`listing_warnings`: names listed twice, two images of one name), `limit` images as stored
    (inspect_images: 16-bit files read as 8-bit, fewer channels than data.in_channels) and the same
    `limit` masks (inspect_masks: binary 0/255 masks whose foreground is the ignore label, multi-page
    files, ...). Logs each warning once; bad masks raise BadSampleError naming the file and, where it can
    tell, the data.label_map that reads them, unless the dataset skips bad samples (then a warning).
    Returns the mask report with every warning logged in its `warnings`; None for generated data."""
    if not isinstance(dataset, SegmentationDataset):
        return None  # generated data: no files
    warnings = [*dataset.listing_warnings, *dataset.inspect_images(limit)]
    for warning in warnings:
        logger.warning("%s", warning)
    report = dataset.inspect_masks(limit)
    if report.bad:
        problem = report.warnings[0] if report.fix else (
            f"{report.bad[0]} ({len(report.bad)} of {report.num_checked} masks checked at start-up are bad)")
        if not dataset.skip_bad_samples:
            raise BadSampleError(problem)
        logger.warning("%s; data.skip_bad_samples=true skips such samples", problem)
        return replace(report, warnings=[*warnings, *report.warnings])
    for warning in report.warnings:
        logger.warning("%s", warning)
    return replace(report, warnings=[*warnings, *report.warnings])
