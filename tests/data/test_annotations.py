"""The annotation kinds against independent references (tests/data/annotation_exports.py): pycocotools' COCO API,
labelme2voc's drawing, CVAT's z-order, pixel-centre tests of YOLO polygons, Label Studio's own brush encoding;
and their bad input, one line naming the file and the annotation."""
import json

import numpy as np
import pytest

from syncseg import data
from syncseg.data.annotations.codecs import decode_brush_rle, decode_cvat_rle, encode_brush_rle
from syncseg.data.annotations.common import AnnotationError
from syncseg.data.annotations.problems import self_intersection
from syncseg.data.annotations.shapes import Shape, shape_mask
from syncseg.data.masks import BadSampleError
from syncseg.engine.config import DataConfig
from tests.data import annotation_exports as exports

IGNORE = 255
LOOP = [[0, 0], [20, 0], [20, 20], [5, 20], [5, 5], [25, 5], [25, 25], [0, 25]]  # winds twice around (5..20, 5..20)


def build(kind, root, split="train", **settings):
    return data.build_dataset(DataConfig(dataset=kind, root=str(root), **settings), split, train=False)


def by_name(dataset, name):
    return next(i for i in range(len(dataset)) if dataset.name_of(i) == name)


def brush(mask):
    return encode_brush_rle(np.repeat(mask.reshape(-1).astype(np.uint8) * 255, 4))


# ------------------------------------------------------------------------------------------------ COCO
@pytest.mark.parametrize("iscrowd", ["ignore", "category"])
def test_coco_equals_ann_to_mask(tmp_path, iscrowd):
    made = exports.make_coco(tmp_path)
    dataset = build("coco", tmp_path, iscrowd=iscrowd)
    # categories sorted by id (3 tree, 7 car, 42 road) after the background
    assert dataset.classes == ("background", "tree", "car", "road")
    class_of = {3: 1, 7: 2, 42: 3}
    crowd_value = IGNORE if iscrowd == "ignore" else None
    for image_id, name in ((11, "a"), (12, "b"), (13, "empty")):
        _, labels = dataset.load(by_name(dataset, name))
        expected = exports.coco_reference(made["path"], image_id, class_of, crowd_value=crowd_value, uncovered=0)
        np.testing.assert_array_equal(labels, expected)
    _, labels = dataset.load(by_name(dataset, "a"))
    assert (labels == 1).any() and not (labels[36:48, 48:60] == 1).any()  # the RLE's hole stays a hole
    assert any("without annotations" in w for w in dataset.listing_warnings)


def test_coco_uncovered_ignore_class_names_and_label_map(tmp_path):
    made = exports.make_coco(tmp_path)
    dataset = build("coco", tmp_path, uncovered="ignore")
    assert dataset.classes == ("tree", "car", "road")
    _, labels = dataset.load(by_name(dataset, "a"))
    expected = exports.coco_reference(made["path"], 11, {3: 0, 7: 1, 42: 2}, crowd_value=IGNORE, uncovered=IGNORE)
    np.testing.assert_array_equal(labels, expected)
    renamed = build("coco", tmp_path, class_names=("background", "road", "car", "tree"), label_map=((3, "ignore"),))
    _, labels = renamed.load(by_name(renamed, "a"))
    expected = exports.coco_reference(made["path"], 11, {3: IGNORE, 7: 2, 42: 1}, crowd_value=IGNORE, uncovered=0)
    np.testing.assert_array_equal(labels, expected)


