"""Cityscapes fine annotations: 19 train classes, labelIds mapped to trainIds on load (no conversion step).

Layout under `root`:
    leftImg8bit/<split>/<city>/<stem>_leftImg8bit.png
    gtFine/<split>/<city>/<stem>_gtFine_labelIds.png

The tables follow the official label definitions (cityscapesscripts/helpers/labels.py, checked against
that package in tests/data/test_cityscapes.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from syncseg.data.base import LabelTarget, SegmentationDataset, Transform
from syncseg.data.transforms import IGNORE_INDEX

TABLE_IGNORE = 255  # the official tables' trainId for labels left out of training and evaluation

# (labelId, trainId, name, color) for every labelId 0..33; trainId 255 = ignored in training/evaluation.
_LABELS = (
    (0, 255, "unlabeled", (0, 0, 0)),
    (1, 255, "ego vehicle", (0, 0, 0)),
    (2, 255, "rectification border", (0, 0, 0)),
    (3, 255, "out of roi", (0, 0, 0)),
    (4, 255, "static", (0, 0, 0)),
    (5, 255, "dynamic", (111, 74, 0)),
    (6, 255, "ground", (81, 0, 81)),
    (7, 0, "road", (128, 64, 128)),
    (8, 1, "sidewalk", (244, 35, 232)),
    (9, 255, "parking", (250, 170, 160)),
    (10, 255, "rail track", (230, 150, 140)),
    (11, 2, "building", (70, 70, 70)),
    (12, 3, "wall", (102, 102, 156)),
    (13, 4, "fence", (190, 153, 153)),
    (14, 255, "guard rail", (180, 165, 180)),
    (15, 255, "bridge", (150, 100, 100)),
    (16, 255, "tunnel", (150, 120, 90)),
    (17, 5, "pole", (153, 153, 153)),
    (18, 255, "polegroup", (153, 153, 153)),
    (19, 6, "traffic light", (250, 170, 30)),
    (20, 7, "traffic sign", (220, 220, 0)),
    (21, 8, "vegetation", (107, 142, 35)),
    (22, 9, "terrain", (152, 251, 152)),
    (23, 10, "sky", (70, 130, 180)),
    (24, 11, "person", (220, 20, 60)),
    (25, 12, "rider", (255, 0, 0)),
    (26, 13, "car", (0, 0, 142)),
    (27, 14, "truck", (0, 0, 70)),
    (28, 15, "bus", (0, 60, 100)),
    (29, 255, "caravan", (0, 0, 90)),
    (30, 255, "trailer", (0, 0, 110)),
    (31, 16, "train", (0, 80, 100)),
    (32, 17, "motorcycle", (0, 0, 230)),
    (33, 18, "bicycle", (119, 11, 32)),
)
NUM_LABEL_IDS = len(_LABELS)  # raw labelIds 0..33 (license plate, -1, never appears in the PNGs)

CITYSCAPES_CLASSES = tuple(name for _, train_id, name, _ in _LABELS if train_id != TABLE_IGNORE)
CITYSCAPES_PALETTE = np.array([color for _, train_id, _, color in _LABELS if train_id != TABLE_IGNORE],
                              dtype=np.uint8)



def _lookup_tables() -> tuple[np.ndarray, np.ndarray]:
    label_to_train = np.full(256, TABLE_IGNORE, dtype=np.uint8)
    train_to_label = np.zeros(256, dtype=np.uint8)  # anything that is not a trainId -> 0 (unlabeled)
    for label_id, train_id, _, _ in _LABELS:
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
