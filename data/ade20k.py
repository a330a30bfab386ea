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
from typing import Sequence

import numpy as np

from syncseg.data.base import LabelTarget, SegmentationDataset, Transform
from syncseg.data.transforms import IGNORE_INDEX

# (class name, color) for classes 0..149, i.e. raw annotation values 1..150
_CLASSES = (
    ('wall', (120, 120, 120)), ('building', (180, 120, 120)), ('sky', (6, 230, 230)), ('floor', (80, 50, 50)),
    ('tree', (4, 200, 3)), ('ceiling', (120, 120, 80)), ('road', (140, 140, 140)), ('bed', (204, 5, 255)),
    ('windowpane', (230, 230, 230)), ('grass', (4, 250, 7)), ('cabinet', (224, 5, 255)),
    ('sidewalk', (235, 255, 7)), ('person', (150, 5, 61)), ('earth', (120, 120, 70)), ('door', (8, 255, 51)),
    ('table', (255, 6, 82)), ('mountain', (143, 255, 140)), ('plant', (204, 255, 4)), ('curtain', (255, 51, 7)),
    ('chair', (204, 70, 3)), ('car', (0, 102, 200)), ('water', (61, 230, 250)), ('painting', (255, 6, 51)),
    ('sofa', (11, 102, 255)), ('shelf', (255, 7, 71)), ('house', (255, 9, 224)), ('sea', (9, 7, 230)),
    ('mirror', (220, 220, 220)), ('rug', (255, 9, 92)), ('field', (112, 9, 255)), ('armchair', (8, 255, 214)),
    ('seat', (7, 255, 224)), ('fence', (255, 184, 6)), ('desk', (10, 255, 71)), ('rock', (255, 41, 10)),
    ('wardrobe', (7, 255, 255)), ('lamp', (224, 255, 8)), ('bathtub', (102, 8, 255)), ('railing', (255, 61, 6)),
    ('cushion', (255, 194, 7)), ('base', (255, 122, 8)), ('box', (0, 255, 20)), ('column', (255, 8, 41)),
    ('signboard', (255, 5, 153)), ('chest of drawers', (6, 51, 255)), ('counter', (235, 12, 255)),
    ('sand', (160, 150, 20)), ('sink', (0, 163, 255)), ('skyscraper', (140, 140, 140)),
    ('fireplace', (250, 10, 15)), ('refrigerator', (20, 255, 0)), ('grandstand', (31, 255, 0)),
    ('path', (255, 31, 0)), ('stairs', (255, 224, 0)), ('runway', (153, 255, 0)), ('case', (0, 0, 255)),
    ('pool table', (255, 71, 0)), ('pillow', (0, 235, 255)), ('screen door', (0, 173, 255)),
    ('stairway', (31, 0, 255)), ('river', (11, 200, 200)), ('bridge', (255, 82, 0)), ('bookcase', (0, 255, 245)),
    ('blind', (0, 61, 255)), ('coffee table', (0, 255, 112)), ('toilet', (0, 255, 133)), ('flower', (255, 0, 0)),
    ('book', (255, 163, 0)), ('hill', (255, 102, 0)), ('bench', (194, 255, 0)), ('countertop', (0, 143, 255)),
    ('stove', (51, 255, 0)), ('palm', (0, 82, 255)), ('kitchen island', (0, 255, 41)), ('computer', (0, 255, 173)),
    ('swivel chair', (10, 0, 255)), ('boat', (173, 255, 0)), ('bar', (0, 255, 153)),
    ('arcade machine', (255, 92, 0)), ('hovel', (255, 0, 255)), ('bus', (255, 0, 245)), ('towel', (255, 0, 102)),
    ('light', (255, 173, 0)), ('truck', (255, 0, 20)), ('tower', (255, 184, 184)), ('chandelier', (0, 31, 255)),
    ('awning', (0, 255, 61)), ('streetlight', (0, 71, 255)), ('booth', (255, 0, 204)),
    ('television receiver', (0, 255, 194)), ('airplane', (0, 255, 82)), ('dirt track', (0, 10, 255)),
    ('apparel', (0, 112, 255)), ('pole', (51, 0, 255)), ('land', (0, 194, 255)), ('bannister', (0, 122, 255)),
    ('escalator', (0, 255, 163)), ('ottoman', (255, 153, 0)), ('bottle', (0, 255, 10)), ('buffet', (255, 112, 0)),
    ('poster', (143, 255, 0)), ('stage', (82, 0, 255)), ('van', (163, 255, 0)), ('ship', (255, 235, 0)),
    ('fountain', (8, 184, 170)), ('conveyer belt', (133, 0, 255)), ('canopy', (0, 255, 92)),
    ('washer', (184, 0, 255)), ('plaything', (255, 0, 31)), ('swimming pool', (0, 184, 255)),
    ('stool', (0, 214, 255)), ('barrel', (255, 0, 112)), ('basket', (92, 255, 0)), ('waterfall', (0, 224, 255)),
    ('tent', (112, 224, 255)), ('bag', (70, 184, 160)), ('minibike', (163, 0, 255)), ('cradle', (153, 0, 255)),
    ('oven', (71, 255, 0)), ('ball', (255, 0, 163)), ('food', (255, 204, 0)), ('step', (255, 0, 143)),
    ('tank', (0, 255, 235)), ('trade name', (133, 255, 0)), ('microwave', (255, 0, 235)), ('pot', (245, 0, 255)),
    ('animal', (255, 0, 122)), ('bicycle', (255, 245, 0)), ('lake', (10, 190, 212)), ('dishwasher', (214, 255, 0)),
    ('screen', (0, 204, 255)), ('blanket', (20, 0, 255)), ('sculpture', (255, 255, 0)), ('hood', (0, 153, 255)),
    ('sconce', (0, 41, 255)), ('vase', (0, 255, 204)), ('traffic light', (41, 0, 255)), ('tray', (41, 255, 0)),
    ('ashcan', (173, 0, 255)), ('fan', (0, 245, 255)), ('pier', (71, 0, 255)), ('crt screen', (122, 0, 255)),
    ('plate', (0, 255, 184)), ('monitor', (0, 92, 255)), ('bulletin board', (184, 255, 0)),
    ('shower', (0, 133, 255)), ('radiator', (255, 214, 0)), ('glass', (25, 194, 194)), ('clock', (102, 255, 0)),
    ('flag', (92, 0, 255)),
)
ADE20K_CLASSES = tuple(name for name, _ in _CLASSES)
ADE20K_PALETTE = np.array([color for _, color in _CLASSES], dtype=np.uint8)
NUM_RAW_LABELS = len(_CLASSES) + 1  # raw 0 ("other") and the 150 classes
TABLE_IGNORE = 255


def _lookup_tables() -> tuple[np.ndarray, np.ndarray]:
    raw_to_class = np.full(256, TABLE_IGNORE, dtype=np.uint8)  # raw 0 and anything unlisted: ignored
    raw_to_class[1:NUM_RAW_LABELS] = np.arange(len(_CLASSES))
    class_to_raw = np.zeros(256, dtype=np.uint8)  # anything that is not a class -> 0 ("other")
    class_to_raw[: len(_CLASSES)] = np.arange(1, NUM_RAW_LABELS)
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
