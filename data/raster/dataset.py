"""data.dataset=raster: chips read as windows from georeferenced scenes, never a whole scene.

    data: {dataset: raster, root: /data/aerial, scenes: [tile_a.tif, tile_b.tif], labels: [buildings.gpkg],
           label_attribute: class, num_classes: 2, class_names: [background, building], uncovered: background,
           val_region: "500100,4200000,500900,4200800", in_channels: 1, max_value: 65535, mean: [...], std: [...]}

- `data.scenes`: image rasters (paths under data.root); every one has data.in_channels bands.
- `data.labels`: one label source per scene, or one for all: a label raster of class ids (its nodata ignored),
  or a vector file whose `data.label_attribute` is the class; syncseg.data.raster.labels reads both.
- Splits: `val` is a grid of data.crop_size chips over data.val_region (default: each scene's bottom fifth),
  `train` is `data.chips_per_epoch` random chips that do not meet that region, each drawn from (data.seed, its
  index): the same index is the same chip, so the resumable sampler's order is the whole state. A training chip
  is 1 / the smallest data.scale_range larger than the crop, so the random rescale has pixels to crop from.
  `all` is the grid over whole scenes.
- The image's nodata pixels are the ignore label in the loss and the metrics; chips with no valid pixel are
  skipped (and counted: `num_skipped`, the validation grid's in its description).
"""
from __future__ import annotations

import glob
import logging
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from syncseg.data.masks import BadSampleError, MaskDecoder
from syncseg.data.palettes import bit_palette
from syncseg.data.raster.labels import RasterLabels, VectorLabels, is_box, is_vector, val_windows
from syncseg.data.raster.scenes import RasterError, Scene, SceneReader, Window, check_scene_format, read_scene
from syncseg.data.transforms import IGNORE_INDEX, height_width, to_tensors, window_starts

logger = logging.getLogger(__name__)

Transform = Callable[[np.ndarray, np.ndarray], tuple[torch.Tensor, torch.Tensor]]
DRAWS_PER_CHIP = 64  # random positions tried for one training chip before the split is called too small
SPLITS = ("train", "val", "all")


def grid(window: Window, chip: tuple[int, int], scene: Scene) -> list[Window]:
    """Chips of `chip` (height, width) covering `window`, the last of each row and column shifted back to end at
    its border; a window smaller than a chip gets one chip around it, kept inside the scene."""
    height, width = chip
    chips = []
    for top in window_starts(window.height, height, height):
        for left in window_starts(window.width, width, width):
            row = min(max(0, window.top + top), scene.height - height)
            column = min(max(0, window.left + left), scene.width - width)
            chips.append(Window(row, column, height, width))
    return list(dict.fromkeys(chips))


