"""Predicted label masks -> files a labelling tool imports as pre-annotations.

Every writer takes `Prediction`s (an image's file name as the tool knows it and its H x W class indices, where
`ignore_index` means "no prediction" and is written as nothing), the class table `classes` (index -> name)
and `background`, the class that means "nothing drawn": not written, except where a format needs it to fill
a hole (None: every class is written). A writer reads each prediction once, in order, checks them all
before it writes anything, writes each file atomically (a temporary file in the same folder, then
os.replace: a crash leaves the old file or the whole new one) and returns the paths it wrote.

- `write_coco`: predictions.json: `images` (ids from 1), `categories` (the training file's `category_ids`,
  else class index + 1; the background is no category), one annotation per image and class present: a
  compressed RLE from pycocotools as `segmentation`, `area` and `bbox` from it, `iscrowd` 0, no `score`.
  RLE keeps holes exactly.
- `write_labelme`: <folder>/<stem>.json per image (labelme 5.5.0; `imagePath` the image's base name: the json
  goes where labelme looks, beside the image) and labels.txt, labelme2voc's class list. One polygon per
  4-connected region of a class, through the centres of its boundary pixels, which labelme's PIL
  rasterization (outline drawn, integer coordinates at pixel centres) fills back to the region and its holes.
  labelme paints later shapes over earlier ones, so regions go outermost first (one with pixels in another's
  holes after it, of any class): a hole of background pixels is a `_background_` polygon after the region
  around it, a hole of another class is that class's region, written later. Exact: 4-connected regions never
  cross at a diagonal as 8-connected ones can. Ignore pixels are not written: inside a region they become
  part of it, elsewhere labelme2voc makes them background.
- `write_cvat`: annotations.xml, CVAT for images 1.1: per image one <mask> per class present, in CVAT's run
  lengths over the class's bounding box (`codecs.encode_cvat_rle`). Exact, holes kept.
- `write_yolo_seg`: labels/<folder>/<stem>.txt per image and data.yaml (`names` in id order). YOLO has no
  background id: ids are class indices with the background class removed and the classes after it shifted
  down. One line per 8-connected region: its id, then its polygon normalized by the image's width and height,
  0 and 1 being the image's outer edges (a pixel is inside when its centre is). Every hole, of ignore pixels
  too, is joined to the outer ring by a zero-width cut, so one polygon holds it. Exact.

Polygons come from `trace_regions`, not simplified unless `tolerance` > 0 (cv2.approxPolyDP, in pixels).
"""
from __future__ import annotations

import json
import os
import uuid
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Iterable, Iterator, Sequence

import cv2
import numpy as np
from PIL import Image, ImageDraw

from syncseg.data.annotations.codecs import encode_cvat_rle
from syncseg.data.constants import IGNORE_INDEX

LABELME_VERSION = "5.5.0"
LABELME_BACKGROUND = "_background_"  # labelme's own names for the background class and ignored pixels
LABELME_IGNORE = "__ignore__"
DECIMALS = 6  # YOLO's normalized coordinates


@dataclass(frozen=True)
class Prediction:
    """One image's prediction: `file_name` as the labelling tool knows the image (a relative path such as
    "sub/a.jpg"), `labels` H x W uint8 class indices (`ignore_index`: no prediction)."""

    file_name: str
    labels: np.ndarray


Ring = np.ndarray  # (N, 2) float64 x, y in pixels
Region = tuple[Ring, list[Ring]]  # the outer ring and the rings of its holes


# ------------------------------------------------------------------------------------------------ checks
def _checked(predictions: Iterable[Prediction], classes: Sequence[str], *, background: int | None,
             ignore_index: int) -> Iterator[tuple[Prediction, list[int]]]:
    """Each prediction, read once, with the class indices it holds (ascending, ignore_index left out). Raises
    ValueError for a bad class table, a labels array that is not H x W integers, a value that is no class
    (naming the file_name and the value) or a file_name given twice. Writers write only after the last."""
    if not classes or len(set(classes)) != len(classes) or not all(isinstance(n, str) and n for n in classes):
        raise ValueError(f"classes {list(classes)!r}: expected a non-empty list of distinct non-empty names")
    if background is not None and not 0 <= background < len(classes):
        raise ValueError(f"background {background!r}: expected None or a class index 0..{len(classes) - 1}")
    if 0 <= ignore_index < len(classes):
        raise ValueError(f"ignore_index {ignore_index} is also class '{classes[ignore_index]}': expected a value "
                         f"outside the class indices 0..{len(classes) - 1}")
    seen = set()
    for prediction in predictions:
        name, labels = prediction.file_name, prediction.labels
        if not isinstance(name, str) or not name or name in seen:
            raise ValueError(f"file_name {name!r}{' given twice' if name in seen else ''}: expected a non-empty "
                             "name, once per image")
        seen.add(name)
        if not isinstance(labels, np.ndarray) or labels.ndim != 2 or not labels.size or labels.dtype.kind not in "iu":
            raise ValueError(f"{name}: labels of {getattr(labels, 'dtype', type(labels))} shaped "
                             f"{getattr(labels, 'shape', '?')}: expected an H x W uint8 array of class indices")
        values = [int(v) for v in np.unique(labels) if v != ignore_index]
        bad = [v for v in values if not 0 <= v < len(classes)]
        if bad:
            raise ValueError(f"{name}: label value {bad[0]} is no class: expected 0..{len(classes) - 1} or the "
                             f"ignore_index {ignore_index}")
        yield prediction, values


