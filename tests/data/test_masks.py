"""Mask encodings (syncseg.data.masks): label maps over every dataset's own table, reduce_zero_label, colour-coded
masks equal to index masks, and the start-up look at a sample of masks (binary 0/255, grey levels, RGB)."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from PIL import Image

from syncseg import data
from syncseg.data.base import START_CHECK_MASKS, check_data_at_start
from syncseg.data.cityscapes import CityscapesSegmentation
from syncseg.data.masks import IGNORE, BadSampleError, MaskDecoder, suggested_label_map
from syncseg.engine.config import load_config
from tests.data.conftest import synthetic_pair, write_rgb

NUM_CLASSES = 4
COLOURS = np.array([(0, 0, 0), (200, 30, 30), (30, 200, 30), (30, 30, 200)], dtype=np.uint8)
UNLABELED_COLOUR = (255, 255, 255)
COLOUR_OVERRIDE = "data.class_colors=#000000:0,#c81e1e:1,#1ec81e:2,#1e1ec8:3,#ffffff:ignore"


def _folder(root, masks_by_name: dict, *, rgb: bool = False) -> None:
    """images/<name>.png beside masks/<name>.png holding `masks_by_name` (index, or colours with rgb)."""
    (root / "masks").mkdir(parents=True, exist_ok=True)
    for number, (name, mask) in enumerate(masks_by_name.items()):
        image, _ = synthetic_pair(number, max(mask.shape[:2]))
        write_rgb(root / "images" / f"{name}.png", image[:mask.shape[0], :mask.shape[1]])
        Image.fromarray(mask).save(root / "masks" / f"{name}.png")


def _dataset(root, *overrides: str, split: str = "all", train: bool = False):
    config = load_config("demo.yaml", ["data.dataset=folder", f"data.root={root}", f"data.num_classes={NUM_CLASSES}",
                                       "data.train_split=all", "data.val_split=all", *overrides])
    return data.build_dataset(config.data, split, train=train)


def _index_masks(count: int = 3, size: int = 24) -> dict:
    masks = {}
    for number in range(count):
        _, mask = synthetic_pair(number, size, num_classes=NUM_CLASSES)
        mask = mask.astype(np.uint8)
        mask[:2] = 255  # unlabeled rows
        masks[f"s{number}"] = mask
    return masks


def _coloured(mask: np.ndarray) -> np.ndarray:
    rgb = np.empty(mask.shape + (3,), dtype=np.uint8)
    rgb[mask == 255] = UNLABELED_COLOUR
    rgb[mask != 255] = COLOURS[mask[mask != 255]]
    return rgb


# ------------------------------------------------------------------------------- the one table
def test_label_map_entries_win_and_other_values_keep_their_reading():
    decoder = MaskDecoder(num_classes=3, ignore_index=255, raw_ignore=255, label_map=((255, 1), (7, IGNORE)))
    raw = np.array([[0, 1, 2, 7, 255]], dtype=np.uint8)
    assert decoder.to_labels(raw, "m.png").tolist() == [[0, 1, 2, 255, 1]]
    with pytest.raises(BadSampleError, match=r"mask 'm.png' has values \[3\] outside \[0, 2\] and != 255 .* and not "
                                             r"in data.label_map"):
        decoder.to_labels(np.array([[3]], dtype=np.uint8), "m.png")


def test_reduce_zero_label_reads_zero_as_ignored_and_k_as_class_k_minus_one():
    decoder = MaskDecoder(num_classes=3, ignore_index=255, raw_ignore=255, reduce_zero_label=True)
    assert decoder.to_labels(np.array([[0, 1, 2, 3, 255]], dtype=np.uint8), "m").tolist() == [[255, 0, 1, 2, 255]]
    with pytest.raises(BadSampleError, match=r"values \[4\] outside \[0, 3\]"):
        decoder.to_labels(np.array([[4]], dtype=np.uint8), "m")


def test_label_map_goes_over_a_dataset_s_own_table(cityscapes_root):
    root, masks = cityscapes_root
    plain = CityscapesSegmentation(root, "val")
    parking_as_road = CityscapesSegmentation(root, "val", label_map=((9, 0), (26, IGNORE)))
    name = plain.name_of(0)
    _, expected = plain.load(0)
    expected = expected.copy()
    expected[masks[name] == 9] = 0  # labelId 9 (parking) -> road, trainId 0
    expected[masks[name] == 26] = 255  # labelId 26 (car) -> ignored
    assert np.array_equal(parking_as_road.load(0)[1], expected) and (masks[name] == 9).any()


def test_folder_reduce_zero_label_and_label_map_through_the_config(tmp_path):
    masks = {"a": np.array([[0, 1, 2, 3, 4]] * 4, dtype=np.uint8)}
    _folder(tmp_path, masks)
    labels = _dataset(tmp_path, "data.reduce_zero_label=true")[0][1]
    assert labels[0].tolist() == [255, 0, 1, 2, 3]
    labels = _dataset(tmp_path, "data.label_map=4:3,0:ignore")[0][1]
    assert labels[0].tolist() == [255, 1, 2, 3, 3]


# ------------------------------------------------------------------------------- colour masks
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_colour_coded_masks_give_the_same_tensors_as_index_masks(tmp_path, train):
    masks = _index_masks()
    _folder(tmp_path / "index", masks)
    _folder(tmp_path / "colour", {name: _coloured(mask) for name, mask in masks.items()})
    index = _dataset(tmp_path / "index", "data.crop_size=20", train=train)
    colour = _dataset(tmp_path / "colour", "data.crop_size=20", COLOUR_OVERRIDE, train=train)
    for number in range(len(masks)):
        torch.manual_seed(number)  # the same augmentation draw for both
        image_a, mask_a = index[number]
        torch.manual_seed(number)
        image_b, mask_b = colour[number]
        assert torch.equal(mask_a, mask_b) and torch.equal(image_a, image_b)
    assert set(torch.unique(mask_a).tolist()) <= {0, 1, 2, 3, 255}


def test_a_palette_png_with_class_colors_is_read_by_its_colours(tmp_path):
    masks = _index_masks(1)
    _folder(tmp_path, masks)
    palette = np.zeros((256, 3), dtype=np.uint8)
    palette[:NUM_CLASSES], palette[255] = COLOURS, UNLABELED_COLOUR
    image = Image.fromarray(masks["s0"], mode="P")
    image.putpalette(palette.reshape(-1).tolist())
    image.save(tmp_path / "masks" / "s0.png")
    assert np.array_equal(_dataset(tmp_path, COLOUR_OVERRIDE)[0][1].numpy(), masks["s0"])


def test_an_unknown_colour_is_a_bad_sample_naming_the_file_and_the_colour(tmp_path):
    rgb = _coloured(_index_masks(1)["s0"])
    rgb[5, 5:8] = (12, 34, 56)
    _folder(tmp_path, {"odd": rgb})
    with pytest.raises(BadSampleError) as error:
        _dataset(tmp_path, COLOUR_OVERRIDE)[0]
    message = str(error.value)
    assert "odd.png' has colours not in data.class_colors: #0c2238 (12,34,56) (3 pixels)" in message
    assert "expected one of #000000 (0,0,0)" in message


def test_an_rgb_mask_without_class_colors_names_its_colours_and_the_key(tmp_path):
    _folder(tmp_path, {"rgb": _coloured(_index_masks(1)["s0"])})
    with pytest.raises(BadSampleError) as error:
        _dataset(tmp_path)[0]
    message = str(error.value)
    assert "rgb.png' is a colour image (RGB) holding #" in message and "(255,255,255)" in message
    assert "colour-coded masks need data.class_colors" in message and "single-channel index PNG" in message


# ------------------------------------------------------------------------ the start-up sample
def test_suggested_label_maps():
    assert suggested_label_map([0, 255], num_classes=2, raw_ignore=255) == {255: 1}
    assert suggested_label_map([0, 85, 170, 255], num_classes=4, raw_ignore=255) == {85: 1, 170: 2, 255: 3}
    assert suggested_label_map([0, 85, 170, 255], num_classes=3, raw_ignore=255) == {85: 1, 170: 2}
    assert suggested_label_map([0, 1, 2, 255], num_classes=3, raw_ignore=255) is None  # already classes
    assert suggested_label_map([0, 10, 20, 30, 40], num_classes=3, raw_ignore=255) is None  # more values than classes
    assert suggested_label_map([0, 9], num_classes=4, raw_ignore=255) is None  # fewer: which class is 9?


def test_binary_0_255_masks_with_two_classes_warn_with_the_fix(tmp_path, caplog):
    mask = np.zeros((16, 16), dtype=np.uint8)
    mask[4:10, 4:10] = 255
    _folder(tmp_path, {"a": mask, "b": mask[::-1].copy()})
    with caplog.at_level(logging.WARNING, logger="syncseg.data.base"):
        report = check_data_at_start(_dataset(tmp_path, "data.num_classes=2"))
    assert report.fix == "255:1" and len(report.warnings) == 1
    assert ("the 2 masks checked hold only the values 0 and 255, and with data.num_classes=2 the value 255 is "
            "data.ignore_index: those pixels are ignored") in caplog.text
    assert "set data.label_map: {255: 1} in the config (command line: data.label_map=255:1)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="syncseg.data.base"):
        assert check_data_at_start(_dataset(tmp_path, "data.num_classes=2", "data.label_map=255:1")).warnings == []
    assert caplog.text == ""


def test_grey_level_masks_fail_at_start_with_the_label_map_that_reads_them(tmp_path):
    grey = np.repeat(np.array([0, 85, 170, 255], dtype=np.uint8), 4)[None].repeat(8, axis=0)
    _folder(tmp_path, {"g1": grey, "g2": grey[:, ::-1].copy()})
    with pytest.raises(BadSampleError) as error:
        check_data_at_start(_dataset(tmp_path))
    assert str(error.value).endswith(
        "the 2 masks checked hold the values [0, 85, 170, 255] (2 bad, first "
        f"'{tmp_path / 'masks' / 'g1.png'}'), which skip classes (data.num_classes=4): grey-level-coded? map them "
        "with data.label_map: {85: 1, 170: 2, 255: 3} in the config (command line: data.label_map=85:1,170:2,255:3)")
    fixed = _dataset(tmp_path, "data.label_map=85:1,170:2,255:3")
    assert check_data_at_start(fixed).bad == [] and fixed[0][1][0, ::4].tolist() == [0, 1, 2, 3]
    # with a label map of their own the values are the user's: no guess (255 is class 1 here, not 3)
    grey[0, 0] = 7
    _folder(tmp_path, {"g1": grey})
    with pytest.raises(BadSampleError) as error:
        check_data_at_start(_dataset(tmp_path, "data.num_classes=2", "data.label_map=255:1"))
    assert "values [7, 85, 170]" in str(error.value) and "grey-level-coded?" not in str(error.value)
    # one mask read alone says what the values look like and how to map them
    with pytest.raises(BadSampleError, match=r"values \[7, 85, 170\] outside \[0, 3\] .* map each value to its "
                                             r"class with data.label_map"):
        _dataset(tmp_path)[0]


def test_the_start_up_check_reads_a_bounded_sample_spread_over_the_split(tmp_path, caplog):
    masks = {f"m{n:02d}": np.zeros((4, 4), dtype=np.uint8) for n in range(START_CHECK_MASKS + 8)}
    sampled = set(np.linspace(0, len(masks) - 1, START_CHECK_MASKS).round().astype(int).tolist())
    unsampled = min(set(range(len(masks))) - sampled)
    masks["m39"][0, 0] = 9  # the last sample: inside the spread sample
    masks[f"m{unsampled:02d}"][0, 0] = 9  # between two sampled masks: found later, by the loader
    _folder(tmp_path, masks)
    dataset = _dataset(tmp_path)
    report = dataset.inspect_masks(START_CHECK_MASKS)
    assert report.num_checked == START_CHECK_MASKS and report.bad_paths == [str(tmp_path / "masks" / "m39.png")]
    assert report.warnings == []  # 0 and 9 for 4 classes: no guess at which class 9 is
    with pytest.raises(BadSampleError, match=r"m39.png' has values \[9\] .*\(1 of 32 masks checked at start-up are "
                                             r"bad\)"):
        check_data_at_start(dataset)
    skipping = _dataset(tmp_path, "data.skip_bad_samples=true")
    with caplog.at_level(logging.WARNING, logger="syncseg.data.base"):
        check_data_at_start(skipping)
    assert "m39.png" in caplog.text and "data.skip_bad_samples=true skips such samples" in caplog.text
    assert check_data_at_start(data.build_dataset(load_config("demo.yaml").data, "val", train=False)) is None
