"""syncseg.data.annotations.writers: every format is read back the way its tool reads it (pycocotools, an XML
parser and the CVAT run lengths counted here, PIL as labelme2voc draws, cv2.fillPoly as YOLO's corner
convention fills) and compared with the predicted labels; the files are replaced atomically."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ElementTree

import cv2
import numpy as np
import pytest
import yaml
from PIL import Image, ImageDraw

from syncseg.data.annotations import writers
from syncseg.data.annotations.codecs import decode_cvat_rle, encode_cvat_rle
from syncseg.data.annotations.writers import (Prediction, trace_regions,
                                              write_coco, write_cvat, write_labelme, write_yolo_seg)

IGNORE = 255
# names YAML, JSON and XML must quote or encode: a colon, a YAML boolean, a non-ASCII letter
CLASSES = ["background", "road", "car: parked", "yes", "árbol"]
BACKGROUND = 0
CATEGORY_IDS = [0, 7, 3, 12, 40]  # a training file's ids: not contiguous, not in class order
UNCOVERED = 254  # the canvas where no shape is, when no class is background
# The polygon round trips (labelme through PIL, YOLO through cv2.fillPoly) may differ from the labels only on
# pixels within 1 pixel of a class boundary of the input, and on at most this fraction of an image: room for
# another Pillow's or OpenCV's edge rules. Measured (Pillow 13.0, OpenCV 5.0): 0 pixels for both formats, on
# these images and on 2,400 more from random_labels.
MISMATCH_FRACTION = 0.002


def random_labels(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Overlapping ellipses and rectangles of classes 1..4 on background, many with a hole (of background or
    of another class, some with an island in it), a one-pixel line, speckles of every class and ignore
    pixels: scattered ones, a block, and single ones inside regions."""
    labels = np.zeros((height, width), dtype=np.uint8)
    for _ in range(8):
        centre = (int(rng.integers(0, width)), int(rng.integers(0, height)))
        axes = (int(rng.integers(3, 16)), int(rng.integers(3, 16)))
        cv2.ellipse(labels, centre, axes, float(rng.uniform(0, 180)), 0, 360, int(rng.integers(1, 5)), -1)
        if rng.random() < 0.7:
            cv2.ellipse(labels, centre, (axes[0] // 2, axes[1] // 2), 0, 0, 360, int(rng.integers(0, 5)), -1)
            if rng.random() < 0.5:
                cv2.circle(labels, centre, 1, int(rng.integers(1, 5)), -1)
    for _ in range(3):
        x0, y0 = int(rng.integers(0, width - 4)), int(rng.integers(0, height - 4))
        x1, y1 = x0 + int(rng.integers(3, 20)), y0 + int(rng.integers(3, 20))
        cv2.rectangle(labels, (x0, y0), (x1, y1), int(rng.integers(1, 5)), -1)
        cv2.rectangle(labels, (x0 + 2, y0 + 2), (x1 - 2, y1 - 2), int(rng.integers(0, 5)), -1)
    cv2.line(labels, (0, int(rng.integers(0, height))), (width - 1, int(rng.integers(0, height))), 3, 1)
    speckles = rng.random((height, width))
    labels[speckles < 0.01] = rng.integers(0, 5, int((speckles < 0.01).sum()))
    labels[speckles > 0.99] = IGNORE
    x, y = int(rng.integers(0, width - 4)), int(rng.integers(0, height - 3))
    labels[y:y + 3, x:x + 4] = IGNORE
    return labels


def make_predictions(seed: int = 0) -> list[Prediction]:
    rng = np.random.default_rng(seed)
    nothing = np.full((12, 20), BACKGROUND, dtype=np.uint8)
    nothing[3:5, 4:9] = IGNORE
    return [Prediction("sub/a.jpg", random_labels(rng, 48, 64)), Prediction("b.png", random_labels(rng, 37, 53)),
            Prediction("deep/er/c.jpeg", random_labels(rng, 60, 41)), Prediction("empty.jpg", nothing)]


def rectangles_with_holes() -> np.ndarray:
    """Class 1 around a background hole that holds an island of class 2 (around a hole of class 3), a hole of
    class 3 and a hole of ignore pixels; a second region of class 1 beside it."""
    labels = np.zeros((40, 56), dtype=np.uint8)
    labels[5:32, 4:40] = 1
    labels[9:26, 9:30] = 0
    labels[13:22, 13:24] = 2
    labels[16:19, 16:20] = 3
    labels[27:30, 33:37] = 3
    labels[7:9, 33:36] = IGNORE
    labels[10:20, 45:52] = 1
    return labels


def class_table(labels: np.ndarray, background: int | None) -> list[int]:
    """The classes a writer writes for `labels`."""
    return [int(v) for v in np.unique(labels) if v != IGNORE and v != background]


def shoelace(ring: np.ndarray) -> float:
    """Twice the signed area of a closed ring of x, y points (positive: clockwise on screen, y down)."""
    return float(np.dot(ring[:, 0], np.roll(ring[:, 1], -1)) - np.dot(ring[:, 1], np.roll(ring[:, 0], -1)))


def near_boundary(labels: np.ndarray) -> np.ndarray:
    """Pixels with a differently labelled pixel among their 8 neighbours."""
    padded = np.pad(labels, 1, mode="edge")
    height, width = labels.shape
    return np.any([padded[dy:dy + height, dx:dx + width] != labels for dy in range(3) for dx in range(3)], axis=0)


def assert_close(drawn: np.ndarray, labels: np.ndarray) -> None:
    """The stated tolerance: mismatches (ignore pixels aside) only beside a class boundary, and few."""
    wrong = (drawn != labels) & (labels != IGNORE)
    assert not (wrong & ~near_boundary(labels)).any(), np.argwhere(wrong & ~near_boundary(labels))[:5]
    assert wrong.sum() <= MISMATCH_FRACTION * labels.size, int(wrong.sum())


def draw_labelme(document: dict, background: int | None) -> np.ndarray:
    """The shapes painted in file order as labelme2voc paints them (PIL, outline drawn)."""
    canvas = Image.new("L", (document["imageWidth"], document["imageHeight"]),
                       UNCOVERED if background is None else background)
    draw = ImageDraw.Draw(canvas)
    for shape in document["shapes"]:
        assert shape["shape_type"] == "polygon" and len(shape["points"]) >= 3
        value = background if shape["label"] == "_background_" else CLASSES.index(shape["label"])
        draw.polygon([tuple(point) for point in shape["points"]], fill=value, outline=value)
    return np.asarray(canvas)


def draw_yolo(text: str, names: list[str], shape: tuple[int, int], background: int | None) -> np.ndarray:
    """Each line filled in file order: normalized corner coordinates times the size, less half a pixel for
    cv2's pixel centres, at 1/16 pixel."""
    height, width = shape
    canvas = np.full(shape, UNCOVERED if background is None else background, dtype=np.uint8)
    for line in text.splitlines():
        number, *coordinates = line.split()
        assert all(len(value.split(".")[1]) == 6 for value in coordinates)
        points = np.array(coordinates, dtype=np.float64).reshape(-1, 2)
        assert points.min() >= 0 and points.max() <= 1
        fixed = np.round((points * (width, height) - 0.5) * 16).astype(np.int32)
        cv2.fillPoly(canvas, [fixed], CLASSES.index(names[int(number)]), lineType=cv2.LINE_8, shift=4)
    return canvas


# ------------------------------------------------------------------------------------------------ COCO
@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")  # pycocotools' decode, numpy 2
@pytest.mark.parametrize("background", [BACKGROUND, None])
def test_coco_rles_decode_to_the_masks_and_categories_keep_the_training_ids(tmp_path, background):
    from pycocotools import mask as coco_mask

    predictions = make_predictions(1)
    category_ids = CATEGORY_IDS if background is not None else None
    paths = write_coco(predictions, CLASSES, output=tmp_path, background=background, category_ids=category_ids)
    assert paths == [tmp_path / "predictions.json"]
    document = json.loads(paths[0].read_text(encoding="utf-8"))
    ids = CATEGORY_IDS if background is not None else [c + 1 for c in range(len(CLASSES))]
    written = [c for c in range(len(CLASSES)) if c != background]
    assert sorted((c["id"], c["name"]) for c in document["categories"]) == sorted((ids[c], CLASSES[c]) for c in written)
    class_of = {ids[c]: c for c in written}
    assert [image["id"] for image in document["images"]] == list(range(1, len(predictions) + 1))
    annotation_ids = [annotation["id"] for annotation in document["annotations"]]
    assert len(set(annotation_ids)) == len(annotation_ids)
    for image, prediction in zip(document["images"], predictions):
        labels = prediction.labels
        assert (image["file_name"], image["height"], image["width"]) == (prediction.file_name, *labels.shape)
        annotations = [a for a in document["annotations"] if a["image_id"] == image["id"]]
        assert sorted(class_of[a["category_id"]] for a in annotations) == class_table(labels, background)
        for annotation in annotations:
            mask = labels == class_of[annotation["category_id"]]
            assert np.array_equal(coco_mask.decode(annotation["segmentation"]).astype(bool), mask)
            ys, xs = np.nonzero(mask)
            assert annotation["area"] == mask.sum()
            assert annotation["bbox"] == [xs.min(), ys.min(), xs.max() - xs.min() + 1, ys.max() - ys.min() + 1]
            assert annotation["iscrowd"] == 0 and "score" not in annotation


# ------------------------------------------------------------------------------------------------ CVAT
def naive_cvat_runs(mask: np.ndarray) -> tuple[list[int], tuple[int, int, int, int]]:
    """CVAT's runs counted pixel by pixel over the mask's box, starting with a run of 0s; (left, top, w, h)."""
    ys, xs = np.nonzero(mask)
    left, top, right, bottom = xs.min(), ys.min(), xs.max(), ys.max()
    runs, value, length = [], False, 0
    for y in range(top, bottom + 1):
        for x in range(left, right + 1):
            if bool(mask[y, x]) != value:
                runs.append(length)
                value, length = not value, 0
            length += 1
    return runs + [length], (int(left), int(top), int(right - left + 1), int(bottom - top + 1))


def placed(box: np.ndarray, *, left: int, top: int, shape: tuple[int, int]) -> np.ndarray:
    """A decoded box's mask at (left, top) in an image of `shape`."""
    mask = np.zeros(shape, dtype=bool)
    mask[top:top + box.shape[0], left:left + box.shape[1]] = box
    return mask


def test_cvat_rle_agrees_with_a_naive_count():
    rng = np.random.default_rng(2)
    masks = [rng.random((23, 31)) < density for density in (0.05, 0.5, 0.95)]
    masks += [np.eye(9, dtype=bool), np.ones((5, 7), dtype=bool), np.pad(np.ones((1, 1), dtype=bool), ((3, 2), (4, 1)))]
    for mask in masks:
        rle, *box = encode_cvat_rle(mask)
        runs, naive_box = naive_cvat_runs(mask)
        assert ([int(run) for run in rle.split(",")], tuple(box)) == (runs, naive_box)
        left, top, width, height = naive_box
        decoded = placed(decode_cvat_rle(", ".join(map(str, runs)), width=width, height=height), left=left, top=top,
                         shape=mask.shape)
        assert np.array_equal(decoded, mask)
    with pytest.raises(ValueError, match="sum to 11"):
        decode_cvat_rle("3, 4, 4", width=3, height=4)
    with pytest.raises(ValueError, match="0 pixels"):
        encode_cvat_rle(np.zeros((3, 3), dtype=bool))


def test_cvat_masks_decode_to_the_class_masks(tmp_path):
    predictions = make_predictions(3)
    assert write_cvat(predictions, CLASSES, output=tmp_path, background=BACKGROUND) == [tmp_path / "annotations.xml"]
    root = ElementTree.parse(tmp_path / "annotations.xml").getroot()
    assert root.tag == "annotations" and root.findtext("version") == "1.1"
    assert [label.findtext("name") for label in root.find("meta/task/labels")] == CLASSES[1:]
    images = root.findall("image")
    assert [image.get("id") for image in images] == [str(i) for i in range(len(predictions))]
    for image, prediction in zip(images, predictions):
        labels = prediction.labels
        assert (image.get("name"), int(image.get("height")), int(image.get("width"))) == (prediction.file_name,
                                                                                           *labels.shape)
        masks = image.findall("mask")
        assert sorted(CLASSES.index(mask.get("label")) for mask in masks) == class_table(labels, BACKGROUND)
        for mask in masks:
            assert (mask.get("source"), mask.get("occluded"), mask.get("z_order")) == ("auto", "0", "0")
            box = {key: int(mask.get(key)) for key in ("left", "top", "width", "height")}
            expected = labels == CLASSES.index(mask.get("label"))
            assert tuple(box.values()) == naive_cvat_runs(expected)[1]
            decoded = decode_cvat_rle(mask.get("rle"), width=box["width"], height=box["height"])
            assert np.array_equal(placed(decoded, left=box["left"], top=box["top"], shape=labels.shape), expected)


# ------------------------------------------------------------------------------------------------ labelme
@pytest.mark.parametrize("background", [BACKGROUND, None])
def test_labelme_shapes_paint_back_the_labels(tmp_path, background):
    predictions = make_predictions(4)
    paths = write_labelme(predictions, CLASSES, output=tmp_path, background=background)
    jsons = [tmp_path / "sub/a.json", tmp_path / "b.json", tmp_path / "deep/er/c.json", tmp_path / "empty.json"]
    assert paths == jsons + [tmp_path / "labels.txt"]
    assert (tmp_path / "labels.txt").read_text(encoding="utf-8").splitlines() == (
        ["__ignore__", "_background_"] + [name for c, name in enumerate(CLASSES) if c != background])
    for path, prediction in zip(jsons, predictions):
        document = json.loads(path.read_text(encoding="utf-8"))
        assert (document["version"], document["flags"], document["imageData"]) == ("5.5.0", {}, None)
        assert document["imagePath"] == prediction.file_name.rsplit("/", 1)[-1]
        assert (document["imageHeight"], document["imageWidth"]) == prediction.labels.shape
        labels = prediction.labels
        drawn = draw_labelme(document, background)
        assert_close(drawn, labels)
        # a single ignore pixel amid one class is a hole of that class's region: painted with it
        padded = np.pad(labels, 1, mode="edge")
        for y, x in np.argwhere(labels == IGNORE):
            around = np.delete(padded[y:y + 3, x:x + 3].ravel(), 4)
            if len(set(around.tolist())) == 1 and around[0] not in (IGNORE, background):
                assert drawn[y, x] == around[0]
    assert not json.loads(jsons[-1].read_text())["shapes"] or background is None


def test_labelme_holes_are_exact_for_rectangles(tmp_path):
    labels = rectangles_with_holes()
    write_labelme([Prediction("r.png", labels)], CLASSES, output=tmp_path, background=BACKGROUND)
    document = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    drawn = draw_labelme(document, BACKGROUND)
    assert np.array_equal(drawn[labels != IGNORE], labels[labels != IGNORE])
    assert (drawn[labels == IGNORE] == 1).all()  # inside the region around them
    order = [shape["label"] for shape in document["shapes"]]  # around before inside: 1, the hole, 2, its hole 3
    last_3 = len(order) - 1 - order[::-1].index(CLASSES[3])
    assert order.count("_background_") == 1
    assert order.index(CLASSES[1]) < order.index("_background_") < order.index(CLASSES[2]) < last_3


def test_labelme_regions_crossing_at_a_diagonal_are_exact(tmp_path):
    labels = np.zeros((14, 16), dtype=np.uint8)
    labels[1:6, 1:6] = 2  # a ring of class 2 closed by a diagonal step only ...
    labels[2:5, 2:5] = 0
    labels[5, 1] = 0  # ... so its inside touches the outside background at a corner
    labels[7:13, 7:13] = 3  # a ring of class 3 that a diagonal line of class 1 crosses at a diagonal step
    labels[8:12, 8:12] = 4
    for step in range(6):
        labels[7 + step, 12 - step] = 1
    labels[7, 11], labels[6, 12] = 3, 1
    write_labelme([Prediction("x.png", labels)], CLASSES, output=tmp_path, background=BACKGROUND)
    drawn = draw_labelme(json.loads((tmp_path / "x.json").read_text(encoding="utf-8")), BACKGROUND)
    assert np.array_equal(drawn, labels)


# ------------------------------------------------------------------------------------------------ YOLO
@pytest.mark.parametrize("background", [BACKGROUND, None])
def test_yolo_polygons_fill_back_the_labels(tmp_path, background):
    predictions = make_predictions(5)
    paths = write_yolo_seg(predictions, CLASSES, output=tmp_path, background=background)
    texts = [tmp_path / "labels/sub/a.txt", tmp_path / "labels/b.txt", tmp_path / "labels/deep/er/c.txt",
             tmp_path / "labels/empty.txt"]
    assert paths == texts + [tmp_path / "data.yaml"]
    names = yaml.safe_load((tmp_path / "data.yaml").read_text(encoding="utf-8"))["names"]
    assert names == [name for c, name in enumerate(CLASSES) if c != background]
    for path, prediction in zip(texts, predictions):
        labels = prediction.labels
        drawn = draw_yolo(path.read_text(encoding="utf-8"), names, labels.shape, background)
        assert_close(drawn, labels)
        # holes are kept, those of ignore pixels too: no ignore pixel is painted
        assert (drawn[labels == IGNORE] == (UNCOVERED if background is None else background)).all()
    assert texts[-1].read_text() == "" or background is None


def test_yolo_region_with_holes_is_one_polygon_that_leaves_them_unfilled(tmp_path):
    labels = rectangles_with_holes()
    write_yolo_seg([Prediction("r.png", labels)], CLASSES, output=tmp_path, background=BACKGROUND)
    lines = (tmp_path / "labels/r.txt").read_text().splitlines()
    assert sorted(int(line.split()[0]) + 1 for line in lines) == [1, 1, 2, 3, 3]  # ids: classes shifted down
    unholed = labels.copy()
    unholed[unholed == IGNORE] = 0
    assert np.array_equal(draw_yolo("\n".join(lines), CLASSES[1:], labels.shape, BACKGROUND), unholed)
    for line in lines:  # each polygon paints pixels of its own class only
        value = int(line.split()[0]) + 1
        assert not ((draw_yolo(line, CLASSES[1:], labels.shape, BACKGROUND) == value) & (labels != value)).any()
    outer = max(lines, key=len)  # the first class-1 region, its three holes joined
    assert (draw_yolo(outer, CLASSES[1:], labels.shape, BACKGROUND)[9:26, 9:30] == 0).all()
    assert (draw_yolo(outer, CLASSES[1:], labels.shape, BACKGROUND)[7:9, 33:36] == 0).all()


# ------------------------------------------------------------------------------------------------ tracing
def test_trace_regions_rings_fill_back_the_mask():
    rng = np.random.default_rng(6)
    for density in (0.3, 0.5, 0.7):
        mask = cv2.resize(rng.random((9, 12)), (48, 36), interpolation=cv2.INTER_CUBIC) < density
        mask |= rng.random(mask.shape) < 0.03
        count, _ = cv2.connectedComponents(mask.astype(np.uint8), connectivity=8)
        regions = trace_regions(mask, corners=True)
        assert len(regions) == count - 1 and len(trace_regions(mask)) == count - 1
        rings = [ring for outer, holes in regions for ring in [outer, *holes]]
        filled = np.zeros(mask.shape, dtype=np.uint8)
        cv2.fillPoly(filled, [np.round((ring - 0.5) * 16).astype(np.int32) for ring in rings], 1, shift=4)
        assert np.array_equal(filled.astype(bool), mask)
        assert all(shoelace(outer) > 0 and all(shoelace(hole) < 0 for hole in holes) for outer, holes in regions)
        # pixel centres: the outer rings painted by PIL cover the regions and their (4-connected) holes
        canvas = Image.new("L", mask.shape[::-1], 0)
        for outer, _ in trace_regions(mask):
            points = [tuple(point) for point in outer.tolist()]
            ImageDraw.Draw(canvas).polygon(points + points[-1:] * 2, fill=1, outline=1)
        _, outside = cv2.connectedComponents(np.pad(~mask, 1, constant_values=True).astype(np.uint8), connectivity=4)
        assert np.array_equal(np.asarray(canvas).astype(bool), (outside != outside[0, 0])[1:-1, 1:-1])


def test_tolerance_simplifies_the_polygons_within_it(tmp_path):
    labels = np.zeros((60, 80), dtype=np.uint8)
    cv2.ellipse(labels, (40, 30), (30, 20), 20, 0, 360, 1, -1)
    cv2.ellipse(labels, (42, 28), (10, 6), 0, 0, 360, 0, -1)
    near = cv2.dilate(near_boundary(labels).astype(np.uint8), np.ones((5, 5), np.uint8)).astype(bool)
    prediction = [Prediction("e.png", labels)]
    for tolerance in (0.0, 1.5):
        write_yolo_seg(prediction, CLASSES, output=tmp_path / str(tolerance), background=0, tolerance=tolerance)
        write_labelme(prediction, CLASSES, output=tmp_path / str(tolerance), background=0, tolerance=tolerance)
    exact, simplified = ((tmp_path / str(t) / "labels/e.txt").read_text() for t in (0.0, 1.5))
    assert len(simplified.split()) < len(exact.split()) / 2
    drawn = draw_yolo(simplified, CLASSES[1:], labels.shape, 0)
    assert not ((drawn != labels) & ~near).any() and (drawn[28, 42], drawn[30, 15]) == (0, 1)
    shapes = [json.loads((tmp_path / str(t) / "e.json").read_text())["shapes"] for t in (0.0, 1.5)]
    assert sum(len(s["points"]) for s in shapes[1]) < sum(len(s["points"]) for s in shapes[0]) / 2
    drawn = draw_labelme({"imageWidth": 80, "imageHeight": 60, "shapes": shapes[1]}, 0)
    assert not ((drawn != labels) & ~near).any() and (drawn[28, 42], drawn[30, 15]) == (0, 1)


# ------------------------------------------------------------------------------------------------ files
WRITERS = {"coco": (write_coco, "predictions.json", {"category_ids": CATEGORY_IDS}),
           "labelme": (write_labelme, "sub/a.json", {}), "cvat": (write_cvat, "annotations.xml", {}),
           "yolo": (write_yolo_seg, "labels/sub/a.txt", {})}


@pytest.mark.parametrize("format_name", sorted(WRITERS))
def test_files_are_replaced_whole_or_not_at_all(tmp_path, monkeypatch, format_name):
    writer, name, options = WRITERS[format_name]
    target = tmp_path / name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(b"\0" * 100_000)  # longer than its replacement: a file rewritten in place keeps a tail
    predictions = make_predictions(7)
    assert target in writer(predictions, CLASSES, output=tmp_path, background=BACKGROUND, **options)
    written = target.read_bytes()
    # into an empty folder, from a one-pass iterator (the predictions are read once): the same content
    writer(iter(predictions), CLASSES, output=tmp_path / "fresh", background=BACKGROUND, **options)
    assert written == (tmp_path / "fresh" / name).read_bytes()

    # new content for every image, and a prediction with a value that is no class last: nothing is written
    changed = [Prediction(p.file_name, np.where(p.labels == IGNORE, IGNORE, (p.labels + 1) % 5).astype(np.uint8))
               for p in predictions]
    bad = np.zeros((6, 6), dtype=np.uint8)
    bad[2, 3] = 7
    with pytest.raises(ValueError, match=r"sub/bad\.jpg: label value 7 "):
        writer(changed + [Prediction("sub/bad.jpg", bad)], CLASSES, output=tmp_path, background=BACKGROUND,
               **options)
    assert target.read_bytes() == written

    def crash(source, destination):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writers.os, "replace", crash)  # the rename never happens
    with pytest.raises(OSError, match="No space"):
        writer(changed, CLASSES, output=tmp_path, background=BACKGROUND, **options)
    assert target.read_bytes() == written
    assert not list(tmp_path.rglob("*.tmp"))


def test_bad_inputs_are_refused_before_anything_is_written(tmp_path):
    image = Prediction("a.jpg", np.zeros((4, 5), dtype=np.uint8))
    with pytest.raises(ValueError, match="ignore_index 3 is also class 'yes'"):
        write_cvat([image], CLASSES, output=tmp_path, background=0, ignore_index=3)
    with pytest.raises(ValueError, match=r"category_ids \[1, 2, 2, 3, 4\]"):
        write_coco([image], CLASSES, output=tmp_path, background=0, category_ids=[1, 2, 2, 3, 4])
    with pytest.raises(ValueError, match="background 5"):
        write_coco([image], CLASSES, output=tmp_path, background=5)
    with pytest.raises(ValueError, match=r"file_name '\.\./a\.jpg'"):
        write_labelme([Prediction("../a.jpg", image.labels)], CLASSES, output=tmp_path, background=0)
    with pytest.raises(ValueError, match="'a.png' and 'a.jpg'"):
        write_yolo_seg([image, Prediction("a.png", image.labels)], CLASSES, output=tmp_path, background=0)
    with pytest.raises(ValueError, match="file_name 'a.jpg'"):
        write_coco([image, image], CLASSES, output=tmp_path, background=0)
    with pytest.raises(ValueError, match="a.jpg: labels of float64"):
        write_cvat([Prediction("a.jpg", np.zeros((4, 5)))], CLASSES, output=tmp_path, background=0)
    with pytest.raises(ValueError, match="'_background_' is labelme's own name"):
        write_labelme([image], ["bg", "_background_"], output=tmp_path, background=0)
    assert not list(tmp_path.iterdir())