def _output_path(file_name: str, folder: Path, *, suffix: str, taken: dict[Path, str]) -> Path:
    """folder/<relative folder>/<stem><suffix>, recorded in `taken`; ValueError for a file_name that would
    leave `folder` or one whose path another file_name took."""
    name = PurePosixPath(file_name)
    if name.is_absolute() or ".." in name.parts or not name.stem:
        raise ValueError(f"file_name '{name}': expected a relative path without '..' (the files written for it "
                         "go into the output folder)")
    path = folder / f"{name.with_suffix('')}{suffix}"
    if path in taken:
        raise ValueError(f"file_name '{name}' and '{taken[path]}' would both be written to '{path}': expected "
                         "image names that differ in more than their suffix")
    taken[path] = file_name
    return path


# ------------------------------------------------------------------------------------------------ files
def _write_all(files: list[tuple[Path, bytes]]) -> list[Path]:
    """Write each (path, content) atomically: a temporary file beside it, fsynced, then os.replace'd over it."""
    for path, data in files:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        # mode 0666 through os.open: the umask applies as to any file the user creates (mkstemp's 0600 would not)
        handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(handle, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, path)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
    return [path for path, _ in files]


# ------------------------------------------------------------------------------------------------ polygons
def _signed_area(ring: Ring) -> float:
    x, y = ring[:, 0], ring[:, 1]
    return float(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1))) / 2


def _simplified(ring: Ring, tolerance: float) -> Ring:
    if tolerance <= 0 or len(ring) < 4:
        return ring
    simplified = cv2.approxPolyDP(ring.astype(np.float32).reshape(-1, 1, 2), tolerance, True).reshape(-1, 2)
    simplified = simplified.astype(np.float64)
    # a ring simplified to a line or a point would draw nothing of a region that exists
    return simplified if len(simplified) >= 3 and _signed_area(simplified) != 0 else ring


def trace_regions(mask: np.ndarray, *, corners: bool = False, tolerance: float = 0.0) -> list[Region]:
    """The 8-connected regions of bool H x W `mask`, each as (outer ring, hole rings); rings are (N, 2) float64
    x, y in pixels, outer rings with a positive shoelace area (x right, y down), holes negative. Holes are
    the 4-connected parts of ~mask a region encloses; an island inside a hole is a region of its own.

    corners=False: rings through the centres of the region's boundary pixels, integer coordinates at pixel
    centres (PIL's and labelme's convention; a region one pixel wide gives a ring of zero area).
    corners=True: 0 and the image size are the image's outer edges and a pixel is inside when its centre is;
    rings run a quarter pixel inside the region's pixel edges: every pixel centre is a quarter pixel from any
    edge, so rasterizers that round edges to whole pixels (cv2.fillPoly) fill exactly the region too.
    tolerance > 0: each ring simplified by cv2.approxPolyDP (pixels). Raises ValueError for a mask not 2-D."""
    mask = np.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"mask of shape {mask.shape}: expected H x W")
    rows, columns = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    if not len(rows):
        return []
    top, left = int(rows[0]), int(columns[0])
    crop = mask[top:rows[-1] + 1, left:columns[-1] + 1].astype(np.uint8)
    if corners:
        # on a grid of half pixels the traced centres lie a quarter pixel inside the pixel edges
        crop = np.repeat(np.repeat(crop, 2, axis=0), 2, axis=1)
    # two levels: outer boundaries, and the holes of each (an island in a hole is an outer boundary again)
    contours, hierarchy = cv2.findContours(crop, cv2.RETR_CCOMP, cv2.CHAIN_APPROX_SIMPLE)
    parents = hierarchy.reshape(-1, 4)[:, 3].tolist() if contours else []

    def ring(index: int, sign: float) -> Ring:
        points = contours[index].reshape(-1, 2).astype(np.float64)
        points = _simplified((points + 0.5) / 2 if corners else points, tolerance) + (left, top)
        return points[::-1] if _signed_area(points) * sign < 0 else points

    regions: dict[int, Region] = {i: (ring(i, 1.0), []) for i, parent in enumerate(parents) if parent < 0}
    for index, parent in enumerate(parents):
        if parent >= 0:
            regions[parent][1].append(ring(index, -1.0))
    return list(regions.values())


