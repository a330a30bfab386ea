"""The round trip of every format: masks -> the format's writer (predict.py --format) -> the data set kind that
reads it -> the same masks. Exact for COCO and CVAT (RLE), labelme (polygons through boundary pixel centres,
holes as later shapes) and YOLO (holes joined by zero-width cuts); Label Studio through its brush RLE.
Ignored pixels are written as nothing, so they come back as the uncovered class (the background; in labelme an
ignored pixel inside a region comes back as the region's class: predictions have none)."""
import json

import numpy as np
import pytest

from syncseg import data
from syncseg.data.annotations import writers
from syncseg.data.annotations.codecs import encode_brush_rle
from syncseg.engine.config import DataConfig
from tests.data import annotation_exports as exports
from tests.data.test_annotation_writers import random_labels

CLASSES = ["background", "road", "car", "tree", "water"]
IGNORE = 255


def _masks(count=4, seed=0):
    rng = np.random.default_rng(seed)
    return {f"m{index}": random_labels(rng, 40 + 4 * index, 56) for index in range(count)}


def _read_back(kind, root, **settings):
    dataset = data.build_dataset(DataConfig(dataset=kind, root=str(root), train_split="all", **settings), "all",
                                 train=False)
    return dataset, {dataset.name_of(i): dataset.load(i)[1] for i in range(len(dataset))}


def _expected(labels):
    return np.where(labels == IGNORE, 0, labels)  # nothing written there: uncovered, the background


def _predictions(masks, root, folder):
    for number, (name, labels) in enumerate(masks.items()):
        exports.write_image(root / folder / f"{name}.jpg", number, height=labels.shape[0], width=labels.shape[1])
    return [writers.Prediction(file_name=f"{name}.jpg", labels=labels) for name, labels in masks.items()]


@pytest.mark.parametrize("kind", ["coco", "cvat", "labelme", "yolo_seg"])
def test_written_predictions_read_back_to_the_same_masks(tmp_path, kind):
    masks = _masks()
    assert any((m == IGNORE).any() for m in masks.values())
    if kind == "coco":
        predictions = _predictions(masks, tmp_path, "images")
        writers.write_coco(predictions, CLASSES, output=tmp_path / "annotations", background=0,
                           category_ids=[0, 11, 5, 30, 2])
        dataset, found = _read_back(kind, tmp_path, annotations="annotations/predictions.json")
        assert dataset.classes == ("background", "water", "car", "road", "tree")  # categories sorted by id
        order = [0, 3, 2, 4, 1]  # the reader's index of each of CLASSES
        masks = {name: np.asarray(order + [0] * 250 + [IGNORE], dtype=np.uint8)[labels] for name, labels in
                 masks.items()}
    elif kind == "cvat":
        predictions = _predictions(masks, tmp_path, "images")
        writers.write_cvat(predictions, CLASSES, output=tmp_path / "cvat", background=0)
        dataset, found = _read_back(kind, tmp_path, annotations="cvat/annotations.xml")
    elif kind == "labelme":
        predictions = _predictions(masks, tmp_path, "labelme")  # the images beside the JSON files, as labelme has
        writers.write_labelme(predictions, CLASSES, output=tmp_path / "labelme", background=0)
        dataset, found = _read_back(kind, tmp_path, annotations="labelme")
        assert dataset.classes == ("_background_", *CLASSES[1:])  # from the labels.txt written beside them
    else:
        predictions = _predictions(masks, tmp_path / "yolo", "images")
        writers.write_yolo_seg(predictions, CLASSES, output=tmp_path / "yolo", background=0)
        dataset, found = _read_back(kind, tmp_path / "yolo")
    if kind != "labelme":
        assert dataset.classes == tuple(CLASSES) or kind == "coco"
    assert sorted(found) == sorted(masks)
    for name, labels in masks.items():
        if kind == "labelme":  # an ignored pixel inside a region is written as part of it (writers' docstring)
            kept = labels != IGNORE
            np.testing.assert_array_equal(found[name][kept], labels[kept], err_msg=f"{kind} {name}")
            assert (found[name][labels == IGNORE] != IGNORE).all()
            continue
        np.testing.assert_array_equal(found[name], _expected(labels), err_msg=f"{kind} {name}")


def test_label_studio_brushes_read_back_to_the_same_masks(tmp_path):
    masks = _masks(count=3, seed=5)
    tasks = []
    for number, (name, labels) in enumerate(masks.items()):
        exports.write_image(tmp_path / "images" / f"{name}.jpg", number, height=labels.shape[0], width=labels.shape[1])
        height, width = labels.shape
        result = [{"id": f"{name}-{value}", "type": "brushlabels", "original_width": width, "original_height": height,
                   "value": {"format": "rle", "brushlabels": [CLASSES[value]],
                             "rle": encode_brush_rle(np.repeat((labels == value).reshape(-1).astype(np.uint8) * 255,
                                                               4))}}
                  for value in np.unique(labels) if 0 < value < len(CLASSES)]
        tasks.append({"id": number, "data": {"image": f"/data/upload/4/0a1b2c3d-{name}.jpg"},
                      "annotations": [{"id": number, "result": result}]})
    (tmp_path / "result.json").write_text(json.dumps(tasks))
    dataset, found = _read_back("label_studio", tmp_path, class_names=tuple(CLASSES))
    for name, labels in masks.items():
        np.testing.assert_array_equal(found[name], _expected(labels))