class RasterSegmentation(Dataset):
    """Chips of scenes (module docstring); items are (image C x H x W uint8 / uint16, mask H x W) after `transform`."""

    def __init__(self, scenes: Sequence[str | Path], labels: Sequence[str | Path], split: str, *, num_classes: int,
                 class_names: Sequence[str] = (), ignore_index: int = IGNORE_INDEX, transform: Transform | None = None,
                 crop_size: int | Sequence[int] = 512, scale_low: float = 1.0, chips_per_epoch: int = 1000,
                 seed: int = 0, val_region: str = "", label_attribute: str = "class", uncovered: str = "background",
                 label_map: Sequence[tuple[int, Any]] = (), channels: int = 3, max_value: int = 255,
                 raster_scale: float = 0.0) -> None:
        if split not in SPLITS:
            raise RasterError(f"raster dataset: split '{split}' is not one of {', '.join(SPLITS)} (data.train_split, "
                              "data.val_split: 'val' is the grid over data.val_region, 'train' the chips outside it)")
        if not scenes:
            raise RasterError("data.scenes is empty for dataset 'raster'; expected the image rasters (GeoTIFF) to "
                              "train on, under data.root")
        if len(labels) not in (1, len(scenes)):
            raise RasterError(f"data.labels has {len(labels)} entries for {len(scenes)} scenes; expected one label "
                              "raster or vector file per scene, or one for all")
        self.split, self.classes = split, tuple(class_names) or tuple(f"class_{i}" for i in range(num_classes))
        self.palette = bit_palette(num_classes)
        self.ignore_index, self.transform = int(ignore_index), transform
        self.description = f"raster {split}"
        self.crop = height_width(crop_size)
        self.seed, self.chips_per_epoch = int(seed), int(chips_per_epoch)
        self.masks = MaskDecoder(num_classes=num_classes, ignore_index=self.ignore_index, raw_ignore=self.ignore_index,
                                 label_map=label_map)
        self.scenes = [read_scene(path) for path in scenes]
        counts = {scene.count for scene in self.scenes}
        if len(counts) > 1:
            first = self.scenes[0]
            other = next(scene for scene in self.scenes if scene.count != first.count)
            raise RasterError(f"raster '{other.path}' has {other.count} bands but '{first.path}' has {first.count}; "
                              "every scene needs the same bands (data.in_channels)")
        self.readers, self.labels = [], []
        uncovered_label = 0 if uncovered == "background" else self.ignore_index
        for index, scene in enumerate(self.scenes):
            check_scene_format(scene, channels=channels, max_value=max_value, raster_scale=raster_scale)
            if scene.height < self.crop[0] or scene.width < self.crop[1]:
                raise RasterError(f"raster '{scene.path}' is {scene.width}x{scene.height}, smaller than one chip of "
                                  f"data.crop_size={self.crop[1]}x{self.crop[0]} (width x height); use a smaller "
                                  "data.crop_size")
            self.readers.append(SceneReader(scene, max_value=max_value, raster_scale=raster_scale))
            source = str(labels[index if len(labels) > 1 else 0])
            self.labels.append(VectorLabels(source, scene, attribute=label_attribute, class_names=class_names,
                                            num_classes=num_classes, uncovered=uncovered_label) if is_vector(source)
                               else RasterLabels(source, scene, ignore=self.ignore_index))
        self.val = [val_windows(val_region, scene) for scene in self.scenes]
        if split != "all" and not any(self.val):
            raise RasterError(f"data.val_region={val_region!r} does not overlap any scene "
                              f"({', '.join(scene.path for scene in self.scenes)}); expected a region on them")
        self.num_skipped = 0  # training chips with no valid pixel, in this process
        if split == "train":
            scale = min(1.0, scale_low)
            self.chip = tuple(min(math.ceil(side / scale), limit) for side, limit in
                              zip(self.crop, (min(s.height for s in self.scenes), min(s.width for s in self.scenes))))
            areas = np.array([scene.width * scene.height for scene in self.scenes], dtype=np.float64)
            self.weights = areas / areas.sum()
            self.chips: list[tuple[int, Window]] = []
        else:
            self.chip = self.crop
            regions = self.val if split == "val" else [[Window(0, 0, s.height, s.width)] for s in self.scenes]
            candidates = [(index, chip) for index, scene in enumerate(self.scenes) for region in regions[index]
                          for chip in grid(region, self.chip, scene)]
            self.chips = [(index, chip) for index, chip in candidates if self.readers[index].valid(chip).any()]
            skipped = len(candidates) - len(self.chips)
            if not self.chips:
                raise RasterError(f"raster {split}: every one of its {len(candidates)} chips is nodata")
            if skipped:
                self.description += f" ({skipped} of {len(candidates)} chips skipped: all nodata)"
                logger.info("raster %s: %d of %d chips have no valid pixel and are skipped", split, skipped,
                            len(candidates))

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return self.chips_per_epoch if self.split == "train" else len(self.chips)

    def _draws(self, index: int) -> Iterator[tuple[int, Window]]:
        """The (scene index, chip) positions training item `index` tries, in order: drawn from (data.seed, index),
        none meeting the validation region; RasterError after DRAWS_PER_CHIP draws."""
        generator = np.random.default_rng([self.seed, index])
        height, width = self.chip
        for _ in range(DRAWS_PER_CHIP):
            scene_index = int(generator.choice(len(self.scenes), p=self.weights))
            scene = self.scenes[scene_index]
            chip = Window(int(generator.integers(0, scene.height - height + 1)),
                          int(generator.integers(0, scene.width - width + 1)), height, width)
            if not any(chip.intersects(region) for region in self.val[scene_index]):
                yield scene_index, chip
        raise RasterError(f"raster train: no {width}x{height} chip outside data.val_region with a valid pixel in "
                          f"{DRAWS_PER_CHIP} draws ({', '.join(s.path for s in self.scenes)}); the region or the "
                          "nodata covers (nearly) all of the scenes")

    def _read(self, index: int) -> tuple[int, Window, np.ndarray, np.ndarray]:
        """(scene index, chip, image, valid pixels) of item `index`: a training chip is the first of its draws with
        a valid pixel (each draw's image and valid pixels read once)."""
        if self.split != "train":
            scene_index, chip = self.chips[index]
            return (scene_index, chip, *self.readers[scene_index].read(chip))
        for scene_index, chip in self._draws(index):
            image, valid = self.readers[scene_index].read(chip)
            if valid.any():
                return scene_index, chip, image, valid
            self.num_skipped += 1
        raise AssertionError("unreachable: _draws raises when it runs out")

    def window(self, index: int) -> tuple[int, Window]:
        """(scene index, chip) of item `index`."""
        return self.chips[index] if self.split != "train" else self._read(index)[:2]

    def name_of(self, index: int) -> str:
        scene_index, chip = self.window(index)
        return f"{self.scenes[scene_index].name}_r{chip.top}_c{chip.left}"

    def image_size(self, index: int) -> tuple[int, int]:
        return self.chip

    def load(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(image H x W x C, labels H x W uint8) of item `index`; the image's nodata is the ignore label."""
        scene_index, chip, image, valid = self._read(index)
        source = self.labels[scene_index]
        raw = source.read(chip).astype(np.int64, copy=False)
        if raw.max(initial=0) > 255 or raw.min(initial=0) < 0:
            bad = np.unique(raw[(raw > 255) | (raw < 0)])[:5].tolist()
            raise BadSampleError(f"label raster '{source.path}' has values {bad} at {chip}; expected class ids "
                                 f"0..{self.num_classes - 1} (data.label_map maps others, up to 255)")
        labels = self.masks.to_labels(np.ascontiguousarray(raw, dtype=np.uint8), source.path)
        labels[~valid] = self.ignore_index
        return image, labels

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"{self.description}: index {index} out of range for {len(self)} chips")
        image, labels = self.load(index)
        return to_tensors(image, labels) if self.transform is None else self.transform(image, labels)