def test_coco_bad_input_names_file_and_annotation(tmp_path):
    made = exports.make_coco(tmp_path)
    document = made["document"]
    document["annotations"].append({"id": 77, "image_id": 11, "category_id": 5, "segmentation": [[1, 1, 5, 1, 3, 4]]})
    document["annotations"].append({"id": 78, "image_id": 99, "category_id": 3, "segmentation": [[1, 1, 5, 1, 3, 4]]})
    document["annotations"].append({"id": 79, "image_id": 12, "category_id": 3,
                                    "segmentation": {"size": [10, 10], "counts": [100]}})
    document["images"].append({"id": 14, "file_name": "../../outside.jpg", "height": 60, "width": 80})
    exports.write_image(tmp_path.parent / "outside.jpg")
    made["path"].write_text(json.dumps(document))
    with pytest.raises(AnnotationError) as caught:
        build("coco", tmp_path)
    problems = "\n".join(caught.value.problems)
    assert "annotation 77: category_id 5 is not in 'categories'" in problems
    assert "annotation 78: image_id 99 is not in 'images'" in problems
    assert "annotation 79: its RLE is 10x10" in problems
    assert "outside data.root" in problems
    assert str(made["path"]) in problems
    made["path"].write_text('{"images": [}')
    with pytest.raises(ValueError, match=r"instances_train.json': not valid JSON \(line 1"):
        build("coco", tmp_path)


def test_coco_missing_image_and_stated_size(tmp_path):
    made = exports.make_coco(tmp_path)
    (tmp_path / "images" / "b.jpg").unlink()
    with pytest.raises(AnnotationError, match=r"1 image file\(s\) not found \(first: b.jpg\)"):
        build("coco", tmp_path)
    document = made["document"]
    document["images"] = [image for image in document["images"] if image["id"] != 12]
    document["annotations"] = [a for a in document["annotations"] if a["image_id"] != 12]
    document["images"][-1]["width"] = 81
    made["path"].write_text(json.dumps(document))
    dataset = build("coco", tmp_path)
    with pytest.raises(BadSampleError, match=r"image id 13\).*states the image as 81x60 but .*empty.jpg' is 80x60"):
        dataset.load(by_name(dataset, "empty"))


# ------------------------------------------------------------------------------------------------ labelme
def test_labelme_equals_labelme2voc(tmp_path):
    made = exports.make_labelme(tmp_path)
    dataset = build("labelme", tmp_path)
    assert dataset.classes == ("_background_", "road", "car", "tree")
    class_of = {"road": 1, "car": 2, "tree": 3, "__ignore__": IGNORE}
    for name in ("one", "two"):
        image, labels = dataset.load(by_name(dataset, name))
        np.testing.assert_array_equal(labels, exports.labelme2voc_reference(made["shapes"][name], class_of))
    image, _ = dataset.load(by_name(dataset, "two"))
    np.testing.assert_array_equal(image, made["image_two"])  # the embedded image, its file being gone
    _, labels = dataset.load(by_name(dataset, "one"))
    assert (labels == IGNORE).any() and (labels == 0).any()


def test_labelme_without_labels_txt_and_line_width(tmp_path):
    made = exports.make_labelme(tmp_path, labels_txt=False)
    dataset = build("labelme", tmp_path, line_width=4.0)
    assert dataset.classes == ("background", "car", "road", "tree")
    class_of = {"car": 1, "road": 2, "tree": 3, "__ignore__": IGNORE}
    _, labels = dataset.load(by_name(dataset, "one"))
    expected = exports.labelme2voc_reference(made["shapes"]["one"], class_of, line_width=4, point_size=2)
    np.testing.assert_array_equal(labels, expected)


def test_labelme_bad_input(tmp_path):
    exports.make_labelme(tmp_path)
    document = json.loads((tmp_path / "train" / "one.json").read_text())
    document["shapes"].append({"label": "bird", "shape_type": "polygon", "points": [[1, 1], [5, 1], [3, 4]]})
    document["shapes"].append({"label": "car", "shape_type": "hexagon", "points": [[1, 1]]})
    (tmp_path / "train" / "one.json").write_text(json.dumps(document))
    with pytest.raises(AnnotationError) as caught:
        build("labelme", tmp_path)
    problems = "\n".join(caught.value.problems)
    assert "one.json' shape 9: shape_type 'hexagon'" in problems
    assert "does not list the label 'bird'" in problems
    document["shapes"] = document["shapes"][:8]
    document["imagePath"] = "../../../etc/hostname"
    (tmp_path / "train" / "one.json").write_text(json.dumps(document))
    with pytest.raises(AnnotationError, match="imagePath .* lies outside data.root"):
        build("labelme", tmp_path)


