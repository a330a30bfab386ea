"""ADE20K on a generated tree with the ADEChallengeData2016 layout: splits, the reduced labels, errors,
verify_dataset's counts and the config recipe."""
import importlib

import numpy as np
import pytest
from PIL import Image

from syncseg import data
from syncseg.data.ade20k import ADE20K_CLASSES, ADE20K_PALETTE, CLASS_TO_RAW, RAW_TO_CLASS, ADE20KSegmentation
from syncseg.data.base import BadSampleError
from syncseg.engine.config import DataConfig
from syncseg.engine.config import load_config


def test_classes_and_palette_are_the_benchmarks_150():
    assert len(ADE20K_CLASSES) == len(set(ADE20K_CLASSES)) == 150 and ADE20K_PALETTE.shape == (150, 3)
    # spot checks against objectInfo150 (index = raw value - 1) and color150
    assert ADE20K_CLASSES[:4] == ("wall", "building", "sky", "floor") and ADE20K_CLASSES[-1] == "flag"
    assert ADE20K_CLASSES[12] == "person" and ADE20K_CLASSES[20] == "car" and ADE20K_CLASSES[44] == "chest of drawers"
    assert ADE20K_PALETTE[0].tolist() == [120, 120, 120] and ADE20K_PALETTE[149].tolist() == [92, 0, 255]
    assert ADE20K_PALETTE[12].tolist() == [150, 5, 61]


def test_raw_labels_shift_down_by_one_and_other_is_ignored(ade20k_root):
    root, masks = ade20k_root
    dataset = ADE20KSegmentation(root, "training")
    assert len(dataset) == 3 and dataset.num_classes == 150 and dataset.split == "training"
    assert [dataset.name_of(i) for i in range(3)] == [f"ADE_train_{i:08d}" for i in (1, 2, 3)]
    seen = set()
    for index in range(len(dataset)):
        image, mask = dataset[index]
        raw = masks[dataset.name_of(index)]
        expected = np.where(raw == 0, 255, raw.astype(np.int64) - 1)
        assert image.shape == (3, 24, 32) and np.array_equal(mask.numpy(), expected)
        seen |= set(raw.ravel().tolist())
    assert seen == set(range(151))  # every raw value took part
    # the tables: what the dataset applies, and its inverse for the benchmark's prediction format
    assert RAW_TO_CLASS[0] == 255 and RAW_TO_CLASS[1] == 0 and RAW_TO_CLASS[150] == 149
    assert np.array_equal(CLASS_TO_RAW[RAW_TO_CLASS[1:151]], np.arange(1, 151))


def test_train_and_val_name_the_official_folders_and_the_root_may_be_the_parent(ade20k_root):
    root, _ = ade20k_root
    assert ADE20KSegmentation(root, "train").samples == ADE20KSegmentation(root, "training").samples
    assert len(ADE20KSegmentation(root.parent, "val")) == 2  # the folder holding ADEChallengeData2016
    built = data.build_dataset(DataConfig(dataset="ade20k", root=str(root), crop_size=(16, 20)), "train", train=True)
    image, mask = built[0]
    assert image.shape == (3, 16, 20) and mask.shape == (16, 20) and int(mask.max()) <= 255


def test_errors_name_the_file_or_folder_and_the_layout(ade20k_root, tmp_path):
    root, _ = ade20k_root
    with pytest.raises(FileNotFoundError, match="images/test' not found.*ADEChallengeData2016"):
        ADE20KSegmentation(root, "test")
    with pytest.raises(FileNotFoundError, match="data.root is empty for dataset 'ade20k'"):
        ADE20KSegmentation("", "training")
    bad = root / "annotations" / "training" / "ADE_train_00000002.png"
    Image.fromarray(np.full((24, 32), 151, dtype=np.uint8), mode="L").save(bad)
    with pytest.raises(BadSampleError, match=r"ADE_train_00000002.png' has values \[151\] outside \[0, 150\]"):
        ADE20KSegmentation(root, "training")[1]
    bad.unlink()
    with pytest.raises(FileNotFoundError, match="ADE_train_00000002.png"):
        ADE20KSegmentation(root, "training")
    assert len(ADE20KSegmentation(root, "training", skip_bad_samples=True)) == 2


def test_recipe_and_verify_dataset_report_the_official_counts(ade20k_root, capsys):
    root, masks = ade20k_root
    config = load_config("ade20k.yaml", [f"data.root={root}"])
    assert (config.data.train_split, config.data.val_split) == ("training", "validation")
    verify = importlib.import_module("syncseg.commands.verify_dataset")
    assert verify.main(["--config", "ade20k.yaml", f"data.root={root}"]) == 0
    text = capsys.readouterr().out
    assert "[ade20k training] 3 samples (INCOMPLETE: the full split has 20210)" in text
    assert "[ade20k validation] 2 samples (INCOMPLETE: the full split has 2000)" in text
    other = sum(int((raw == 0).sum()) for stem, raw in masks.items() if stem.startswith("ADE_val"))
    assert f"ignore (255) pixels {other}" in text
    # the aliases find the same expected counts
    assert verify.main(["--config", "ade20k.yaml", f"data.root={root}", "--splits", "val"]) == 0
    assert "[ade20k val] 2 samples (INCOMPLETE: the full split has 2000)" in capsys.readouterr().out
