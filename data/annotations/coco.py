"""COCO JSON (instances): polygons, uncompressed and compressed RLE, iscrowd, non-contiguous category ids.

Where the files are, for split `s` under data.root (the first that exists): `annotations/instances_<s>.json`
(COCO's own layout), `<s>/_annotations.coco.json` (Roboflow), `annotations/<s>.json`, `<s>.json`; `all` also
finds `annotations/instances_default.json` (CVAT's COCO export). An image's `file_name` is looked for in the
JSON's folder, `images/`, `images/<s>/`, `<s>/` and data.root, and must lie inside data.root.

Overlaps: annotations are drawn in file order, later on top (COCO has no z-order). An object of several
polygons is one region (pycocotools merges them); COCO polygons hold no holes, RLE does. `iscrowd: 1` regions
are ignored (data.iscrowd=ignore, the default) or drawn as their category (data.iscrowd=category).
Polygons are rasterized by pycocotools, as annToMask does.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from syncseg.data.annotations.common import (Export, ImageFinder, counted, read_json, repeated_names,
                                             require_pycocotools)
from syncseg.data.annotations.shapes import AnnotatedImage, Shape


def candidates(root: Path, split: str) -> list[Path]:
    """Where split `split`'s COCO file may be, in the order they are tried."""
    found = [root / "annotations" / f"instances_{split}.json", root / split / "_annotations.coco.json",
             root / "annotations" / f"{split}.json", root / f"{split}.json"]
    if split == "all":
        found += [root / "annotations" / "instances_default.json", root / "_annotations.coco.json"]
    return found


def _table(items: Any, key: str, path: Path) -> list[dict[str, Any]]:
    if items is None:
        return []
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise ValueError(f"'{path}': '{key}' must be a list of objects")
    return items


def _segmentation(annotation: dict[str, Any], ident: str, height: int | None, width: int | None,
                  errors: list[str]) -> Shape | None:
    segmentation = annotation.get("segmentation")
    if isinstance(segmentation, list):
        rings = []
        for ring in segmentation:
            values = np.asarray(ring, dtype=np.float64) if isinstance(ring, list) else np.zeros(1)
            if values.ndim != 1 or len(values) % 2:
                errors.append(f"{ident}: a polygon must be a flat list of x, y pairs, got {str(ring)[:60]}")
                return None
            rings.append(values.reshape(-1, 2))
        return Shape(label=annotation.get("category_id"), kind="polygon", ident=ident, rings=rings, style="coco")
    if isinstance(segmentation, dict) and "counts" in segmentation and "size" in segmentation:
        size = segmentation["size"]
        if not (isinstance(size, list) and len(size) == 2):
            errors.append(f"{ident}: RLE 'size' must be [height, width], got {size!r}")
            return None
        if height is not None and (int(size[0]), int(size[1])) != (height, width):
            errors.append(f"{ident}: its RLE is {size[1]}x{size[0]} (width x height) but its image is stated as "
                          f"{width}x{height}")
            return None
        rle = segmentation
        if isinstance(segmentation["counts"], list):  # uncompressed: pycocotools compresses it
            from pycocotools import mask as coco_mask

            if sum(segmentation["counts"]) != int(size[0]) * int(size[1]):
                errors.append(f"{ident}: its uncompressed RLE counts sum to {sum(segmentation['counts'])}, not "
                              f"height x width = {int(size[0]) * int(size[1])}")
                return None
            rle = coco_mask.frPyObjects(segmentation, int(size[0]), int(size[1]))
        elif isinstance(rle["counts"], str):
            rle = {"size": [int(size[0]), int(size[1])], "counts": rle["counts"].encode()}
        return Shape(label=annotation.get("category_id"), kind="rle", ident=ident, rle=rle)
    return None


def read(path: Path, *, root: Path, split: str) -> Export:
    """The COCO file `path` (images found under `root`) as an Export; ValueError for a file that is not COCO."""
    require_pycocotools("coco")
    document = read_json(path)
    if not isinstance(document, dict):
        raise ValueError(f"'{path}': a COCO file is a JSON object with 'images', 'annotations' and 'categories'")
    errors: list[str] = []
    warnings: list[str] = []
    categories: dict[Any, str] = {}
    for category in _table(document.get("categories"), "categories", path):
        if category.get("id") in categories:
            errors.append(f"'{path}': category id {category.get('id')} is listed twice")
        categories[category.get("id")] = str(category.get("name", category.get("id")))
    if not categories:
        errors.append(f"'{path}': no 'categories': a COCO file lists its classes there")
    categories = dict(sorted(categories.items(), key=lambda item: (str(type(item[0])), item[0])))
    folders = [path.parent, path.parent.parent / "images", root / "images", root / "images" / split,
               root / split, root]
    images: dict[Any, AnnotatedImage] = {}
    by_name: dict[str, list[Any]] = {}
    finder = ImageFinder(root, folders, path)
    for entry in _table(document.get("images"), "images", path):
        image_id, file_name = entry.get("id"), str(entry.get("file_name", ""))
        if image_id in images:
            errors.append(f"'{path}': image id {image_id} is listed twice")
            continue
        if not file_name:
            errors.append(f"'{path}': image id {image_id} has no file_name")
            continue
        found = finder.find([file_name, Path(file_name).name], what=f"image {image_id}'s file", errors=errors)
        if found is None:
            continue
        height, width = entry.get("height"), entry.get("width")
        stated = (int(height), int(width)) if height and width else None
        images[image_id] = AnnotatedImage(name=Path(file_name).stem, image=found, source=path, shapes=[],
                                          stated_size=stated, ident=f"image id {image_id}")
        by_name.setdefault(Path(file_name).name, []).append(image_id)
    errors += finder.missing_problems()
    warnings += repeated_names(path, by_name)
    no_segmentation: list[str] = []
    listed = {entry.get("id") for entry in _table(document.get("images"), "images", path)}
    for annotation in _table(document.get("annotations"), "annotations", path):
        ident = f"'{path}' annotation {annotation.get('id')}"
        image_id, category_id = annotation.get("image_id"), annotation.get("category_id")
        if image_id not in images:
            if image_id not in listed:
                errors.append(f"{ident}: image_id {image_id} is not in 'images'")
            continue  # its image is missing: said above
        if category_id not in categories:
            errors.append(f"{ident}: category_id {category_id} is not in 'categories' (ids "
                          f"{', '.join(map(str, list(categories)[:10]))})")
            continue
        image = images[image_id]
        height, width = image.stated_size or (None, None)
        num_errors = len(errors)
        shape = _segmentation(annotation, ident, height, width, errors)
        if shape is None:
            if len(errors) == num_errors:  # no error: it has no segmentation at all
                no_segmentation.append(str(annotation.get("id")))
            continue
        shape.crowd = bool(annotation.get("iscrowd", 0))
        image.shapes.append(shape)
    if no_segmentation:
        warnings.append(f"'{path}': {counted(no_segmentation, 'annotation(s) without a segmentation')}: boxes "
                        "alone are not drawn")
    empty = [image.name for image in images.values() if not image.shapes]
    if empty:
        warnings.append(f"'{path}': {counted(empty, 'image(s) without annotations')}")
    return Export(images=list(images.values()), labels=categories, errors=errors, warnings=warnings,
                  numeric_labels=True)
