import numpy as np
import pytest
import torch
from PIL import Image

from syncseg import data
from syncseg.data.cityscapes import (
    CITYSCAPES_CLASSES,
    CITYSCAPES_PALETTE,
    LABELID_TO_TRAINID,
    TRAINID_TO_LABELID,
    CityscapesSegmentation,
)
from syncseg.engine.config import DataConfig

labels_module = pytest.importorskip("cityscapesscripts.helpers.labels")


def test_labelid_to_trainid_matches_official_definitions():
    official = labels_module.labels
    for label in official:
        if label.id < 0:  # license plate: never in the labelId PNGs
            continue
        expected = 255 if label.trainId in (255, -1) else label.trainId
        assert LABELID_TO_TRAINID[label.id] == expected, label.name
    listed = {label.id for label in official}
    for value in range(256):
        if value not in listed:
            assert LABELID_TO_TRAINID[value] == 255


def test_classes_palette_and_inverse_table_match_official_definitions():
    train_labels = sorted((l for l in labels_module.labels if l.trainId not in (255, -1)), key=lambda l: l.trainId)
    assert [l.trainId for l in train_labels] == list(range(19))
    assert CITYSCAPES_CLASSES == tuple(l.name for l in train_labels)
    assert [tuple(c) for c in CITYSCAPES_PALETTE.tolist()] == [tuple(l.color) for l in train_labels]
    for label in train_labels:
        assert TRAINID_TO_LABELID[label.trainId] == label.id
    assert TRAINID_TO_LABELID[255] == 0
    # round trip on every train id
    assert np.array_equal(LABELID_TO_TRAINID[TRAINID_TO_LABELID[np.arange(19)]], np.arange(19))


def test_loads_tree_and_maps_label_ids(cityscapes_root):
    root, masks = cityscapes_root
    dataset = data.build_dataset(DataConfig(dataset="cityscapes", root=str(root)), "train", train=False)
    assert len(dataset) == 3 and dataset.num_classes == 19 and dataset.palette.shape == (19, 3)
    names = [dataset.name_of(i) for i in range(len(dataset))]
    assert names == sorted(names) and names[0] == "aachen_000000_000019_leftImg8bit"
    for index, name in enumerate(names):
        image, mask = dataset[index]
        assert image.shape == (3, 32, 64) and image.dtype == torch.uint8
        expected = np.array([LABELID_TO_TRAINID[v] for v in masks[name].ravel()]).reshape(masks[name].shape)
        assert np.array_equal(mask.numpy(), expected)
    assert len(CityscapesSegmentation(root, "val")) == 2


def test_train_pipeline(cityscapes_root):
    root, _ = cityscapes_root
    dataset = data.build_dataset(DataConfig(dataset="cityscapes", root=str(root), crop_size=24), "train", train=True)
    torch.manual_seed(0)
    image, mask = dataset[1]
    assert image.shape == (3, 24, 24) and set(mask.unique().tolist()) <= set(range(19)) | {255}


def test_missing_folders_and_bad_label_ids(tmp_path, cityscapes_root):
    with pytest.raises(FileNotFoundError, match="leftImg8bit/<split>"):
        CityscapesSegmentation(tmp_path / "nope", "train")
    root, _ = cityscapes_root
    with pytest.raises(FileNotFoundError, match="gtFine"):
        CityscapesSegmentation(root, "test")
    mask_path = sorted((root / "gtFine" / "val").rglob("*_labelIds.png"))[0]
    bad = np.asarray(Image.open(mask_path)).copy()
    bad[0, 0] = 40
    Image.fromarray(bad, mode="L").save(mask_path)
    dataset = CityscapesSegmentation(root, "val")
    with pytest.raises(ValueError, match=r"values \[40\] outside \[0, 33\]") as error:
        dataset[0]
    assert mask_path.name in str(error.value)
