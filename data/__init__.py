"""Segmentation datasets (VOC, Cityscapes, ADE20K, synthetic, folder; the exports of annotation tools in
syncseg.data.annotations: COCO, labelme, CVAT, YOLO, Label Studio) and their albumentations pipelines.

Every dataset yields (image: uint8 tensor 3xHxW, mask: int64 tensor HxW, `ignore_index` = unlabeled;
a folder dataset's images are data.in_channels x H x W, uint16 above data.max_value 255: syncseg.data.images)
and carries `classes`, `palette` (num_classes x 3 uint8), `num_classes`, `ignore_index` and
`name_of(index)`. Normalization happens later, on the device, with `syncseg.data.transforms.normalize_batch`.
The kinds of data set (data.dataset) are syncseg.data.registry's.

Importing this package imports no heavy module: the names below load their module (torch, cv2,
albumentations) when first used, so the light modules (registry, constants, label_tables) stay light.
"""
from __future__ import annotations

import importlib
import os
from typing import Any

# albumentations asks PyPI for a newer version when it is imported (a 2 s timeout and a warning on
# every start without network). Nothing in syncseg may touch the network, so the check is switched
# off here, before syncseg.data.transforms imports albumentations (every import of a data module runs this
# file first). Set unconditionally: a user's own setting of the variable must not turn it back on.
os.environ["NO_ALBUMENTATIONS_UPDATE"] = "1"

from syncseg.data.constants import IGNORE  # noqa: E402

# name -> the module that defines it, imported on first access (PEP 562)
_LAZY = {
    "ADE20KSegmentation": "syncseg.data.ade20k", "CityscapesSegmentation": "syncseg.data.cityscapes",
    "FolderSegmentation": "syncseg.data.folder", "SyntheticShapes": "syncseg.data.synthetic",
    "VOCSegmentation": "syncseg.data.voc", "BadSampleError": "syncseg.data.masks",
    "SegmentationDataset": "syncseg.data.base", "check_data_at_start": "syncseg.data.base",
    "palette_image": "syncseg.data.base", "IGNORE_COLOR": "syncseg.data.palettes",
    "bit_palette": "syncseg.data.palettes", "palette_table": "syncseg.data.palettes",
    "build_dataset": "syncseg.data.registry", "normalize_batch": "syncseg.data.transforms",
}

__all__ = ["IGNORE", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'syncseg.data' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
