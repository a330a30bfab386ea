"""Small exports of each annotation tool written as the tool writes them, with the mask each should give,
computed independently of syncseg's readers: pycocotools' own COCO API (annToMask), labelme2voc's drawing
(PIL, outline included, file order), CVAT's z-order over pycocotools polygons and a plain run-length decode,
pixel-centre tests for YOLO's normalized polygons, and Label Studio's own brush encoder's output.

Every export holds overlaps, a hole, an ignored region and uncovered pixels."""
from __future__ import annotations

import base64
import io
import json
import math
from pathlib import Path

import cv2
import numpy as np
from PIL import Image, ImageDraw

HEIGHT, WIDTH = 60, 80
IGNORE = 255


def write_image(path: Path, seed: int = 0, *, height: int = HEIGHT, width: int = WIDTH) -> np.ndarray:
    path.parent.mkdir(parents=True, exist_ok=True)
    image = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    assert cv2.imwrite(str(path), image[..., ::-1])
    return image


def ring_mask(height: int, width: int) -> np.ndarray:
    """A square ring: the region with a hole every bitmap format gets."""
    mask = np.zeros((height, width), dtype=bool)
    mask[30:55, 40:70] = True
    mask[36:48, 48:60] = False
    return mask


# ------------------------------------------------------------------------------------------------ COCO
def make_coco(root: Path, *, name: str = "annotations/instances_train.json") -> dict:
    """COCO with non-contiguous category ids, a two-part polygon object, compressed and uncompressed RLE, a crowd
    region, an image without annotations; returns {"path", "references": {file_name: mask per iscrowd policy}}."""
    from pycocotools import mask as coco_mask

    for index, file_name in enumerate(("a.jpg", "b.jpg", "empty.jpg")):
        write_image(root / "images" / file_name, index)
    ring = np.asfortranarray(ring_mask(HEIGHT, WIDTH).astype(np.uint8))
    compressed = coco_mask.encode(ring)
    compressed["counts"] = compressed["counts"].decode()
    crowd = np.zeros((HEIGHT, WIDTH), dtype=np.uint8)
    crowd[2:12, 2:30] = 1
    document = {
        "images": [{"id": 11, "file_name": "a.jpg", "height": HEIGHT, "width": WIDTH},
                   {"id": 12, "file_name": "b.jpg", "height": HEIGHT, "width": WIDTH},
                   {"id": 13, "file_name": "empty.jpg", "height": HEIGHT, "width": WIDTH}],
        "categories": [{"id": 7, "name": "car"}, {"id": 3, "name": "tree"}, {"id": 42, "name": "road"}],
        "annotations": [
            {"id": 1, "image_id": 11, "category_id": 42, "iscrowd": 0,
             "segmentation": [[1.3, 20.2, 70.8, 18.6, 75.1, 40.4, 3.7, 44.9]]},
            {"id": 2, "image_id": 11, "category_id": 7, "iscrowd": 0,  # two parts, over the road
             "segmentation": [[10.5, 25.5, 30.2, 22.1, 25.7, 50.3], [50.1, 5.2, 60.9, 5.8, 58.3, 15.4, 49.6, 14.1]]},
            {"id": 3, "image_id": 11, "category_id": 3, "iscrowd": 0, "segmentation": compressed},
            {"id": 4, "image_id": 12, "category_id": 3, "iscrowd": 1,
             "segmentation": {"size": [HEIGHT, WIDTH], "counts": _uncompressed_runs(crowd)}},
            {"id": 5, "image_id": 12, "category_id": 7, "iscrowd": 0,
             "segmentation": [[40.0, 10.0, 70.0, 12.0, 66.0, 50.0, 44.0, 47.0]]},
        ],
    }
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document))
    return {"path": path, "document": document}


def _uncompressed_runs(mask: np.ndarray) -> list[int]:
    """COCO's uncompressed RLE: column-major runs starting with a run of 0s."""
    flat = mask.flatten(order="F").astype(np.int64)
    runs, current, count = [], 0, 0
    for value in flat:
        if value == current:
            count += 1
        else:
            runs.append(count)
            current, count = value, 1
    runs.append(count)
    return runs


def coco_reference(path: Path, image_id: int, class_of: dict, *, crowd_value: int | None, uncovered: int) -> np.ndarray:
    """The labels of `image_id` through pycocotools' COCO API, annotations in file order (later on top)."""
    from pycocotools.coco import COCO

    api = COCO(str(path))
    info = api.loadImgs(image_id)[0]
    labels = np.full((info["height"], info["width"]), uncovered, dtype=np.uint8)
    for annotation in api.loadAnns(api.getAnnIds(imgIds=image_id)):
        value = crowd_value if annotation["iscrowd"] and crowd_value is not None else class_of[annotation["category_id"]]
        labels[api.annToMask(annotation).astype(bool)] = value
    return labels