def _crossings(ring: Ring, x: float) -> tuple[np.ndarray, np.ndarray]:
    """(y, edge index) where the vertical line at `x` crosses the edges of `ring` (ring[i] -> ring[i + 1])."""
    start, end = ring, np.roll(ring, -1, axis=0)
    hit = np.flatnonzero((start[:, 0] - x) * (end[:, 0] - x) < 0)
    a, b = start[hit], end[hit]
    return a[:, 1] + (x - a[:, 0]) * (b[:, 1] - a[:, 1]) / (b[:, 0] - a[:, 0]), hit


def _bridged(outer: Ring, holes: list[Ring]) -> Ring:
    """One ring holding `outer` and its `holes` (rings of trace_regions(corners=True)): each hole is joined by
    a zero-width vertical cut from its top up to the nearest ring edge straight above it, and back. Holes are
    joined from the topmost down, so any ring above a hole's top is joined already and no cut crosses a ring. A
    hole with no ring above it (simplification can move one out of its region) is dropped: its pixels are
    filled."""
    tops = []
    for hole in holes:
        top = hole[np.lexsort((hole[:, 0], hole[:, 1]))[0]]
        # vertices lie on quarter pixels: a line at a half pixel never meets one, so it crosses inside edges
        for x in (np.floor(top[0]) + 0.5, np.ceil(top[0]) - 0.5):
            ys, edges = _crossings(hole, x)
            if len(ys):
                tops.append((float(ys.min()), float(x), int(edges[np.argmin(ys)]), hole))
                break
    ring = outer
    for y, x, edge, hole in sorted(tops, key=lambda top: top[:2]):
        ys, edges = _crossings(ring, x)
        if not (ys < y).any():
            continue
        nearest = int(np.argmax(np.where(ys < y, ys, -np.inf)))
        cut, start, after = np.array([[x, ys[nearest]]]), np.array([[x, y]]), int(edges[nearest]) + 1
        loop = np.concatenate([start, np.roll(hole, -(edge + 1), axis=0), start])
        ring = np.concatenate([ring[:after], cut, loop, cut, ring[after:]])
    return ring


# ------------------------------------------------------------------------------------------------ COCO
def write_coco(predictions: Iterable[Prediction], classes: Sequence[str], *, output: Path,
               background: int | None, category_ids: Sequence[int] | None = None,
               ignore_index: int = IGNORE_INDEX) -> list[Path]:
    """Write output/predictions.json (COCO, see the module docstring); returns [its path]. `category_ids`:
    class index -> the training file's category id (distinct ints, one per class; the background's is not
    used). Raises ValueError for bad inputs, naming the value and what was expected."""
    from pycocotools import mask as coco_mask

    written = [c for c in range(len(classes)) if c != background]
    ids = list(range(1, len(classes) + 1) if category_ids is None else category_ids)
    if len(ids) != len(classes) or len({ids[c] for c in written}) != len(written) or not all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in ids):
        raise ValueError(f"category_ids {ids!r}: expected {len(classes)} ints, distinct for the classes written")
    images, annotations = [], []
    checked = _checked(predictions, classes, background=background, ignore_index=ignore_index)
    for image_id, (prediction, values) in enumerate(checked, start=1):
        height, width = prediction.labels.shape
        images.append({"id": image_id, "file_name": prediction.file_name, "height": height, "width": width})
        for class_index in (v for v in values if v != background):
            rle = coco_mask.encode(np.asfortranarray(prediction.labels == class_index, dtype=np.uint8))
            annotations.append({
                "id": len(annotations) + 1, "image_id": image_id, "category_id": int(ids[class_index]),
                "segmentation": {"size": [height, width], "counts": rle["counts"].decode("ascii")},
                "area": int(coco_mask.area(rle)), "bbox": [float(v) for v in coco_mask.toBbox(rle)], "iscrowd": 0})
    categories = [{"id": int(ids[c]), "name": classes[c], "supercategory": ""} for c in written]
    document = {"images": images, "categories": categories, "annotations": annotations}
    return _write_all([(output / "predictions.json", json.dumps(document, ensure_ascii=False).encode())])


