"""Segmentation datasets (VOC, Cityscapes, ADE20K, synthetic, folder) and their albumentations pipelines.

Every dataset yields (image: uint8 tensor 3xHxW, mask: int64 tensor HxW, `ignore_index` = unlabeled;
a folder dataset's images are data.in_channels x H x W, uint16 above data.max_value 255: syncseg.data.images)
and carries `classes`, `palette` (num_classes x 3 uint8), `num_classes`, `ignore_index` and
`name_of(index)`. Normalization happens later, on the device, with `syncseg.data.transforms.normalize_batch`.
"""
from __future__ import annotations

import os

# albumentations asks PyPI for a newer version when it is imported (a 2 s timeout and a warning on
# every start without network). Nothing in syncseg may touch the network, so the check is switched
# off here, before syncseg.data.transforms imports albumentations (every import of a data module runs this
# file first). Set unconditionally: a user's own setting of the variable must not turn it back on.
os.environ["NO_ALBUMENTATIONS_UPDATE"] = "1"

from typing import Any, Callable  # noqa: E402

from torch.utils.data import Dataset  # noqa: E402

from syncseg.data.ade20k import ADE20K_CLASSES, ADE20KSegmentation  # noqa: E402
from syncseg.data.base import (IGNORE_COLOR, BadSampleError, SegmentationDataset, bit_palette, check_masks_at_start,  # noqa: E402
                       palette_image, palette_table)
from syncseg.data.cityscapes import CITYSCAPES_CLASSES, CityscapesSegmentation  # noqa: E402
from syncseg.data.folder import FolderSegmentation  # noqa: E402
from syncseg.data.images import ImageFormat  # noqa: E402
from syncseg.data.masks import IGNORE  # noqa: E402
from syncseg.data.synthetic import DEFAULT_NUM_CLASSES, SyntheticShapes  # noqa: E402
from syncseg.data.transforms import PairTransform, build_eval_transform, build_train_transform, normalize_batch  # noqa: E402
from syncseg.data.voc import VOC_CLASSES, VOCSegmentation  # noqa: E402

__all__ = [
    "ADE20KSegmentation", "FIXED_NUM_CLASSES", "IGNORE", "IGNORE_COLOR", "BadSampleError", "CityscapesSegmentation",
    "FolderSegmentation", "SegmentationDataset", "SyntheticShapes", "VOCSegmentation", "bit_palette", "build_dataset",
    "check_masks_at_start", "normalize_batch", "palette_image", "palette_table",
]

# the class count of each dataset whose class list comes with it (syncseg.engine.config checks label maps against it)
FIXED_NUM_CLASSES = {"voc": len(VOC_CLASSES), "cityscapes": len(CITYSCAPES_CLASSES), "ade20k": len(ADE20K_CLASSES)}


def _mask_encoding(data_cfg: Any) -> dict[str, Any]:
    """data.label_map and data.class_colors, as every file-backed dataset takes them."""
    return {"label_map": data_cfg.label_map, "class_colors": data_cfg.class_colors}


def _voc(data_cfg: Any, split: str, transform: PairTransform) -> Dataset:
    return VOCSegmentation(data_cfg.root, split, ignore_index=data_cfg.ignore_index, transform=transform,
                           skip_bad_samples=data_cfg.skip_bad_samples, **_mask_encoding(data_cfg))


def _cityscapes(data_cfg: Any, split: str, transform: PairTransform) -> Dataset:
    return CityscapesSegmentation(data_cfg.root, split, ignore_index=data_cfg.ignore_index, transform=transform,
                                  skip_bad_samples=data_cfg.skip_bad_samples, **_mask_encoding(data_cfg))


def _ade20k(data_cfg: Any, split: str, transform: PairTransform) -> Dataset:
    return ADE20KSegmentation(data_cfg.root, split, ignore_index=data_cfg.ignore_index, transform=transform,
                              skip_bad_samples=data_cfg.skip_bad_samples, **_mask_encoding(data_cfg))


def _folder(data_cfg: Any, split: str, transform: PairTransform) -> Dataset:
    return FolderSegmentation(data_cfg.root, split, num_classes=data_cfg.num_classes,
                              class_names=tuple(data_cfg.class_names), ignore_index=data_cfg.ignore_index,
                              transform=transform, skip_bad_samples=data_cfg.skip_bad_samples,
                              reduce_zero_label=data_cfg.reduce_zero_label, image_format=ImageFormat.of(data_cfg),
                              **_mask_encoding(data_cfg))


def _synthetic(data_cfg: Any, split: str, transform: PairTransform) -> Dataset:
    is_train_split = split == data_cfg.train_split
    return SyntheticShapes(
        data_cfg.synthetic_train_size if is_train_split else data_cfg.synthetic_val_size,
        data_cfg.synthetic_image_size,
        num_classes=data_cfg.num_classes or DEFAULT_NUM_CLASSES,
        seed=data_cfg.seed,
        split=split,
        ignore_index=data_cfg.ignore_index,
        transform=transform,
    )


# data.dataset -> constructor; the names are syncseg.engine.config's data.dataset choices
DATASETS: dict[str, Callable[[Any, str, PairTransform], Dataset]] = {
    "voc": _voc, "cityscapes": _cityscapes, "ade20k": _ade20k, "synthetic": _synthetic, "folder": _folder,
}


def build_dataset(data_cfg: Any, split: str, *, train: bool) -> Dataset:
    """The dataset named by a validated `data` config section for `split`, with the train (train=True)
    or eval pipeline. Raises FileNotFoundError naming the missing path and the expected layout."""
    transform = build_train_transform(data_cfg) if train else build_eval_transform(data_cfg)
    return DATASETS[data_cfg.dataset](data_cfg, split, transform)
