"""Segmentation datasets (VOC, Cityscapes, synthetic, folder) and their albumentations pipelines.

Every dataset yields (image: uint8 tensor 3xHxW, mask: int64 tensor HxW, 255 = ignore) and carries
`classes`, `palette` (num_classes x 3 uint8), `num_classes`, `ignore_index` and `name_of(index)`.
Normalization happens later, on the device, with `data.transforms.normalize_batch`.
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from data.base import BadSampleError, SegmentationDataset, bit_palette, palette_image
from data.cityscapes import CityscapesSegmentation
from data.folder import FolderSegmentation
from data.synthetic import DEFAULT_NUM_CLASSES, SyntheticShapes
from data.transforms import build_eval_transform, build_train_transform, normalize_batch
from data.voc import VOCSegmentation

__all__ = [
    "BadSampleError", "CityscapesSegmentation", "FolderSegmentation", "SegmentationDataset", "SyntheticShapes",
    "VOCSegmentation", "bit_palette", "build_dataset", "normalize_batch", "palette_image", "seed_worker",
]

DATASETS = ("voc", "cityscapes", "synthetic", "folder")


def build_dataset(data_cfg: Any, split: str, *, train: bool) -> Dataset:
    """The dataset named by data_cfg.dataset for `split`, with the train (train=True) or eval pipeline.

    Raises FileNotFoundError naming the missing path and the expected layout, ValueError for bad settings.
    """
    transform = build_train_transform(data_cfg) if train else build_eval_transform(data_cfg)
    name = data_cfg.dataset
    skip = bool(getattr(data_cfg, "skip_bad_samples", False))
    fixed_classes = {"voc": 21, "cityscapes": 19}
    requested = int(getattr(data_cfg, "num_classes", 0))
    if name in fixed_classes and requested not in (0, fixed_classes[name]):
        raise ValueError(f"data.num_classes={requested} but dataset '{name}' has {fixed_classes[name]} classes; "
                         "leave data.num_classes at 0 (or use dataset 'folder' for a custom label set)")
    if name == "voc":
        return VOCSegmentation(data_cfg.root, split, transform=transform, skip_bad_samples=skip)
    if name == "cityscapes":
        return CityscapesSegmentation(data_cfg.root, split, transform=transform, skip_bad_samples=skip)
    if name == "folder":
        return FolderSegmentation(
            data_cfg.root, split, num_classes=int(data_cfg.num_classes), class_names=tuple(data_cfg.class_names),
            transform=transform, skip_bad_samples=skip,
        )
    if name == "synthetic":
        is_train_split = split == data_cfg.train_split
        return SyntheticShapes(
            int(data_cfg.synthetic_train_size if is_train_split else data_cfg.synthetic_val_size),
            int(data_cfg.synthetic_image_size),
            num_classes=int(data_cfg.num_classes) or DEFAULT_NUM_CLASSES,
            seed=int(data_cfg.seed),
            split=split,
            transform=transform,
        )
    raise ValueError(f"data.dataset={name!r} is not one of {', '.join(DATASETS)}")


def seed_worker(worker_id: int) -> None:
    """DataLoader worker_init_fn: seed numpy and `random` from the worker's torch seed.

    torch already gives each worker its own seed (base seed + worker id, the base drawn from the
    loader's generator), and the pipelines draw their randomness from torch; this extends the same
    per-worker seed to numpy / random for any user code in the worker. It deliberately does not call
    cv2.setNumThreads: in a forked worker whose parent already ran cv2's thread pool that call hangs.
    """
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)