# ------------------------------------------------------------------------------------------------ labelme
def _painted(ring: Ring, box: tuple[int, int, int, int]) -> np.ndarray:
    """The bool pixels of `box` (left, top, right, bottom inclusive) that labelme paints for `ring`: PIL with
    the outline drawn, as labelme2voc does."""
    left, top, right, bottom = box
    canvas = Image.new("L", (right - left + 1, bottom - top + 1), 0)
    points = [(float(x - left), float(y - top)) for x, y in ring]
    ImageDraw.Draw(canvas).polygon(points + points[-1:] * (3 - len(points)), fill=1, outline=1)
    return np.asarray(canvas).astype(bool)


def _paint_order(regions: list[tuple[int, Ring, tuple[int, int, int, int], np.ndarray, np.ndarray, bool]],
                 background: int | None) -> list[int]:
    """The regions to write, in the order to write them: by depth, the number of regions whose polygon paints
    over some of a region's pixels (whose holes it lies in: 4-connected regions lie in a hole whole, so a
    region is deeper than every region around it). A background region is written only when the polygon of a
    written region paints over it."""
    depth, painted_over = [0] * len(regions), [False] * len(regions)
    boxes = np.array([region[2] for region in regions]).reshape(-1, 4)
    for outer, (class_index, _, (left, top, right, bottom), painted, _, has_holes) in enumerate(regions):
        overlapping = (boxes[:, 0] <= right) & (boxes[:, 2] >= left) & (boxes[:, 1] <= bottom) & (boxes[:, 3] >= top)
        for inner in np.flatnonzero(overlapping) if has_holes else ():  # without holes it paints only its own
            (x0, y0, x1, y1), pixels = regions[inner][2], regions[inner][4]
            ox0, oy0, ox1, oy1 = max(x0, left), max(y0, top), min(x1, right), min(y1, bottom)
            if inner != outer and (pixels[oy0 - y0:oy1 - y0 + 1, ox0 - x0:ox1 - x0 + 1]
                                   & painted[oy0 - top:oy1 - top + 1, ox0 - left:ox1 - left + 1]).any():
                depth[inner] += 1
                painted_over[inner] |= class_index != background
    order = sorted(range(len(regions)), key=depth.__getitem__)
    return [i for i in order if regions[i][0] != background or painted_over[i]]


def _labelme_shapes(labels: np.ndarray, values: list[int], *, classes: Sequence[str], background: int | None,
                    tolerance: float) -> list[dict]:
    regions = []  # (class, outer ring, box, painted pixels over the box, its own pixels over the box, has holes)
    for class_index in values:
        # 4-connected pieces: an 8-connected region can cross another at a diagonal, each reaching into the
        # other's holes, and then no order of the two polygons paints both right
        count, pieces, stats, _ = cv2.connectedComponentsWithStats((labels == class_index).astype(np.uint8),
                                                                  connectivity=4)
        for piece in range(1, count):
            x, y, width, height = (int(v) for v in stats[piece, :4])
            own = pieces[y:y + height, x:x + width] == piece
            (outer, holes), = trace_regions(own)
            box = (x, y, x + width - 1, y + height - 1)
            outer = outer + (x, y)
            regions.append((class_index, outer, box, _painted(outer, box), own, bool(holes)))
    shapes = []
    for index in _paint_order(regions, background):
        class_index, outer = regions[index][:2]
        points = _simplified(outer, tolerance).tolist()
        shapes.append({"label": LABELME_BACKGROUND if class_index == background else classes[class_index],
                       # PIL refuses a polygon of one point: a pixel's point is repeated to the fewest a polygon has
                       "points": points + points[-1:] * (3 - len(points)), "group_id": None, "description": "",
                       "shape_type": "polygon", "flags": {}, "mask": None})
    return shapes


