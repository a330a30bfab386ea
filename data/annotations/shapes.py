"""Annotation shapes -> label masks, drawn as the tool that wrote them draws them.

Every reader (syncseg.data.annotations.coco, labelme, cvat, yolo_seg, label_studio) turns its files into
`AnnotatedImage`s: an image file and its `Shape`s in the order the tool shows them. `rasterize` draws them
into one HxW uint8 label image: pixels no shape covers get the `uncovered` value (a background class or the
ignore label), and later shapes (a higher `z`, then a later place in the file) are drawn over earlier ones.

Coordinates are image pixels, x to the right and y down. Each tool fills polygons its own way, and a
mask that must equal the tool's own export has to follow it (`Shape.style`):

- "coco": pycocotools' polygon rasterization (`frPyObjects`), what COCO's `annToMask`, CVAT's COCO and mask
  exports (datumaro) and every pycocotools-based tool do;
- "pil": PIL's `ImageDraw` with the outline drawn, what labelme's `shape_to_mask` / labelme2voc and Label
  Studio's converter do (integer coordinates are pixel centres);
- "corners": coordinates where 0 and the image size are the image's edges (YOLO's normalized polygons times
  the image size): a pixel is inside when its centre is (even-odd).

Problems with a shape (crossings, too few points, ...) are found by syncseg.data.annotations.problems.
"""
from __future__ import annotations

import base64
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from PIL import Image, ImageDraw

from syncseg.data.annotations.codecs import decode_bitmap

STYLES = ("coco", "pil", "corners")
KINDS = ("polygon", "rectangle", "circle", "line", "point", "rle", "bitmap")


@dataclass
class Shape:
    """One annotated region.

    `label` is the key the class table maps (a label name, or a numeric id: a COCO category id, a YOLO class
    id); `ident` names the shape in messages ("annotation 17", "shape 3"). By `kind`:
    polygon: `rings` (one or more (N, 2) arrays of x, y, filled together: a COCO object of several parts);
    rectangle: two opposite corners in `rings[0]`; circle: the centre and a point on the circle;
    line: the points of a polyline `width` pixels wide; point: one point, a disc of radius `width`;
    rle: a pycocotools RLE dict covering the whole image; bitmap: `bitmap` (bool h x w, or `encoded` in
    `encoding`) with its top-left pixel at (`left`, `top`).
    """

    label: str | int
    kind: str
    ident: str
    rings: list[np.ndarray] = field(default_factory=list)
    style: str = "coco"
    z: float = 0.0
    width: float = 0.0
    rle: Any = None
    bitmap: np.ndarray | None = None
    encoding: str = ""  # a bitmap kept encoded until drawn: "cvat", "brush" or "png" (syncseg.data.annotations.codecs)
    encoded: Any = None
    left: int = 0
    top: int = 0
    crowd: bool = False
    # what drawing it needs again next time (the pycocotools RLE of its box, for the image size it was made
    # for): a worker draws each image every epoch, and the RLE is a few hundred bytes
    drawn: Any = field(default=None, compare=False, repr=False)


@dataclass
class AnnotatedImage:
    """An image and its shapes, as one annotation file lists them.

    `image` is the image file (None when the annotation file embeds the image: `embedded`, base64 bytes of an
    encoded image, labelme's imageData); `stated_size` is (height, width) as the annotation file states it
    (None when it does not); `source` is the annotation file, which messages name.
    """

    name: str
    image: Path | None
    source: Path
    shapes: list[Shape]
    stated_size: tuple[int, int] | None = None
    embedded: str | None = None
    ident: str = ""  # how the file names the image (a COCO image id, a Label Studio task id)
    normalized: bool = False  # coordinates are fractions of the image's width and height (YOLO)

    def describe(self) -> str:
        where = f" ({self.ident})" if self.ident else ""
        return f"'{self.source}'{where}"


def decode_embedded_image(data: str) -> np.ndarray:
    """labelme's imageData (base64 of an encoded image) -> HxWx3 uint8 RGB."""
    with Image.open(io.BytesIO(base64.b64decode(data))) as image:
        return np.asarray(image.convert("RGB"))


COCO_SCALE = 5  # pycocotools' rleFrPoly upsamples polygons 5x and starts from (int)(5 * x + .5)


