import logging

import cv2
import numpy as np
import pytest
import torch
from PIL import Image

from syncseg import data
from syncseg.data.voc import VOC_CLASSES, VOC_PALETTE, VOCSegmentation
from syncseg.engine.config import DataConfig


def _cfg(root, **overrides):
    return DataConfig(dataset="voc", root=str(root), crop_size=32, **overrides)


def test_loads_val_split_through_build_dataset(voc_root):
    root, masks = voc_root
    dataset = data.build_dataset(_cfg(root), "val", train=False)
    assert len(dataset) == 2 and dataset.num_classes == 21 and dataset.classes == VOC_CLASSES
    assert dataset.ignore_index == 255 and dataset.palette.shape == (21, 3)
    for index, name in enumerate(("2007_000010", "2007_000011")):
        image, mask = dataset[index]
        assert dataset.name_of(index) == name
        assert image.dtype == torch.uint8 and mask.dtype == torch.int64
        # palette PNGs are read as indices (not colors), 255 kept as ignore
        assert np.array_equal(mask.numpy(), masks[name])
        # RGB order, same pixels as PIL's decoder of the same JPEG (decoders may differ by rounding)
        reference = np.asarray(Image.open(root / "JPEGImages" / f"{name}.jpg").convert("RGB"), dtype=np.int16)
        assert np.abs(image.permute(1, 2, 0).numpy().astype(np.int16) - reference).max() <= 3


def test_devkit_folder_and_train_aug_split(voc_root):
    root, masks = voc_root
    dataset = VOCSegmentation(root.parent, "train_aug")  # a VOCdevkit folder is accepted
    assert [dataset.name_of(i) for i in range(len(dataset))] == ["2008_000100", "2007_000001"]
    assert "SegmentationClassAug" in str(dataset.samples[0][1])
    assert np.array_equal(dataset[0][1].numpy(), masks["2008_000100"])


def test_train_pipeline_outputs_crops(voc_root):
    root, _ = voc_root
    dataset = data.build_dataset(_cfg(root), "train", train=True)
    torch.manual_seed(0)
    image, mask = dataset[0]
    assert image.shape == (3, 32, 32) and mask.shape == (32, 32)
    assert set(mask.unique().tolist()) <= set(range(21)) | {255}


def test_missing_root_and_split_name_path_and_layout(tmp_path, voc_root):
    with pytest.raises(FileNotFoundError, match="does not exist.*JPEGImages"):
        data.build_dataset(_cfg(tmp_path / "nowhere"), "train", train=True)
    with pytest.raises(FileNotFoundError, match="data.root is empty"):
        data.build_dataset(_cfg(""), "train", train=True)
    root, _ = voc_root
    with pytest.raises(FileNotFoundError, match=r"trainval\.txt.*ImageSets/Segmentation"):
        VOCSegmentation(root, "trainval")
    (root / "JPEGImages" / "2007_000002.jpg").unlink()
    with pytest.raises(FileNotFoundError, match="2007_000002.jpg"):
        VOCSegmentation(root, "train")
    assert len(VOCSegmentation(root, "train", skip_bad_samples=True)) == 2


def _corrupt(root, name, kind):
    if kind == "size":
        Image.fromarray(np.zeros((5, 5), dtype=np.uint8), mode="L").save(root / "SegmentationClass" / f"{name}.png")
    elif kind == "values":
        image = cv2.imread(str(root / "JPEGImages" / f"{name}.jpg"))
        mask = np.zeros(image.shape[:2], dtype=np.uint8)
        mask[3, 3] = 21
        Image.fromarray(mask, mode="L").save(root / "SegmentationClass" / f"{name}.png")
    elif kind == "image":
        (root / "JPEGImages" / f"{name}.jpg").write_bytes(b"not a jpeg")
    elif kind == "truncated":  # a download cut short: decoders would fill the rest in gray without a word
        path = root / "JPEGImages" / f"{name}.jpg"
        path.write_bytes(path.read_bytes()[:-200])
    elif kind == "rgb_mask":
        image = cv2.imread(str(root / "JPEGImages" / f"{name}.jpg"))
        Image.fromarray(image).save(root / "SegmentationClass" / f"{name}.png")


@pytest.mark.parametrize("kind, message", [
    ("size", "must match"), ("values", r"values \[21\] outside \[0, 20\]"),
    ("image", "cannot read image"), ("rgb_mask", "single-channel index PNG"), ("truncated", "truncated JPEG"),
])
def test_bad_samples_raise_naming_the_file_or_are_skipped(voc_root, kind, message, caplog):
    root, masks = voc_root
    _corrupt(root, "2007_000010", kind)
    dataset = VOCSegmentation(root, "val")
    with pytest.raises(ValueError, match=message) as error:
        dataset[0]
    assert "2007_000010" in str(error.value)
    skipping = VOCSegmentation(root, "val", skip_bad_samples=True)
    with caplog.at_level(logging.WARNING, logger="syncseg.data.base"):
        image, mask = skipping[0]
    assert np.array_equal(mask.numpy(), masks["2007_000011"])  # the next good sample
    assert skipping.num_skipped == 1 and "2007_000010" in caplog.text and "1 skipped" in caplog.text


def test_voc_palette_matches_devkit_colormap():
    # VOCdevkit VOClabelcolormap.m: bits of the class index go to R, G, B from the most significant bit.
    def devkit_color(index):
        r = g = b = 0
        c = index
        for j in range(8):
            r |= ((c >> 0) & 1) << (7 - j)
            g |= ((c >> 1) & 1) << (7 - j)
            b |= ((c >> 2) & 1) << (7 - j)
            c >>= 3
        return r, g, b

    assert [tuple(row) for row in VOC_PALETTE.tolist()] == [devkit_color(i) for i in range(21)]
    assert tuple(VOC_PALETTE[15]) == (192, 128, 128)  # person, as drawn in the VOC ground-truth PNGs


def test_palette_image_roundtrip(tmp_path):
    mask = np.array([[0, 1, 20], [255, 3, 0]], dtype=np.uint8)
    image = data.palette_image(mask, VOC_PALETTE)
    assert image.mode == "P"
    image.save(tmp_path / "m.png")
    reread = Image.open(tmp_path / "m.png")
    assert np.array_equal(np.asarray(reread), mask)
    rgb = np.asarray(reread.convert("RGB"))
    assert tuple(rgb[1, 0]) == (224, 224, 192) == data.IGNORE_COLOR  # ignore in VOC's cream, not background black
    assert tuple(rgb[0, 0]) == (0, 0, 0) and tuple(rgb[0, 2]) == tuple(VOC_PALETTE[20])
    # another ignore value (a folder dataset's data.ignore_index) gets the cream; 255 is then just unused
    other = np.asarray(data.palette_image(np.array([[7, 255]], dtype=np.uint8), VOC_PALETTE[:5], ignore_index=7)
                       .convert("RGB"))
    assert tuple(other[0, 0]) == data.IGNORE_COLOR and tuple(other[0, 1]) == (0, 0, 0)
    # an ignore value that is a class index keeps the class colour (predictions never hold ignore)
    assert tuple(data.palette_table(VOC_PALETTE, ignore_index=3)[3]) == tuple(VOC_PALETTE[3])
    with pytest.raises(ValueError, match="HxW"):
        data.palette_image(np.zeros((2, 2, 3), dtype=np.uint8), VOC_PALETTE)