# ------------------------------------------------------------------------------------------------ labelme
def _png_base64(mask: np.ndarray) -> str:
    buffer = io.BytesIO()
    Image.fromarray(mask.astype(np.uint8) * 255).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def make_labelme(root: Path, *, labels_txt: bool = True) -> dict:
    """Two labelme files: every shape type (a mask shape with a hole), an __ignore__ polygon, overlaps; the second
    embeds its image (imageData) with no image file. Returns {"files": [...], "shapes": {stem: shapes}}."""
    write_image(root / "train" / "one.jpg", 1)
    ring = ring_mask(HEIGHT, WIDTH)[28:57, 38:72]
    shapes_one = [
        {"label": "road", "shape_type": "polygon", "points": [[1.3, 20.2], [70.8, 18.6], [75.1, 40.4], [3.7, 44.9]]},
        {"label": "car", "shape_type": "rectangle", "points": [[30.6, 35.2], [12.1, 22.8]]},
        {"label": "tree", "shape_type": "circle", "points": [[60.2, 12.7], [66.1, 16.0]]},
        {"label": "car", "shape_type": "line", "points": [[2.0, 55.0], [30.0, 50.0]]},
        {"label": "tree", "shape_type": "linestrip", "points": [[5.0, 5.0], [15.0, 8.0], [25.0, 3.0]]},
        {"label": "car", "shape_type": "point", "points": [[45.0, 8.0]]},
        {"label": "tree", "shape_type": "mask", "points": [[38.0, 28.0], [71.0, 56.0]], "mask": _png_base64(ring)},
        {"label": "__ignore__", "shape_type": "polygon", "points": [[20.5, 40.5], [28.0, 41.0], [24.0, 47.5]]},
    ]
    one = {"version": "5.5.0", "flags": {}, "shapes": shapes_one, "imagePath": "one.jpg", "imageData": None,
           "imageHeight": HEIGHT, "imageWidth": WIDTH}
    (root / "train" / "one.json").write_text(json.dumps(one))
    image_two = np.random.default_rng(2).integers(0, 255, (HEIGHT, WIDTH, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(image_two).save(buffer, format="PNG")
    shapes_two = [{"label": "tree", "shape_type": "polygon", "points": [[10, 10], [50, 12], [30, 45]]}]
    two = {"version": "5.5.0", "flags": {}, "shapes": shapes_two, "imagePath": "gone.png",
           "imageData": base64.b64encode(buffer.getvalue()).decode(), "imageHeight": HEIGHT, "imageWidth": WIDTH}
    (root / "train" / "two.json").write_text(json.dumps(two))
    if labels_txt:
        (root / "labels.txt").write_text("__ignore__\n_background_\nroad\ncar\ntree\n")
    return {"shapes": {"one": shapes_one, "two": shapes_two}, "image_two": image_two}


def labelme2voc_reference(shapes: list[dict], class_of: dict, *, height: int = HEIGHT, width: int = WIDTH,
                          line_width: int = 10, point_size: int = 5) -> np.ndarray:
    """labelme2voc's labels: each shape drawn with PIL (outline included) into its own mask, in file order."""
    labels = np.zeros((height, width), dtype=np.uint8)
    for shape in shapes:
        canvas = Image.new("L", (width, height), 0)
        draw = ImageDraw.Draw(canvas)
        xy = [tuple(point) for point in shape["points"]]
        kind = shape["shape_type"]
        if kind == "mask":
            (x1, y1), (x2, y2) = np.asarray(shape["points"]).astype(int)
            with Image.open(io.BytesIO(base64.b64decode(shape["mask"]))) as image:
                bitmap = np.asarray(image) > 0
            mask = np.zeros((height, width), dtype=bool)
            mask[y1:y2 + 1, x1:x2 + 1] = bitmap
        else:
            if kind == "circle":
                (cx, cy), (px, py) = xy
                radius = math.hypot(cx - px, cy - py)
                draw.ellipse([cx - radius, cy - radius, cx + radius, cy + radius], outline=1, fill=1)
            elif kind == "rectangle":
                (x0, y0), (x1, y1) = xy
                draw.rectangle([min(x0, x1), min(y0, y1), max(x0, x1), max(y0, y1)], outline=1, fill=1)
            elif kind in ("line", "linestrip"):
                draw.line(xy=xy, fill=1, width=line_width)
            elif kind == "point":
                cx, cy = xy[0]
                draw.ellipse([cx - point_size, cy - point_size, cx + point_size, cy + point_size], outline=1, fill=1)
            else:
                draw.polygon(xy=xy, outline=1, fill=1)
            mask = np.asarray(canvas).astype(bool)
        labels[mask] = class_of[shape["label"]]
    return labels


# ------------------------------------------------------------------------------------------------ CVAT
def cvat_rle(mask: np.ndarray) -> str:
    """CVAT's RLE of a box's bool mask: row-major runs, starting with a run of 0s."""
    runs, current, count = [], False, 0
    for value in mask.reshape(-1):
        if bool(value) == current:
            count += 1
        else:
            runs.append(count)
            current, count = bool(value), 1
    runs.append(count)
    return ", ".join(map(str, runs))


def make_cvat(root: Path) -> dict:
    write_image(root / "images" / "frame_0.jpg", 3)
    write_image(root / "images" / "frame_1.jpg", 4)
    ring = ring_mask(HEIGHT, WIDTH)[30:55, 40:70]
    xml = f"""<?xml version="1.0" encoding="utf-8"?>
<annotations>
  <version>1.1</version>
  <meta><task><id>1</id><labels>
    <label><name>road</name><color>#ff0000</color><type>any</type></label>
    <label><name>car</name><color>#00ff00</color><type>any</type></label>
    <label><name>tree</name><color>#0000ff</color><type>any</type></label>
    <label><name>__ignore__</name><color>#ffffff</color><type>any</type></label>
  </labels></task></meta>
  <image id="0" name="frame_0.jpg" width="{WIDTH}" height="{HEIGHT}">
    <box label="car" source="manual" occluded="0" xtl="12.1" ytl="22.8" xbr="30.6" ybr="35.2" z_order="2"></box>
    <polygon label="road" source="manual" occluded="0" points="1.3,20.2;70.8,18.6;75.1,40.4;3.7,44.9" z_order="0"></polygon>
    <mask label="tree" source="manual" occluded="0" rle="{cvat_rle(ring)}" left="40" top="30" width="30" height="25" z_order="1"></mask>
    <polygon label="__ignore__" source="manual" occluded="0" points="20.5,40.5;28.0,41.0;24.0,47.5" z_order="3"></polygon>
    <tag label="car" source="manual"></tag>
  </image>
  <image id="1" name="frame_1.jpg" width="{WIDTH}" height="{HEIGHT}">
  </image>
</annotations>
"""
    (root / "annotations.xml").write_text(xml)
    return {"ring": ring}


def cvat_reference(class_of: dict) -> np.ndarray:
    """frame_0 by CVAT's rule: z_order ascending, pycocotools for polygons and boxes, the RLE'd mask as is."""
    from pycocotools import mask as coco_mask

    def polygon(flat):
        return coco_mask.decode(coco_mask.merge(coco_mask.frPyObjects([flat], HEIGHT, WIDTH))).astype(bool)

    labels = np.zeros((HEIGHT, WIDTH), dtype=np.uint8)
    labels[polygon([1.3, 20.2, 70.8, 18.6, 75.1, 40.4, 3.7, 44.9])] = class_of["road"]  # z 0
    labels[ring_mask(HEIGHT, WIDTH)] = class_of["tree"]  # z 1
    labels[polygon([12.1, 22.8, 30.6, 22.8, 30.6, 35.2, 12.1, 35.2])] = class_of["car"]  # z 2
    labels[polygon([20.5, 40.5, 28.0, 41.0, 24.0, 47.5])] = IGNORE  # z 3
    return labels


# ------------------------------------------------------------------------------------------------ YOLO
YOLO_POLYGONS = {  # image stem -> [(class id, normalized polygon)], file order
    "p0": [(0, [0.02, 0.31, 0.91, 0.29, 0.97, 0.69, 0.04, 0.73]),
           (1, [0.13, 0.41, 0.39, 0.37, 0.33, 0.83]),
           (2, [0.551, 0.113, 0.893, 0.131, 0.811, 0.477])],
    "p1": [(1, [0.25, 0.25, 0.75, 0.25, 0.5, 0.75])],
}


def make_yolo(root: Path) -> None:
    """Ultralytics' layout: images/<split>/, labels/<split>/, data.yaml with names and split paths."""
    for split, stems in (("train", ["p0", "p1"]), ("val", ["p1"])):
        for number, stem in enumerate(stems):
            write_image(root / "images" / split / f"{stem}.jpg", number)
            lines = [f"{cls} " + " ".join(f"{v:.6f}" for v in poly) for cls, poly in YOLO_POLYGONS[stem]]
            (root / "labels" / split).mkdir(parents=True, exist_ok=True)
            (root / "labels" / split / f"{stem}.txt").write_text("\n".join(lines) + "\n")
    write_image(root / "images" / "train" / "unlabelled.jpg", 9)
    (root / "data.yaml").write_text("path: .\ntrain: images/train\nval: images/val\nnames:\n  0: road\n  1: car\n"
                                    "  2: tree\n")


def inside_polygon(polygon: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Even-odd crossing test of the points (x, y) against a closed polygon (N, 2)."""
    inside = np.zeros(x.shape, dtype=bool)
    count = len(polygon)
    for i in range(count):
        (x0, y0), (x1, y1) = polygon[i], polygon[(i + 1) % count]
        crosses = (y0 > y) != (y1 > y)
        with np.errstate(divide="ignore", invalid="ignore"):
            at = x0 + (y - y0) * (x1 - x0) / (y1 - y0)
        inside ^= crosses & (x < at)
    return inside


def distance_to_edges(polygon: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    best = np.full(x.shape, np.inf)
    count = len(polygon)
    for i in range(count):
        a, b = polygon[i], polygon[(i + 1) % count]
        d = b - a
        t = np.clip(((x - a[0]) * d[0] + (y - a[1]) * d[1]) / max(float(d @ d), 1e-12), 0, 1)
        best = np.minimum(best, np.hypot(x - (a[0] + t * d[0]), y - (a[1] + t * d[1])))
    return best


def yolo_reference(stem: str, class_of: dict, *, uncovered: int) -> tuple[np.ndarray, np.ndarray]:
    """(labels by pixel centres, pixels whose centre lies on an edge (within 1e-6 pixel): either side is right)."""
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH] + 0.5
    labels = np.full((HEIGHT, WIDTH), uncovered, dtype=np.uint8)
    near = np.zeros((HEIGHT, WIDTH), dtype=bool)
    for cls, flat in YOLO_POLYGONS[stem]:
        polygon = np.asarray(flat).reshape(-1, 2) * [WIDTH, HEIGHT]
        labels[inside_polygon(polygon, x, y)] = class_of[cls]
        near |= distance_to_edges(polygon, x, y) < 1e-6
    return labels, near


# ------------------------------------------------------------------------------------------------ Label Studio
# Label Studio's own brush encoder (label_studio_converter 0.0.59, brush.mask2rle) on a 7 x 5 mask: rows 1-3,
# columns 2-5 set, but (row 2, column 3)
BRUSH_FIXTURE = [0, 0, 0, 140, 57, 27, 254, 35, 0, 191, 255, 108, 2, 63, 248, 192, 39, 255, 182, 1, 127, 255, 15, 128, 0]


def brush_fixture_mask() -> np.ndarray:
    mask = np.zeros((5, 7), dtype=bool)
    mask[1:4, 2:6] = True
    mask[2, 3] = False
    return mask


def make_label_studio(root: Path, *, encode) -> dict:
    """A Label Studio JSON export: an upload-prefixed image with a polygon, a brush with a hole and an ignore
    polygon; a task labelled twice; `encode` is the brush RLE encoder (bool HxW -> list of bytes)."""
    write_image(root / "images" / "photo.jpg", 5)
    ring = ring_mask(HEIGHT, WIDTH)
    def percent(points):
        return [[x / WIDTH * 100, y / HEIGHT * 100] for x, y in points]
    result = [
        {"id": "r1", "type": "polygonlabels", "from_name": "label", "to_name": "image", "original_width": WIDTH,
         "original_height": HEIGHT, "value": {"points": percent([[1.3, 20.2], [70.8, 18.6], [75.1, 40.4], [3.7, 44.9]]),
                                              "polygonlabels": ["road"]}},
        {"id": "r2", "type": "brushlabels", "from_name": "tag", "to_name": "image", "original_width": WIDTH,
         "original_height": HEIGHT, "value": {"format": "rle", "rle": encode(ring), "brushlabels": ["tree"]}},
        {"id": "r3", "type": "polygonlabels", "from_name": "label", "to_name": "image", "original_width": WIDTH,
         "original_height": HEIGHT, "value": {"points": percent([[20.5, 40.5], [28.0, 41.0], [24.0, 47.5]]),
                                              "polygonlabels": ["__ignore__"]}},
    ]
    tasks = [{"id": 1, "data": {"image": "/data/upload/1/8f1e2d3c-photo.jpg"},
              "annotations": [{"id": 9, "was_cancelled": True, "result": []}, {"id": 10, "result": result}]}]
    (root / "result.json").write_text(json.dumps(tasks))
    return {"result": result}


def label_studio_reference(result: list, class_of: dict) -> np.ndarray:
    labels = np.zeros((HEIGHT, WIDTH), dtype=np.uint8)
    for item in result:
        if item["type"] == "polygonlabels":
            canvas = Image.new("L", (WIDTH, HEIGHT), 0)
            points = [(x / 100 * WIDTH, y / 100 * HEIGHT) for x, y in item["value"]["points"]]  # as its converter
            ImageDraw.Draw(canvas).polygon(points, outline=1, fill=1)
            labels[np.asarray(canvas).astype(bool)] = class_of[item["value"]["polygonlabels"][0]]
        else:
            labels[ring_mask(HEIGHT, WIDTH)] = class_of[item["value"]["brushlabels"][0]]
    return labels
