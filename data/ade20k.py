"""ADE20K scene parsing (the SceneParsing benchmark's ADEChallengeData2016): 150 classes, "other" ignored.

Layout under `root` (the ADEChallengeData2016 folder, or a folder holding it):
    images/training/ADE_train_<8 digits>.jpg          20,210 images
    images/validation/ADE_val_<8 digits>.jpg          2,000 images
    annotations/{training,validation}/<same stem>.png single-channel PNGs: 0 = "other" (not one of the
                                                      150 classes), k = class k (1..150)
Splits are the folder names `training` and `validation`; `train` and `val` (the data.*_split defaults)
name the same folders.

Labels are reduced by one ("reduce zero label" in mmsegmentation): raw 0 becomes the ignore label, raw
k becomes class k - 1, through SegmentationDataset's one lookup table. Class names are the first name of
each entry of the benchmark's objectInfo150 list, colors its palette (color150), as mmsegmentation uses.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from syncseg.data.base import LabelTarget, SegmentationDataset, Transform, mask_encoding
from syncseg.data.label_tables import ADE20K_CLASSES, ADE20K_COLOURS
from syncseg.data.transforms import IGNORE_INDEX

ADE20K_PALETTE = np.array(ADE20K_COLOURS, dtype=np.uint8)
NUM_RAW_LABELS = len(ADE20K_CLASSES) + 1  # raw 0 ("other") and the 150 classes
TABLE_IGNORE = 255


def _lookup_tables() -> tuple[np.ndarray, np.ndarray]:
    raw_to_class = np.full(256, TABLE_IGNORE, dtype=np.uint8)  # raw 0 and anything unlisted: ignored
    raw_to_class[1:NUM_RAW_LABELS] = np.arange(len(ADE20K_CLASSES))
    class_to_raw = np.zeros(256, dtype=np.uint8)  # anything that is not a class -> 0 ("other")
    class_to_raw[: len(ADE20K_CLASSES)] = np.arange(1, NUM_RAW_LABELS)
    raw_to_class.setflags(write=False)
    class_to_raw.setflags(write=False)
    return raw_to_class, class_to_raw


# 256-entry lookups: RAW_TO_CLASS[annotation value]; CLASS_TO_RAW[class] for saving predictions in the
# benchmark's format (1..150)
RAW_TO_CLASS, CLASS_TO_RAW = _lookup_tables()

SPLIT_FOLDERS = {"train": "training", "val": "validation"}  # the config defaults name the official folders
LAYOUT = (
    "expected the ADEChallengeData2016 folder (or its parent) as data.root, holding images/<split>/*.jpg and "
    "annotations/<split>/*.png with split training | validation (train | val name the same)"
)


def resolve_ade20k_root(root: str | Path) -> Path:
    """`root`, or `root/ADEChallengeData2016` when `root` holds it; FileNotFoundError otherwise."""
    if not str(root):
        raise FileNotFoundError(f"data.root is empty for dataset 'ade20k'; {LAYOUT}")
    path = Path(root).expanduser()
    if not (path / "images").is_dir() and (path / "ADEChallengeData2016" / "images").is_dir():
        path = path / "ADEChallengeData2016"
    if not path.is_dir():
        raise FileNotFoundError(f"ADE20K root '{path}' does not exist; {LAYOUT}")
    return path


class ADE20KSegmentation(SegmentationDataset):
    """ADE20K `split` (training | validation, or train | val), masks as class indices 0..149."""

    def __init__(
        self,
        root: str | Path,
        split: str,
        *,
        ignore_index: int = IGNORE_INDEX,
        transform: Transform | None = None,
        skip_bad_samples: bool = False,
        label_map: Sequence[tuple[int, LabelTarget]] = (),
        class_colors: Sequence[tuple[Sequence[int], LabelTarget]] = (),
    ) -> None:
        self.root = resolve_ade20k_root(root)
        self.split = SPLIT_FOLDERS.get(split, split)
        image_dir, mask_dir = self.root / "images" / self.split, self.root / "annotations" / self.split
        for folder in (image_dir, mask_dir):
            if not folder.is_dir():
                raise FileNotFoundError(f"ADE20K folder '{folder}' not found (split '{split}'); {LAYOUT}")
        images = sorted(image_dir.glob("*.jpg"))
        if not images:
            raise FileNotFoundError(f"no '*.jpg' images in '{image_dir}'; {LAYOUT}")
        super().__init__(
            [(image, mask_dir / f"{image.stem}.png") for image in images],
            classes=ADE20K_CLASSES,
            palette=ADE20K_PALETTE,
            ignore_index=ignore_index,
            transform=transform,
            skip_bad_samples=skip_bad_samples,
            label_map=label_map,
            class_colors=class_colors,
            raw_table=RAW_TO_CLASS,
            raw_table_ignore=TABLE_IGNORE,
            num_raw_labels=NUM_RAW_LABELS,
            description=f"ADE20K {self.split} ({self.root})",
        )


def build_ade20k(data_cfg: Any, split: str, transform: Transform) -> ADE20KSegmentation:
    """data.dataset=ade20k: `split` of a validated `data` config section, read through `transform`."""
    return ADE20KSegmentation(data_cfg.root, split, ignore_index=data_cfg.ignore_index, transform=transform,
                              skip_bad_samples=data_cfg.skip_bad_samples, **mask_encoding(data_cfg))
