"""Tiny on-disk dataset trees (VOC, Cityscapes, ADE20K, folder) built from the synthetic generator."""
from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image

from syncseg.data.base import palette_image
from syncseg.data.synthetic import render_shapes
from syncseg.data.voc import VOC_PALETTE


def synthetic_pair(index: int, size: int = 48, *, num_classes: int = 6, seed: int = 123):
    rng = np.random.default_rng([seed, index])
    return render_shapes(rng, size, num_classes=num_classes)


def write_rgb(path: Path, image: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    assert cv2.imwrite(str(path), cv2.cvtColor(image, cv2.COLOR_RGB2BGR))


def write_image(path: Path, image: np.ndarray) -> None:
    """Save an H x W (x C) uint8 / uint16 image as its suffix says: .tif through tifffile (bands as
    samples), .png through cv2 (colour in RGB(A) order, as readers return it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".tif":
        import tifffile  # here: every data test loads this file, and only these tests need tifffile

        tifffile.imwrite(path, image, photometric="minisblack", planarconfig="contig" if image.ndim == 3 else None)
        return
    if image.ndim == 3 and image.shape[2] in (3, 4):
        image = image[..., [2, 1, 0, 3][: image.shape[2]]]  # cv2 writes BGR(A)
    assert cv2.imwrite(str(path), image)


def make_image_folder(root: Path, images: list[np.ndarray], *, suffix: str) -> list[np.ndarray]:
    """A folder dataset: images/<i><suffix> and masks/<i>.png, class 1 where the image's first channel is
    above its median; returns the masks."""
    masks = []
    for index, image in enumerate(images):
        write_image(root / "images" / f"{index}{suffix}", image)
        first = image if image.ndim == 2 else image[..., 0]
        masks.append((first > np.median(first)).astype(np.uint8))
        (root / "masks").mkdir(parents=True, exist_ok=True)
        Image.fromarray(masks[-1], mode="L").save(root / "masks" / f"{index}.png")
    return masks


def make_voc_tree(root: Path, *, train=("2007_000001", "2007_000002", "2007_000003"),
                  val=("2007_000010", "2007_000011"), aug=("2008_000100", "2007_000001")) -> dict:
    """A VOC2012 folder: JPEG images, palette-PNG masks (labels 0..20 plus a 255 border), split lists."""
    masks = {}
    for number, name in enumerate(sorted(set(train) | set(val) | set(aug))):
        image, mask = synthetic_pair(number, 40 + 4 * number)
        mask = (mask * 3 + number) % 21  # exercise labels beyond the synthetic 6
        mask = mask.astype(np.uint8)
        mask[:, :2] = 255  # VOC's "void" boundary
        write_rgb(root / "JPEGImages" / f"{name}.jpg", image)
        masks[name] = mask
        (root / "SegmentationClass").mkdir(parents=True, exist_ok=True)
        palette_image(mask, VOC_PALETTE).save(root / "SegmentationClass" / f"{name}.png")
        (root / "SegmentationClassAug").mkdir(parents=True, exist_ok=True)
        Image.fromarray(mask, mode="L").save(root / "SegmentationClassAug" / f"{name}.png")
    lists = root / "ImageSets" / "Segmentation"
    lists.mkdir(parents=True, exist_ok=True)
    (lists / "train.txt").write_text("".join(f"{n}\n" for n in train))
    (lists / "val.txt").write_text("".join(f"{n}\n" for n in val))
    (lists / "train_aug.txt").write_text("".join(f"{n}\n" for n in aug))
    return masks


def make_cityscapes_tree(root: Path, *, split_cities=None) -> dict:
    """leftImg8bit/gtFine PNGs with every labelId 0..33 present somewhere; returns {stem: labelId mask}."""
    split_cities = split_cities or {"train": {"aachen": 2, "bochum": 1}, "val": {"frankfurt": 2}}
    masks = {}
    number = 0
    for split, cities in split_cities.items():
        for city, count in cities.items():
            for k in range(count):
                stem = f"{city}_{k:06d}_000019"
                image, shapes = synthetic_pair(100 + number, 32)
                label_ids = ((np.arange(32 * 64).reshape(32, 64) + number) % 34).astype(np.uint8)
                label_ids[:, :32][shapes > 0] = 26  # some structure
                image = np.concatenate([image, image[:, ::-1]], axis=1)
                write_rgb(root / "leftImg8bit" / split / city / f"{stem}_leftImg8bit.png", image)
                path = root / "gtFine" / split / city / f"{stem}_gtFine_labelIds.png"
                path.parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(label_ids, mode="L").save(path)
                masks[f"{stem}_leftImg8bit"] = label_ids
                number += 1
    return masks


def make_ade20k_tree(root: Path, *, counts=None) -> dict:
    """ADEChallengeData2016 with JPEG images and single-channel annotations 0..150 (every raw value
    present in the training split); returns {stem: raw annotation}."""
    counts = counts or {"training": 3, "validation": 2}
    masks = {}
    for split, count in counts.items():
        prefix = "ADE_train" if split == "training" else "ADE_val"
        for index in range(count):
            stem = f"{prefix}_{index + 1:08d}"
            image, shapes = synthetic_pair(200 + index + 10 * len(masks), 24)
            raw = ((np.arange(24 * 32).reshape(24, 32) + 61 * index) % 151).astype(np.uint8)
            raw[:, :24][shapes > 0] = 0  # "other" where the shapes are
            write_rgb(root / "images" / split / f"{stem}.jpg", np.concatenate([image, image[:, :8]], axis=1))
            path = root / "annotations" / split / f"{stem}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(raw, mode="L").save(path)
            masks[stem] = raw
    return masks


@pytest.fixture
def voc_root(tmp_path):
    root = tmp_path / "VOCdevkit" / "VOC2012"
    masks = make_voc_tree(root)
    return root, masks


@pytest.fixture
def cityscapes_root(tmp_path):
    root = tmp_path / "cityscapes"
    masks = make_cityscapes_tree(root)
    return root, masks


@pytest.fixture
def ade20k_root(tmp_path):
    root = tmp_path / "ADEChallengeData2016"
    masks = make_ade20k_tree(root)
    return root, masks
