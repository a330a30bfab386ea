"""predict.py --format: its masks written back in a labelling tool's format, as pre-annotations to correct.

`write_tool_formats` hands the masks predict.py wrote (read back one at a time from their PNGs, so that a
folder of any size fits in memory) to syncseg.data.annotations.writers, one folder per format under the
output: `coco/predictions.json`, `labelme/<folder>/<name>.json` + `labels.txt`, `cvat/annotations.xml`,
`yolo_seg/labels/<folder>/<name>.txt` + `data.yaml`. The classes are the checkpoint's, named as in training; a
COCO file gets the training file's category ids (the checkpoint's `label_ids`) and YOLO ids are the class
indices without the background. The class that means "nothing drawn" is the one named like a background
(`background`, `_background_`), or none.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from syncseg.data.annotations.common import BACKGROUND_NAMES

TOOL_FORMATS = ("coco", "labelme", "cvat", "yolo_seg")


def parse_formats(text: str) -> tuple[str, ...]:
    """--format's comma-separated names, each one of TOOL_FORMATS; ValueError naming the unknown one."""
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in TOOL_FORMATS]
    if unknown:
        raise ValueError(f"--format {unknown[0]!r}: expected one or more of {', '.join(TOOL_FORMATS)} "
                         "(comma-separated)")
    return names


def background_class(classes: Sequence[str]) -> int | None:
    """The index of the class named like a background, or None."""
    return next((index for index, name in enumerate(classes) if name.lower() in BACKGROUND_NAMES), None)


@dataclass(frozen=True)
class PredictedImage:
    """An image predict.py wrote a mask for: its name as the tool knows it (relative to --input), the
    mask PNG, and the image file."""

    file_name: str
    mask: Path
    image: Path


class MaskFiles(Sequence):
    """The predictions as the writers take them, each mask read from its PNG when asked for."""

    def __init__(self, images: Sequence[PredictedImage]) -> None:
        self.images = list(images)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index):  # type: ignore[override]
        from PIL import Image

        from syncseg.data.annotations.writers import Prediction

        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        item = self.images[index]
        with Image.open(item.mask) as image:
            labels = np.asarray(image)  # palette PNG: the pixel values are the class indices
        return Prediction(file_name=item.file_name, labels=labels)

    def __iter__(self) -> Iterator:
        return (self[index] for index in range(len(self)))


def write_tool_formats(formats: Sequence[str], images: Sequence[PredictedImage], *, classes: Sequence[str],
                       label_ids: Sequence[int | None] | None, output: Path, ignore_index: int) -> list[Path]:
    """Write each of `formats` under output/<format>/; returns the paths written."""
    from syncseg.data.annotations import writers

    predictions = MaskFiles(images)
    background = background_class(classes)
    written: list[Path] = []
    for name in formats:
        folder = output / name
        if name == "coco":
            written += writers.write_coco(predictions, classes, output=folder, background=background,
                                          category_ids=coco_category_ids(classes, label_ids, background),
                                          ignore_index=ignore_index)
        elif name == "labelme":
            written += writers.write_labelme(predictions, classes, output=folder, background=background,
                                             ignore_index=ignore_index)
        elif name == "cvat":
            written += writers.write_cvat(predictions, classes, output=folder, background=background,
                                          ignore_index=ignore_index)
        else:
            written += writers.write_yolo_seg(predictions, classes, output=folder, background=background,
                                              ignore_index=ignore_index)
    return written


def coco_category_ids(classes: Sequence[str], label_ids: Sequence[int | None] | None,
                      background: int | None) -> list[int]:
    """Class index -> COCO category id: the training file's where the checkpoint kept them, else index + 1;
    a class without one (an added background, a class no id drew) gets the next id above all of them."""
    ids = list(label_ids) if label_ids is not None and len(label_ids) == len(classes) else [
        index + 1 for index in range(len(classes))]
    known = [i for i in ids if i is not None]
    spare = max(known, default=0) + 1
    result = []
    for index, value in enumerate(ids):
        if value is None or index == background:
            value, spare = spare, spare + 1
        result.append(int(value))
    return result
