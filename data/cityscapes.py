"""Cityscapes fine annotations: 19 train classes, labelIds mapped to trainIds on load (no conversion step).

Layout under `root`:
    leftImg8bit/<split>/<city>/<stem>_leftImg8bit.png
    gtFine/<split>/<city>/<stem>_gtFine_labelIds.png

The tables follow the official label definitions (cityscapesscripts/helpers/labels.py, checked against
that package in tests/data/test_cityscapes.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from syncseg.data.base import LabelTarget, SegmentationDataset, Transform, mask_encoding
from syncseg.data.label_tables import (CITYSCAPES_CLASSES, CITYSCAPES_COLOURS, CITYSCAPES_LABELS,  # noqa: F401
                                       CITYSCAPES_TABLE_IGNORE)
from syncseg.data.transforms import IGNORE_INDEX

TABLE_IGNORE = CITYSCAPES_TABLE_IGNORE
NUM_LABEL_IDS = len(CITYSCAPES_LABELS)  # raw labelIds 0..33 (license plate, -1, never appears in the PNGs)

CITYSCAPES_PALETTE = np.array(CITYSCAPES_COLOURS, dtype=np.uint8)


def _lookup_tables() -> tuple[np.ndarray, np.ndarray]:
    label_to_train = np.full(256, TABLE_IGNORE, dtype=np.uint8)
    train_to_label = np.zeros(256, dtype=np.uint8)  # anything that is not a trainId -> 0 (unlabeled)
    for label_id, train_id, _, _ in CITYSCAPES_LABELS:
        label_to_train[label_id] = train_id
        if train_id != TABLE_IGNORE:
            train_to_label[train_id] = label_id
    label_to_train.setflags(write=False)
    train_to_label.setflags(write=False)
    return label_to_train, train_to_label


# 256-entry lookups: LABELID_TO_TRAINID[labelId] (unlisted -> 255); TRAINID_TO_LABELID[trainId] for saving
# predictions as labelId PNGs (the official evaluation format), 255 -> 0.
LABELID_TO_TRAINID, TRAINID_TO_LABELID = _lookup_tables()

IMAGE_SUFFIX = "_leftImg8bit.png"
MASK_SUFFIX = "_gtFine_labelIds.png"
LAYOUT = (
    "expected leftImg8bit/<split>/<city>/<name>_leftImg8bit.png and "
    "gtFine/<split>/<city>/<name>_gtFine_labelIds.png under data.root (split train | val)"
)


class CityscapesSegmentation(SegmentationDataset):
    """Cityscapes gtFine `split` (train | val | any folder under leftImg8bit/), masks as trainIds."""

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
        if not str(root):
            raise FileNotFoundError(f"data.root is empty for dataset 'cityscapes'; {LAYOUT}")
        self.root = Path(root).expanduser()
        image_dir = self.root / "leftImg8bit" / split
        mask_dir = self.root / "gtFine" / split
        for folder in (self.root, image_dir, mask_dir):
            if not folder.is_dir():
                raise FileNotFoundError(f"Cityscapes folder '{folder}' not found; {LAYOUT}")
        images = sorted(image_dir.glob(f"*/*{IMAGE_SUFFIX}"))
        if not images:
            raise FileNotFoundError(f"no '*{IMAGE_SUFFIX}' images in '{image_dir}/<city>/'; {LAYOUT}")
        samples = []
        for image in images:
            stem = image.name[: -len(IMAGE_SUFFIX)]
            samples.append((image, mask_dir / image.parent.name / f"{stem}{MASK_SUFFIX}"))
        self.split = split
        super().__init__(
            samples,
            classes=CITYSCAPES_CLASSES,
            palette=CITYSCAPES_PALETTE,
            ignore_index=ignore_index,
            raw_ignore=255,  # not a labelId; treated as unlabeled
            transform=transform,
            skip_bad_samples=skip_bad_samples,
            label_map=label_map,
            class_colors=class_colors,
            raw_table=LABELID_TO_TRAINID,
            raw_table_ignore=TABLE_IGNORE,
            num_raw_labels=NUM_LABEL_IDS,
            description=f"Cityscapes {split} ({self.root})",
        )


def build_cityscapes(data_cfg: Any, split: str, transform: Transform) -> CityscapesSegmentation:
    """data.dataset=cityscapes: `split` of a validated `data` config section, read through `transform`."""
    return CityscapesSegmentation(data_cfg.root, split, ignore_index=data_cfg.ignore_index, transform=transform,
                                  skip_bad_samples=data_cfg.skip_bad_samples, **mask_encoding(data_cfg))