def test_self_intersecting_and_degenerate_polygons_are_reported(tmp_path):
    exports.make_labelme(tmp_path)
    document = json.loads((tmp_path / "train" / "one.json").read_text())
    document["shapes"] += [
        {"label": "car", "shape_type": "polygon", "points": LOOP},
        {"label": "car", "shape_type": "polygon", "points": [[10, 10], [30, 30]]},
        {"label": "car", "shape_type": "polygon", "points": [[10, 10], [20, 20], [30, 30]]},
        {"label": "car", "shape_type": "polygon", "points": [[70, 50], [95, 50], [90, 70]]},
        {"label": "car", "shape_type": "polygon", "points": [[10, 10], [30, 30], [30, 10], [10, 30]]},  # a bow tie
    ]
    (tmp_path / "train" / "one.json").write_text(json.dumps(document))
    dataset = build("labelme", tmp_path)
    errors, warnings = dataset.shape_report(by_name(dataset, "one"))
    assert len(errors) == 1 and "shape 8: the polygon crosses itself near" in errors[0]
    assert "winds twice around x=5.5, y=5.5, where tools fill it differently" in errors[0]
    assert any("shape 9: a polygon of 2 point(s), fewer than 3" in w for w in warnings)
    assert any("shape 10: a polygon of zero area" in w for w in warnings)
    assert any("shape 11: coordinates outside the 80x60 image" in w for w in warnings)
    assert any("shape 12: the polygon crosses itself near x=20.0, y=20.0 (a twist" in w for w in warnings)
    report = dataset.inspect_masks(0)
    assert report.bad and "winds twice" in report.bad[0]
    from syncseg.data.base import check_data_at_start

    with pytest.raises(BadSampleError, match="winds twice"):
        check_data_at_start(dataset)


def test_winding_twice_against_a_brute_force_winding_number():
    from syncseg.data.annotations.problems import overlaps_itself

    def winding(ring, x, y):
        angles = np.arctan2(ring[:, 1] - y, ring[:, 0] - x)
        turns = np.diff(np.concatenate([angles, angles[:1]]))
        return round(float(np.sum((turns + np.pi) % (2 * np.pi) - np.pi)) / (2 * np.pi))

    rng = np.random.default_rng(2)
    for _ in range(60):
        ring = rng.uniform(0, 12, (int(rng.integers(3, 9)), 2))
        centres = [(x + 0.5, y + 0.5) for x in range(-1, 13) for y in range(-1, 13)]
        expected = any(abs(winding(ring, x, y)) >= 2 for x, y in centres)
        assert (overlaps_itself(ring) is not None) == expected


def test_self_intersection_against_brute_force():
    rng = np.random.default_rng(4)
    for _ in range(200):
        ring = rng.uniform(0, 10, (int(rng.integers(3, 8)), 2))
        count = len(ring)
        edges = [(ring[i], ring[(i + 1) % count]) for i in range(count)]

        def crosses(a, b, c, d):
            def orient(p, q, r):
                return np.sign((q[0] - p[0]) * (r[1] - p[1]) - (q[1] - p[1]) * (r[0] - p[0]))
            return orient(a, b, c) * orient(a, b, d) < 0 and orient(c, d, a) * orient(c, d, b) < 0

        expected = any(crosses(*edges[i], *edges[j]) for i in range(count) for j in range(i + 2, count)
                       if not (i == 0 and j == count - 1))
        assert (self_intersection(ring) is not None) == expected