def _coco_rings_region(rings: Sequence[np.ndarray], height: int, width: int) -> tuple[int, int, Any] | None:
    """(top, left, pycocotools RLE of the box) of what pycocotools draws for `rings` in a height x width image, in a box
    around them only (a full-image decode per shape cost ~0.2 ms at 500x375). Exact: pycocotools' first step
    rounds each coordinate to an integer of the 5x grid, after which its drawing is integer arithmetic that
    moves with the box; the rounding is done here and the box's corner subtracted on that grid, so the
    coordinates pycocotools sees round back to the same integers. An axis whose shapes reach below 0 keeps
    its coordinates and its box edge at 0 (the rounding truncates negative values toward zero). None when the
    box is empty."""
    from pycocotools import mask as coco_mask

    snapped = [np.trunc(COCO_SCALE * np.asarray(ring, dtype=np.float64).reshape(-1, 2) + 0.5) for ring in rings]
    points = np.concatenate(snapped)
    corner, end = [0, 0], [width, height]
    for axis in (0, 1):
        if points[:, axis].min() >= 2 * COCO_SCALE:
            corner[axis] = int(points[:, axis].min()) // COCO_SCALE - 1
        end[axis] = min(end[axis], int(points[:, axis].max()) // COCO_SCALE + 2)
    (left, top), (right, bottom) = corner, end
    if right <= left or bottom <= top:
        return None
    shift = np.array([COCO_SCALE * left, COCO_SCALE * top], dtype=np.float64)
    originals = [np.asarray(ring, dtype=np.float64).reshape(-1, 2) for ring in rings]
    moved = []
    for ring, original in zip(snapped, originals):
        # a shifted axis takes its grid value / 5, which pycocotools rounds back to that integer exactly
        shifted = (ring - shift) / COCO_SCALE
        moved.append(np.where(shift > 0, shifted, original).reshape(-1).tolist())
    return top, left, coco_mask.merge(coco_mask.frPyObjects(moved, bottom - top, right - left))


def _corner_fill(rings: Sequence[np.ndarray], height: int, width: int) -> np.ndarray:
    """Pixels whose centre lies inside the rings (even-odd: a ring inside another is a hole), with 0 and the
    image size the image's edges. Per row of pixel centres, every edge that crosses it toggles the pixels from
    the first centre at or right of the crossing: the row's cumulative count is odd inside."""
    mask = np.zeros((height, width), dtype=bool)
    rings = [np.asarray(ring, dtype=np.float64).reshape(-1, 2) for ring in rings]
    start = np.concatenate(rings)
    end = np.concatenate([np.roll(ring, -1, axis=0) for ring in rings])
    low = max(0, int(np.floor(start[:, 1].min() - 0.5)))
    high = min(height, int(np.ceil(start[:, 1].max() + 0.5)))
    if high <= low:
        return mask
    centres = np.arange(low, high, dtype=np.float64)[:, None] + 0.5
    y0, y1 = start[None, :, 1], end[None, :, 1]
    crossing = (y0 <= centres) != (y1 <= centres)  # half-open: a vertex on the row counts once
    with np.errstate(divide="ignore", invalid="ignore"):
        x = start[None, :, 0] + (centres - y0) * (end[None, :, 0] - start[None, :, 0]) / (y1 - y0)
    rows, edges = np.nonzero(crossing)
    columns = np.clip(np.ceil(x[rows, edges] - 0.5), 0, width).astype(np.int64)
    toggles = np.zeros((high - low, width + 1), dtype=np.int32)
    np.add.at(toggles, (rows, columns), 1)
    mask[low:high] = (np.cumsum(toggles, axis=1)[:, :width] % 2).astype(bool)
    return mask


def _points(ring: np.ndarray) -> list[tuple[float, float]]:
    return [(float(x), float(y)) for x, y in np.asarray(ring, dtype=np.float64).reshape(-1, 2)]


def _pil_drawn(shape: Shape) -> bool:
    """Whether PIL draws `shape` (labelme's and Label Studio's polygons and rectangles; circles, points and
    lines in every format)."""
    return shape.kind in ("circle", "point", "line") or (shape.kind in ("polygon", "rectangle")
                                                         and shape.style == "pil")


def _draw_pil(draw: ImageDraw.ImageDraw, shape: Shape, value: int) -> None:
    """Draw `shape` with `value`, outline included, as labelme's shape_to_mask does."""
    rings = [ring for ring in shape.rings if len(ring) >= 3] if shape.kind == "polygon" else shape.rings
    if not rings or not len(rings[0]):
        return
    if shape.kind == "polygon":
        for ring in rings:
            draw.polygon(_points(ring), fill=value, outline=value)
        return
    points = _points(rings[0])
    if shape.kind == "rectangle":
        (x0, y0), (x1, y1) = points[0], points[-1]
        draw.rectangle([min(x0, x1), min(y0, y1), max(x0, x1), max(y0, y1)], fill=value, outline=value)
    elif shape.kind in ("circle", "point"):
        (cx, cy) = points[0]
        radius = shape.width if shape.kind == "point" else float(np.hypot(cx - points[-1][0], cy - points[-1][1]))
        draw.ellipse([cx - radius, cy - radius, cx + radius, cy + radius], fill=value, outline=value)
    else:
        draw.line(points, fill=value, width=max(1, int(round(shape.width))))


def _coco_polygon_rings(shape: Shape) -> list[np.ndarray]:
    """The rings pycocotools draws for a polygon (rings of 3 points or more) or a rectangle (its 4 corners)."""
    if shape.kind == "polygon":
        return [ring for ring in shape.rings if len(ring) >= 3]
    if not shape.rings or not len(shape.rings[0]):
        return []
    (x0, y0), (x1, y1) = _points(shape.rings[0])[0], _points(shape.rings[0])[-1]
    left, right, top, bottom = min(x0, x1), max(x0, x1), min(y0, y1), max(y0, y1)
    return [np.array([[left, top], [right, top], [right, bottom], [left, bottom]])]


def _coco_drawn(shape: Shape) -> bool:
    """Whether pycocotools draws `shape` (COCO's and CVAT's polygons and boxes)."""
    return shape.kind in ("polygon", "rectangle") and shape.style == "coco"


def _coco_region(shape: Shape, height: int, width: int) -> tuple[int, int, np.ndarray] | None:
    """(top, left, bool crop) of what pycocotools draws for `shape` in a height x width image (None: nothing),
    from the RLE of its box, which the shape keeps (`drawn`) for the next time it is drawn at that size."""
    from pycocotools import mask as coco_mask

    if shape.drawn is None or shape.drawn[0] != (height, width):
        rings = _coco_polygon_rings(shape)
        shape.drawn = ((height, width), _coco_rings_region(rings, height, width) if rings else None)
    if shape.drawn[1] is None:
        return None
    top, left, rle = shape.drawn[1]
    return top, left, coco_mask.decode(rle).view(bool)


def shape_mask(shape: Shape, height: int, width: int) -> np.ndarray:
    """The bool HxW pixels `shape` covers in an image of `height` x `width` (nothing for a shape that draws
    nothing: a polygon ring of fewer than 3 points). Raises ValueError naming the shape for an RLE of another
    image size."""
    if shape.kind == "rle":
        from pycocotools import mask as coco_mask

        size = tuple(int(v) for v in shape.rle["size"])
        if size != (height, width):
            raise ValueError(f"{shape.ident}: its RLE is {size[1]}x{size[0]} (width x height) but the image is "
                             f"{width}x{height}")
        return coco_mask.decode(shape.rle).view(bool)
    if shape.kind == "bitmap":
        mask = np.zeros((height, width), dtype=bool)
        bitmap = shape.bitmap if shape.bitmap is not None else decode_bitmap(shape.encoding, shape.encoded)
        top, left = shape.top, shape.left
        y0, x0 = max(top, 0), max(left, 0)
        y1, x1 = min(top + bitmap.shape[0], height), min(left + bitmap.shape[1], width)
        if y1 > y0 and x1 > x0:
            mask[y0:y1, x0:x1] = bitmap[y0 - top:y1 - top, x0 - left:x1 - left]
        return mask
    if _pil_drawn(shape):
        canvas = Image.new("L", (width, height), 0)
        _draw_pil(ImageDraw.Draw(canvas), shape, 1)
        return np.asarray(canvas).astype(bool)
    if _coco_drawn(shape):
        mask = np.zeros((height, width), dtype=bool)
        region = _coco_region(shape, height, width)
        if region is not None:
            top, left, crop = region
            mask[top:top + crop.shape[0], left:left + crop.shape[1]] = crop
        return mask
    rings = _coco_polygon_rings(shape) if shape.kind == "rectangle" else [r for r in shape.rings if len(r) >= 3]
    return _corner_fill(rings, height, width) if rings else np.zeros((height, width), dtype=bool)


def rasterize(shapes: Sequence[Shape], height: int, width: int, *, value_of: Callable[[Shape], int | None],
              uncovered: int) -> np.ndarray:
    """HxW uint8 labels: `uncovered` where no shape is, else the value `value_of(shape)` of the shape drawn
    last there (by `z`, then by its place in `shapes`); shapes whose value is None are not drawn.

    Drawing each shape with its value over the ones before gives what the tools' own exports give (a mask per
    shape, then `labels[mask] = value` in order); runs of PIL-drawn shapes share one canvas, and pycocotools'
    polygons are drawn in their box (_coco_rings_region)."""
    labels = np.full((height, width), uncovered, dtype=np.uint8)
    order = sorted(range(len(shapes)), key=lambda index: shapes[index].z)  # stable: file order within a z
    canvas: Image.Image | None = None  # the labels as a PIL image while PIL-drawn shapes follow each other
    for index in order:
        shape = shapes[index]
        value = value_of(shape)
        if value is None:
            continue
        if _pil_drawn(shape):
            if canvas is None:
                canvas = Image.fromarray(labels)
            _draw_pil(ImageDraw.Draw(canvas), shape, value)
            continue
        if canvas is not None:
            labels, canvas = np.array(canvas), None
        if _coco_drawn(shape):
            region = _coco_region(shape, height, width)
            if region is not None:
                top, left, mask = region
                np.copyto(labels[top:top + mask.shape[0], left:left + mask.shape[1]], value, where=mask)
            continue
        np.copyto(labels, value, where=shape_mask(shape, height, width))
    return np.array(canvas) if canvas is not None else labels