def write_labelme(predictions: Iterable[Prediction], classes: Sequence[str], *, output: Path,
                  background: int | None, ignore_index: int = IGNORE_INDEX, tolerance: float = 0.0) -> list[Path]:
    """Write output/<folder>/<stem>.json per prediction and output/labels.txt (see the module docstring);
    returns their paths, labels.txt last. labels.txt lists __ignore__, _background_, then the classes other
    than `background` in index order (with background None, labelme2voc's ids are class index + 1). Raises
    ValueError for bad inputs, a file_name leaving the output folder or two that share a stem."""
    reserved = [n for c, n in enumerate(classes) if c != background and n in (LABELME_BACKGROUND, LABELME_IGNORE)]
    if reserved:
        raise ValueError(f"class name '{reserved[0]}' is labelme's own name for background or ignored pixels: "
                         "expected it only as the background class")
    files, taken = [], {}
    for prediction, values in _checked(predictions, classes, background=background, ignore_index=ignore_index):
        path = _output_path(prediction.file_name, output, suffix=".json", taken=taken)
        height, width = prediction.labels.shape
        document = {"version": LABELME_VERSION, "flags": {},
                    "shapes": _labelme_shapes(prediction.labels, values, classes=classes, background=background,
                                              tolerance=tolerance),
                    "imagePath": PurePosixPath(prediction.file_name).name, "imageData": None,
                    "imageHeight": height, "imageWidth": width}
        files.append((path, json.dumps(document, indent=2, ensure_ascii=False).encode()))
    names = [LABELME_IGNORE, LABELME_BACKGROUND] + [n for c, n in enumerate(classes) if c != background]
    files.append((output / "labels.txt", "".join(f"{n}\n" for n in names).encode()))
    return _write_all(files)


# ------------------------------------------------------------------------------------------------ CVAT
def write_cvat(predictions: Iterable[Prediction], classes: Sequence[str], *, output: Path,
               background: int | None, ignore_index: int = IGNORE_INDEX) -> list[Path]:
    """Write output/annotations.xml (CVAT for images 1.1, see the module docstring); returns [its path]; image
    ids count from 0 as CVAT's frames do. Raises ValueError for bad inputs."""
    checked = _checked(predictions, classes, background=background, ignore_index=ignore_index)
    root = ElementTree.Element("annotations")
    ElementTree.SubElement(root, "version").text = "1.1"
    labels = ElementTree.SubElement(ElementTree.SubElement(ElementTree.SubElement(root, "meta"), "task"), "labels")
    for class_index, name in enumerate(classes):
        if class_index != background:
            ElementTree.SubElement(ElementTree.SubElement(labels, "label"), "name").text = name
    for image_id, (prediction, values) in enumerate(checked):
        height, width = prediction.labels.shape
        image = ElementTree.SubElement(root, "image", id=str(image_id), name=prediction.file_name,
                                       width=str(width), height=str(height))
        for class_index in (v for v in values if v != background):
            rle, left, top, box_width, box_height = encode_cvat_rle(prediction.labels == class_index)
            ElementTree.SubElement(image, "mask", label=classes[class_index], source="auto", occluded="0", rle=rle,
                                   left=str(left), top=str(top), width=str(box_width), height=str(box_height),
                                   z_order="0")
    ElementTree.indent(root)
    return _write_all([(output / "annotations.xml", ElementTree.tostring(root, encoding="utf-8",
                                                                         xml_declaration=True))])


# ------------------------------------------------------------------------------------------------ YOLO
def write_yolo_seg(predictions: Iterable[Prediction], classes: Sequence[str], *, output: Path,
                   background: int | None, ignore_index: int = IGNORE_INDEX, tolerance: float = 0.0) -> list[Path]:
    """Write output/labels/<folder>/<stem>.txt per prediction (empty for an image with nothing written) and
    output/data.yaml (see the module docstring); returns their paths, data.yaml last. Raises ValueError for
    bad inputs, a file_name leaving the output folder or two that share a stem."""
    import yaml

    written = [c for c in range(len(classes)) if c != background]
    files, taken = [], {}
    for prediction, values in _checked(predictions, classes, background=background, ignore_index=ignore_index):
        path = _output_path(prediction.file_name, output / "labels", suffix=".txt", taken=taken)
        height, width = prediction.labels.shape
        lines = []
        for class_index in (v for v in values if v != background):
            for outer, holes in trace_regions(prediction.labels == class_index, corners=True, tolerance=tolerance):
                ring = _bridged(outer, holes) / (width, height)
                lines.append(" ".join([str(written.index(class_index))] + [f"{v:.{DECIMALS}f}" for v in ring.ravel()]))
        files.append((path, "".join(f"{line}\n" for line in lines).encode()))
    names = yaml.safe_dump({"names": [classes[c] for c in written]}, sort_keys=False, allow_unicode=True)
    files.append((output / "data.yaml", names.encode()))
    return _write_all(files)