# ------------------------------------------------------------------------------------------------ CVAT
def test_cvat_z_order_and_masks(tmp_path):
    exports.make_cvat(tmp_path)
    dataset = build("cvat", tmp_path, split="all")
    assert dataset.classes == ("background", "road", "car", "tree")
    _, labels = dataset.load(by_name(dataset, "frame_0"))
    np.testing.assert_array_equal(labels, exports.cvat_reference({"road": 1, "car": 2, "tree": 3}))
    _, empty = dataset.load(by_name(dataset, "frame_1"))
    assert (empty == 0).all()


def test_cvat_rle_against_plain_runs():
    rng = np.random.default_rng(1)
    for _ in range(20):
        mask = rng.random((int(rng.integers(1, 9)), int(rng.integers(1, 9)))) < 0.4
        counts = exports.cvat_rle(mask)
        np.testing.assert_array_equal(decode_cvat_rle(counts, width=mask.shape[1], height=mask.shape[0]), mask)
    with pytest.raises(ValueError, match="sum to 5 pixels, not the box's 2 x 3 = 6"):
        decode_cvat_rle("2, 3", width=2, height=3)


def test_cvat_bad_input(tmp_path):
    exports.make_cvat(tmp_path)
    text = (tmp_path / "annotations.xml").read_text()
    (tmp_path / "annotations.xml").write_text(text.replace('<polygon label="road"', '<polygon label="lake"'))
    with pytest.raises(AnnotationError, match=r"image id 0 'frame_0.jpg' <polygon> 1: label 'lake' is not in"):
        build("cvat", tmp_path, split="all")
    (tmp_path / "annotations.xml").write_text(text.replace('width="30" height="25"', 'width="31" height="25"'))
    with pytest.raises(AnnotationError, match=r"<mask> 2: its mask RLE covers 750 pixels, not its box's 31 x 25"):
        build("cvat", tmp_path, split="all")
    (tmp_path / "annotations.xml").write_text(text[:300])
    with pytest.raises(ValueError, match=r"annotations.xml': not valid XML \(line"):
        build("cvat", tmp_path, split="all")


# ------------------------------------------------------------------------------------------------ YOLO
def test_yolo_polygons_by_pixel_centres(tmp_path):
    exports.make_yolo(tmp_path)
    dataset = build("yolo_seg", tmp_path)
    assert dataset.classes == ("background", "road", "car", "tree") and len(dataset) == 3
    for stem in ("p0", "p1"):
        _, labels = dataset.load(by_name(dataset, stem))
        expected, near = exports.yolo_reference(stem, {0: 1, 1: 2, 2: 3}, uncovered=0)
        assert (labels[~near] == expected[~near]).all()
        assert near.sum() < 5  # the comparison leaves out only pixel centres on an edge
    _, unlabelled = dataset.load(by_name(dataset, "unlabelled"))
    assert (unlabelled == 0).all()
    assert any("without a label file" in w for w in dataset.listing_warnings)
    assert len(build("yolo_seg", tmp_path, split="val")) == 1


def test_yolo_bad_lines(tmp_path):
    exports.make_yolo(tmp_path)
    (tmp_path / "labels" / "train" / "p1.txt").write_text("7 0.1 0.1 0.5 0.1 0.3 0.4\n1 0.1 0.2 0.3\n")
    with pytest.raises(AnnotationError) as caught:
        build("yolo_seg", tmp_path)
    problems = "\n".join(caught.value.problems)
    assert "p1.txt' line 1: class id 7 is not in the data YAML's names" in problems
    assert "p1.txt' line 2: 3 coordinates, an odd number" in problems


