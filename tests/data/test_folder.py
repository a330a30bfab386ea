import numpy as np
import pytest
from PIL import Image

from syncseg import data
from syncseg.data.folder import FolderSegmentation
from syncseg.engine.config import DataConfig
from tests.data.conftest import synthetic_pair, write_rgb


def _make(root, names, subfolder=""):
    masks = {}
    for number, name in enumerate(names):
        image, mask = synthetic_pair(number, 24, num_classes=4)
        write_rgb(root / "images" / subfolder / f"{name}.png", image)
        (root / "masks" / subfolder).mkdir(parents=True, exist_ok=True)
        Image.fromarray(mask, mode="L").save(root / "masks" / subfolder / f"{name}.png")
        masks[name] = mask
    return masks


def test_list_file_split_and_all(tmp_path):
    masks = _make(tmp_path, ["a", "b", "c"])
    (tmp_path / "train.txt").write_text("c\na\n")
    cfg = DataConfig(dataset="folder", root=str(tmp_path), num_classes=4, class_names=("bg", "x", "y", "z"))
    dataset = data.build_dataset(cfg, "train", train=False)
    assert [dataset.name_of(i) for i in range(len(dataset))] == ["c", "a"]
    assert dataset.classes == ("bg", "x", "y", "z") and dataset.num_classes == 4
    assert np.array_equal(dataset[0][1].numpy(), masks["c"])
    everything = data.build_dataset(cfg, "all", train=False)
    assert len(everything) == 3


def test_subfolder_split_and_default_names(tmp_path):
    _make(tmp_path, ["p", "q"], subfolder="val")
    dataset = FolderSegmentation(tmp_path, "val", num_classes=4)
    assert len(dataset) == 2 and dataset.classes == ("class_0", "class_1", "class_2", "class_3")


def test_errors_name_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="images"):
        FolderSegmentation(tmp_path, "all", num_classes=3)
    _make(tmp_path, ["a"])
    with pytest.raises(FileNotFoundError, match="train.txt"):
        FolderSegmentation(tmp_path, "train", num_classes=4)
    (tmp_path / "train.txt").write_text("a\nmissing\n")
    with pytest.raises(FileNotFoundError, match="missing"):
        FolderSegmentation(tmp_path, "train", num_classes=4)
    assert len(FolderSegmentation(tmp_path, "train", num_classes=4, skip_bad_samples=True)) == 1
    # labels beyond num_classes are an error naming the mask
    dataset = FolderSegmentation(tmp_path, "all", num_classes=2)
    with pytest.raises(ValueError, match=r"a\.png"):
        for index in range(len(dataset)):
            dataset[index]
