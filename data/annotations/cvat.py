"""CVAT for images 1.1 (XML): polygons, polylines, boxes, ellipses, points and masks (CVAT's own RLE), z_order.

Where the file is, for split `s` under data.root: `<s>.xml`, `annotations/<s>.xml`, and for `all` also
`annotations.xml` (what CVAT's export zip holds). The classes are the `<labels>` of its `<meta>` (task, job or
project), in their order. An image's `name` is looked for in `images/` and data.root and must lie inside it.

Overlaps are resolved as CVAT shows them: a higher `z_order` on top, then later in the file on top. Polygons
and boxes are rasterized by pycocotools (CVAT's mask export does so through datumaro); polylines are
data.line_width pixels wide, points discs of radius line_width / 2. Tags and skeletons are not regions and are
left out.
"""
from __future__ import annotations

import xml.etree.ElementTree as ElementTree
from pathlib import Path

import numpy as np

from syncseg.data.annotations.codecs import cvat_rle_length
from syncseg.data.annotations.common import Export, ImageFinder, counted, repeated_names, require_pycocotools
from syncseg.data.annotations.shapes import AnnotatedImage, Shape

REGION_TAGS = ("polygon", "polyline", "box", "ellipse", "points", "mask")


def candidates(root: Path, split: str) -> list[Path]:
    found = [root / f"{split}.xml", root / "annotations" / f"{split}.xml"]
    if split == "all":
        found += [root / "annotations.xml", root / "annotations" / "annotations.xml"]
    return found


def _points(text: str) -> np.ndarray:
    pairs = [pair.split(",") for pair in text.split(";") if pair.strip()]
    return np.asarray([[float(x), float(y)] for x, y in pairs], dtype=np.float64).reshape(-1, 2)


def _shape(element: ElementTree.Element, ident: str, line_width: float) -> Shape:
    label = element.get("label", "")
    z = float(element.get("z_order", 0) or 0)
    tag = element.tag
    if tag == "polygon":
        return Shape(label=label, kind="polygon", ident=ident, rings=[_points(element.get("points", ""))], z=z)
    if tag == "polyline":
        return Shape(label=label, kind="line", ident=ident, rings=[_points(element.get("points", ""))], z=z,
                     width=line_width, style="pil")
    if tag == "points":
        points = _points(element.get("points", ""))
        return Shape(label=label, kind="polygon", ident=ident, rings=[], z=z) if not len(points) else Shape(
            label=label, kind="point", ident=ident, rings=[points[:1]], z=z, width=line_width / 2, style="pil")
    if tag == "box":
        corners = np.array([[float(element.get("xtl")), float(element.get("ytl"))],
                            [float(element.get("xbr")), float(element.get("ybr"))]])
        return Shape(label=label, kind="rectangle", ident=ident, rings=[corners], z=z)
    if tag == "ellipse":
        cx, cy = float(element.get("cx")), float(element.get("cy"))
        rx, ry = float(element.get("rx")), float(element.get("ry"))
        angles = np.linspace(0, 2 * np.pi, 72, endpoint=False)
        ring = np.stack([cx + rx * np.cos(angles), cy + ry * np.sin(angles)], axis=1)
        return Shape(label=label, kind="polygon", ident=ident, rings=[ring], z=z)
    left, top = int(float(element.get("left"))), int(float(element.get("top")))
    width, height = int(float(element.get("width"))), int(float(element.get("height")))
    counts = element.get("rle", "")
    if cvat_rle_length(counts) != width * height:
        raise ValueError(f"its mask RLE covers {cvat_rle_length(counts)} pixels, not its box's {width} x {height}")
    return Shape(label=label, kind="bitmap", ident=ident, encoding="cvat", encoded=(counts, width, height), left=left,
                 top=top, z=z)


def read(path: Path, *, root: Path, split: str, line_width: float) -> Export:
    """The CVAT XML `path` (images under `root`) as an Export."""
    require_pycocotools("cvat")
    try:
        tree = ElementTree.parse(path)
    except ElementTree.ParseError as error:
        line, column = error.position
        raise ValueError(f"'{path}': not valid XML (line {line}, column {column}: {error})") from None
    document = tree.getroot()
    if document.tag != "annotations":
        raise ValueError(f"'{path}': not a 'CVAT for images 1.1' file (its root element is <{document.tag}>, "
                         "expected <annotations>)")
    labels = [element.findtext("name", "") for element in document.iterfind("meta//labels/label")]
    labels = list(dict.fromkeys(name for name in labels if name))
    errors: list[str] = []
    warnings: list[str] = []
    if not labels:
        errors.append(f"'{path}': no <labels> in its <meta>: CVAT lists the classes there")
    folders = [root / "images", path.parent / "images", path.parent, root]
    images, names = [], {}
    finder = ImageFinder(root, folders, path)
    for element in document.iterfind("image"):
        name = element.get("name", "")
        ident = f"image id {element.get('id')} '{name}'"
        found = finder.find([name, Path(name).name], what=f"{ident}'s file", errors=errors)
        if found is None:
            continue
        names.setdefault(Path(name).name, []).append(element.get("id"))
        shapes = []
        for number, child in enumerate(element):
            if child.tag not in REGION_TAGS:
                continue
            shape_ident = f"'{path}' {ident} <{child.tag}> {number}"
            if child.get("label", "") not in labels:
                errors.append(f"{shape_ident}: label '{child.get('label', '')}' is not in the file's <labels> "
                              f"({', '.join(labels[:10])})")
                continue
            try:
                shapes.append(_shape(child, shape_ident, line_width))
            except (TypeError, ValueError) as error:
                errors.append(f"{shape_ident}: {error}")
        stated = (int(element.get("height")), int(element.get("width"))) if element.get("height") else None
        images.append(AnnotatedImage(name=Path(name).stem, image=found, source=path, shapes=shapes,
                                     stated_size=stated, ident=ident))
    errors += finder.missing_problems()
    warnings += repeated_names(path, names)
    empty = [image.name for image in images if not image.shapes]
    if empty:
        warnings.append(f"'{path}': {counted(empty, 'image(s) without shapes')}")
    return Export(images=images, labels={name: name for name in labels}, errors=errors, warnings=warnings)