# ------------------------------------------------------------------------------------------------ Label Studio
def test_brush_rle_decodes_label_studios_own_encoding():
    values = decode_brush_rle(exports.BRUSH_FIXTURE)
    assert values.size == 5 * 7 * 4
    np.testing.assert_array_equal(values.reshape(5, 7, 4)[..., 3] > 0, exports.brush_fixture_mask())
    rng = np.random.default_rng(3)
    for size in (1, 2, 17, 300):
        for density in (0.0, 0.1, 0.5, 1.0):
            flat = np.where(rng.random(size) < density, rng.integers(0, 256, size), 0).astype(np.uint8)
            flat[: size // 3] = 255  # long runs too
            np.testing.assert_array_equal(decode_brush_rle(encode_brush_rle(flat)), flat)


def test_label_studio_polygons_and_brushes(tmp_path):
    made = exports.make_label_studio(tmp_path, encode=brush)
    tasks = json.loads((tmp_path / "result.json").read_text())
    tasks[0]["annotations"][-1]["result"].append({"id": "r9", "type": "rectanglelabels", "value": {}})
    (tmp_path / "result.json").write_text(json.dumps(tasks))
    dataset = build("label_studio", tmp_path, split="all")
    assert any("not polygons or brushes are left out (1 rectanglelabels)" in w for w in dataset.listing_warnings)
    assert dataset.classes == ("background", "road", "tree")
    _, labels = dataset.load(0)
    expected = exports.label_studio_reference(made["result"], {"road": 1, "tree": 2, "__ignore__": IGNORE})
    np.testing.assert_array_equal(labels, expected)
    assert dataset.name_of(0) == "photo"


def test_label_studio_task_without_image(tmp_path):
    exports.make_label_studio(tmp_path, encode=brush)
    tasks = json.loads((tmp_path / "result.json").read_text())
    tasks.append({"id": 2, "data": {}, "annotations": []})
    (tmp_path / "result.json").write_text(json.dumps(tasks))
    with pytest.raises(AnnotationError, match=r"result.json' task 2: has no image"):
        build("label_studio", tmp_path, split="all")


# ------------------------------------------------------------------------------------------------ splits, shapes
def test_one_export_split_by_list_files(tmp_path):
    exports.make_coco(tmp_path, name="annotations/instances_default.json")
    (tmp_path / "train.txt").write_text("empty\na\n")
    (tmp_path / "val.txt").write_text("b\n")
    assert [build("coco", tmp_path).name_of(i) for i in range(2)] == ["empty", "a"]  # the list's order
    assert len(build("coco", tmp_path, split="val")) == 1
    chosen = build("coco", tmp_path, split="val", annotations="annotations/instances_default.json")
    assert chosen.name_of(0) == "b"
    with pytest.raises(FileNotFoundError, match="split 'test' not found under"):
        build("coco", tmp_path, split="test")


def test_rectangles_circles_and_bitmaps_draw_where_they_are():
    rectangle = Shape(label=1, kind="rectangle", ident="r", rings=[np.array([[2.0, 1.0], [5.0, 3.0]])], style="pil")
    mask = shape_mask(rectangle, 6, 8)
    assert mask.sum() == 4 * 3 and mask[1:4, 2:6].all()
    bitmap = Shape(label=1, kind="bitmap", ident="b", bitmap=np.ones((3, 3), dtype=bool), left=6, top=4)
    mask = shape_mask(bitmap, 6, 8)  # clipped at the image's edges
    assert mask.sum() == 4 and mask[4:6, 6:8].all()


# ------------------------------------------------------------------------------------------------ verify_dataset
def test_verify_reads_exports_and_names_each_problem(tmp_path, capsys):
    from syncseg.commands import verify_dataset

    exports.make_labelme(tmp_path)
    (tmp_path / "val").mkdir()
    document = json.loads((tmp_path / "train" / "one.json").read_text())
    (tmp_path / "val" / "one.json").write_text(json.dumps(document))
    exports.write_image(tmp_path / "val" / "one.jpg", 1)
    settings = ["data.dataset=labelme", f"data.root={tmp_path}"]
    assert verify_dataset.main(["--config", "demo.yaml", *settings]) == 0
    out = capsys.readouterr().out
    assert "[labelme train] 2 samples" in out and "bad 0" in out
    for name in ("_background_", "road", "car", "tree"):  # the pixels-per-class table
        assert f" {name} " in out
    document["shapes"].append({"label": "car", "shape_type": "polygon", "points": LOOP})
    document["shapes"].append({"label": "car", "shape_type": "polygon", "points": [[10, 10], [30, 30]]})
    (tmp_path / "train" / "one.json").write_text(json.dumps(document))
    assert verify_dataset.main(["--config", "demo.yaml", *settings]) == 2
    out = capsys.readouterr().out
    assert "BAD: " in out and "one.json' shape 8: the polygon crosses itself" in out and "winds twice" in out
    assert "WARNING: " in out and "one.json' shape 9: a polygon of 2 point(s)" in out
    document["shapes"].append({"label": "lake", "shape_type": "polygon", "points": [[1, 1], [5, 1], [3, 4]]})
    (tmp_path / "train" / "one.json").write_text(json.dumps(document))
    assert verify_dataset.main(["--config", "demo.yaml", *settings]) == 2
    captured = capsys.readouterr()
    assert "BAD: " in captured.out and "does not list the label 'lake'" in captured.out
    assert "error:" in captured.err


def test_training_start_refuses_a_bad_export(tmp_path):
    from syncseg.engine.config import load_config

    exports.make_coco(tmp_path)
    (tmp_path / "annotations" / "instances_val.json").write_text("{")
    config = load_config("demo.yaml", ["data.dataset=coco", f"data.root={tmp_path}"])
    data.build_dataset(config.data, "train", train=True)
    with pytest.raises(ValueError, match="instances_val.json': not valid JSON"):
        data.build_dataset(config.data, "val", train=False)


def test_pycocotools_polygons_drawn_in_their_box_equal_the_full_image_decode():
    from pycocotools import mask as coco_mask

    from syncseg.data.annotations.shapes import rasterize

    rng = np.random.default_rng(7)
    height, width = 37, 53
    for trial in range(300):
        # coordinates of one decimal (the ties of pycocotools' rounding), some past the image's edges
        rings = [np.round(rng.uniform(-8, 61, (int(rng.integers(3, 9)), 2)) * [1, height / width], 1)
                 for _ in range(int(rng.integers(1, 3)))]
        shape = Shape(label=1, kind="polygon", ident=f"trial {trial}", rings=rings, style="coco")
        drawn = rasterize([shape], height, width, value_of=lambda s: 1, uncovered=0)
        flat = [ring.reshape(-1).tolist() for ring in rings]
        expected = coco_mask.decode(coco_mask.merge(coco_mask.frPyObjects(flat, height, width)))
        np.testing.assert_array_equal(drawn, expected, err_msg=f"trial {trial}: {flat}")


# ------------------------------------------------------------------------------------------------ CVAT masks
def test_cvat_segmentation_mask_export_reads_its_labelmap(tmp_path):
    from PIL import Image

    (tmp_path / "labelmap.txt").write_text("# label:color_rgb:parts:actions\nbackground:0,0,0::\nroad:250,50,83::\n"
                                           "car:51,221,255::\n__ignore__:255,255,255::\n")
    colours = np.array([[0, 0, 0], [250, 50, 83], [51, 221, 255], [255, 255, 255]], dtype=np.uint8)
    indices = np.random.default_rng(0).integers(0, 4, (6, 9))
    (tmp_path / "SegmentationClass").mkdir()
    Image.fromarray(colours[indices]).save(tmp_path / "SegmentationClass" / "f0.png")
    exports.write_image(tmp_path / "JPEGImages" / "f0.jpg", height=6, width=9)
    (tmp_path / "ImageSets" / "Segmentation").mkdir(parents=True)
    (tmp_path / "ImageSets" / "Segmentation" / "default.txt").write_text("f0\n")
    dataset = build("cvat_mask", tmp_path, split="default")
    assert dataset.classes == ("background", "road", "car")
    np.testing.assert_array_equal(dataset.load(0)[1], np.array([0, 1, 2, IGNORE], dtype=np.uint8)[indices])
    sparse = build("cvat_mask", tmp_path, split="all", uncovered="ignore")
    assert sparse.classes == ("road", "car")
    np.testing.assert_array_equal(sparse.load(0)[1], np.array([IGNORE, 0, 1, IGNORE], dtype=np.uint8)[indices])
    Image.fromarray(np.full((6, 9, 3), 7, dtype=np.uint8)).save(tmp_path / "SegmentationClass" / "f0.png")
    with pytest.raises(BadSampleError, match=r"f0.png' has colours not in '.*labelmap.txt': #070707"):
        dataset.load(0)
    assert "not in '" in dataset.inspect_masks(0).bad[0] and "labelmap.txt" in dataset.inspect_masks(0).bad[0]


def test_a_two_point_part_is_not_read_as_a_box(tmp_path):
    """pycocotools reads a first polygon of 4 numbers as a box [x, y, w, h] (cvat #1769, mmdetection #7776):
    the part is left out, with a warning, and the object's other part drawn as a polygon."""
    from pycocotools import mask as coco_mask

    made = exports.make_coco(tmp_path)
    document = made["document"]
    triangle = [10.0, 10.0, 30.0, 10.0, 20.0, 30.0]
    document["annotations"] = [{"id": 1, "image_id": 11, "category_id": 7, "iscrowd": 0,
                                "segmentation": [[1.0, 1.0, 50.0, 40.0], triangle]}]
    made["path"].write_text(json.dumps(document))
    dataset = build("coco", tmp_path)
    index = by_name(dataset, "a")
    _, labels = dataset.load(index)
    expected = coco_mask.decode(coco_mask.merge(coco_mask.frPyObjects([triangle], 60, 80))).astype(bool)
    np.testing.assert_array_equal(labels == 2, expected)
    _, warnings = dataset.shape_report(index)
    assert any("annotation 1 (part 1 of 2): a polygon of 2 point(s), fewer than 3: not drawn" in w for w in warnings)


def test_sparse_shapes_with_uncovered_background_are_pointed_at_ignore(tmp_path):
    exports.make_yolo(tmp_path)
    for stem in ("p0", "p1"):  # one small triangle each: ~2% of the pixels
        (tmp_path / "labels" / "train" / f"{stem}.txt").write_text("1 0.1 0.1 0.3 0.1 0.2 0.25\n")
    warnings = build("yolo_seg", tmp_path).inspect_masks(0).warnings
    area = 0.5 * (0.2 * 80) * (0.15 * 60)  # the triangle's pixels; the third image has none
    share = f"{2 * area / (3 * 80 * 60):.1%}"
    assert any(f"the shapes cover {share} of the pixels of the 3 images checked" in w and "data.uncovered=ignore" in w
               for w in warnings)
    assert not any("shapes cover" in w for w in build("yolo_seg", tmp_path, uncovered="ignore").inspect_masks(0).warnings)
    exports.make_coco(tmp_path / "dense")
    assert not any("shapes cover" in w for w in build("coco", tmp_path / "dense").inspect_masks(0).warnings)


@pytest.mark.parametrize("kind", ["coco", "labelme", "cvat", "label_studio"])
def test_a_dataset_pickles_for_forkserver_workers_and_draws_the_same(tmp_path, kind):
    import pickle

    maker = {"coco": exports.make_coco, "labelme": exports.make_labelme, "cvat": exports.make_cvat,
             "label_studio": lambda root: exports.make_label_studio(root, encode=brush)}[kind]
    maker(tmp_path)
    split = "all" if kind in ("cvat", "label_studio") else "train"
    dataset = build(kind, tmp_path, split=split)
    first = [dataset.load(i)[1] for i in range(len(dataset))]  # fills each polygon's kept RLE
    copy = pickle.loads(pickle.dumps(dataset))
    for index, labels in enumerate(first):
        np.testing.assert_array_equal(copy.load(index)[1], labels)