def expand(root: Path, entries: Sequence[str], key: str) -> list[Path]:
    """`entries` under `root`, each a path or a glob pattern (tiles/*.tif: its files in sorted order);
    RasterError naming the key and the pattern that matches nothing."""
    paths: list[Path] = []
    for entry in entries:
        if any(char in entry for char in "*?["):
            found = sorted(path for path in root.glob(entry) if path.is_file()) if not Path(entry).is_absolute() \
                else sorted(Path(path) for path in glob.glob(entry) if os.path.isfile(path))
            if not found:
                raise RasterError(f"{key}: the pattern '{entry}' matches no file under '{root}'")
            paths.extend(found)
        else:
            paths.append(root / entry)
    return paths


def data_root(data_cfg: Any) -> Path:
    return Path(data_cfg.root).expanduser() if data_cfg.root else Path(".")


def scene_files(data_cfg: Any) -> tuple[list[Path], list[Path]]:
    """(the scenes, each one's label source) that data.scenes and data.labels name under data.root; entries may
    be glob patterns, whose matches pair up in sorted order. RasterError when the counts do not pair up."""
    root = data_root(data_cfg)
    scenes, labels = expand(root, data_cfg.scenes, "data.scenes"), expand(root, data_cfg.labels, "data.labels")
    if len(labels) not in (1, len(scenes)):
        raise RasterError(f"data.labels names {len(labels)} files for {len(scenes)} scenes; expected one label "
                          "raster or vector file per scene, or one for all")
    return scenes, labels * (len(scenes) if len(labels) == 1 else 1)


def build_raster(data_cfg: Any, split: str, transform: Transform) -> RasterSegmentation:
    """data.dataset=raster: `split` of a validated `data` config section, read through `transform`."""
    region = data_cfg.val_region
    if region and not is_box(region):
        region = str(data_root(data_cfg) / region)  # a vector file under data.root (an absolute path stays itself)
    return RasterSegmentation(*scene_files(data_cfg), split, num_classes=data_cfg.num_classes,
                              class_names=tuple(data_cfg.class_names), ignore_index=data_cfg.ignore_index, transform=transform, crop_size=data_cfg.crop_size,
                              scale_low=float(data_cfg.scale_range[0]), chips_per_epoch=data_cfg.chips_per_epoch,
                              seed=data_cfg.seed, val_region=region, label_attribute=data_cfg.label_attribute,
                              uncovered=data_cfg.uncovered, label_map=data_cfg.label_map,
                              channels=data_cfg.in_channels, max_value=data_cfg.max_value,
                              raster_scale=data_cfg.raster_scale)
