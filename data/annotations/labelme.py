"""Labelme JSON: one file per image, with polygon, rectangle, circle, line, linestrip, point and mask shapes.

Where the files are, for split `s` under data.root: the `*.json` files in `<s>/` (and its subfolders), or in
data.root itself for `all`. The classes are `labels.txt` in data.root or the split's folder when there is one
(labelme2voc's file: `__ignore__` and `_background_` first, then one class per line), else the background
and every label found in data.root's JSON files, sorted. An image is `imagePath`, relative to its JSON
file and inside data.root, or the JSON's embedded `imageData` when that file is missing.

Shapes are drawn as labelme2voc draws them (PIL, outline included): in file order, later on top; lines and
linestrips data.line_width pixels wide (labelme's default 10), points as discs of radius line_width / 2;
mask shapes are their PNG placed at their first point. Shapes labelled `__ignore__` (data.ignore_labels) mark
ignored pixels, drawn in their place in the order like any other shape.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from syncseg.data.annotations.common import Export, counted, inside_root, read_json
from syncseg.data.annotations.shapes import AnnotatedImage, Shape

SHAPE_KINDS = {"polygon": "polygon", "rectangle": "rectangle", "circle": "circle", "line": "line",
               "linestrip": "line", "point": "point", "points": "point", "mask": "bitmap"}


def candidates(root: Path, split: str) -> list[Path]:
    return [root] if split == "all" else [root / split]


def labels_file(root: Path, folder: Path) -> Path | None:
    for place in (folder / "labels.txt", root / "labels.txt"):
        if place.is_file():
            return place
    return None


def json_files(folder: Path) -> list[Path]:
    return sorted(path for path in folder.rglob("*.json") if path.is_file())


def _shape(entry: Any, ident: str, line_width: float, errors: list[str]) -> Shape | None:
    if not isinstance(entry, dict):
        errors.append(f"{ident}: a shape must be an object with 'label', 'points' and 'shape_type'")
        return None
    kind = SHAPE_KINDS.get(entry.get("shape_type") or "polygon")
    if kind is None:
        errors.append(f"{ident}: shape_type {entry.get('shape_type')!r} is not one of {', '.join(SHAPE_KINDS)}")
        return None
    try:
        points = np.asarray(entry.get("points") or [], dtype=np.float64).reshape(-1, 2)
    except (TypeError, ValueError):
        errors.append(f"{ident}: 'points' must be a list of [x, y] pairs")
        return None
    label = str(entry.get("label", ""))
    if kind == "bitmap":
        if not entry.get("mask") or len(points) < 1:
            errors.append(f"{ident}: a mask shape needs its 'mask' (a base64 PNG) and its corner points")
            return None
        return Shape(label=label, kind="bitmap", ident=ident, encoding="png", encoded=str(entry["mask"]),
                     left=int(points[0][0]),
                     top=int(points[0][1]), rings=[points])
    width = line_width if kind == "line" else line_width / 2 if kind == "point" else 0.0
    return Shape(label=label, kind=kind, ident=ident, rings=[points], style="pil", width=width)


def read_file(path: Path, document: dict[str, Any], *, root: Path,
              line_width: float) -> tuple[AnnotatedImage | None, list[str]]:
    """One labelme JSON `document` read from `path` -> (its image and shapes, or None when it cannot be used;
    its errors)."""
    errors: list[str] = []
    shapes = []
    for number, entry in enumerate(document.get("shapes") or []):
        shape = _shape(entry, f"'{path}' shape {number}", line_width, errors)
        if shape is not None:
            shapes.append(shape)
    image_path = document.get("imagePath") or ""
    image, embedded = None, None
    if image_path:
        try:
            candidate = inside_root(root, path.parent / str(image_path).replace("\\", "/"), source=path,
                                    what="imagePath")
        except ValueError as error:
            return None, [*errors, str(error)]
        image = candidate if candidate.is_file() else None
    if image is None and document.get("imageData"):
        embedded = str(document["imageData"])
    if image is None and embedded is None:
        return None, [*errors, f"'{path}': its image '{image_path}' is not found (relative to the JSON's folder) and "
                      "it embeds none (imageData)"]
    height, width = document.get("imageHeight"), document.get("imageWidth")
    stated = (int(height), int(width)) if height and width else None
    return AnnotatedImage(name=path.stem, image=image, source=path, shapes=shapes, stated_size=stated,
                          embedded=embedded), errors


def _labels_of(document: Any) -> set[str]:
    """The labels of a labelme document's shapes (nothing for JSON that is not labelme's)."""
    if not isinstance(document, dict):
        return set()
    return {str(shape.get("label", "")) for shape in document.get("shapes") or [] if isinstance(shape, dict)}


def read_labels_file(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def read(folder: Path, *, root: Path, split: str, line_width: float) -> Export:
    """Every labelme JSON under `folder` as one Export."""
    errors: list[str] = []
    warnings = []
    images = []
    others = []
    seen: set[str] = set()  # every label of the data root, for a class list without labels.txt
    files = json_files(folder)
    read_here = set(files)
    for path in files:
        try:
            document = read_json(path)
        except ValueError as error:
            errors.append(str(error))
            continue
        if not isinstance(document, dict) or "shapes" not in document:
            others.append(path.name)  # a COCO file or a config beside the labelme files
            continue
        seen.update(_labels_of(document))
        image, found = read_file(path, document, root=root, line_width=line_width)
        errors.extend(found)
        if image is not None:
            images.append(image)
    if others:
        warnings.append(f"'{folder}': {counted(others, 'JSON file(s) that are not labelme files')}: left out")
    listed = labels_file(root, folder)
    if listed is not None:
        names = read_labels_file(listed)
    else:  # the labels of the other splits' files too, so that all splits get one class list
        for path in json_files(root):
            if path not in read_here:
                try:
                    seen.update(_labels_of(read_json(path)))
                except ValueError:
                    continue  # said where its split is read
        names = sorted(seen)
    empty = [image.name for image in images if not image.shapes]
    if empty:
        warnings.append(f"'{folder}': {counted(empty, 'image(s) without shapes')}")
    if not images and not errors:
        errors.append(f"'{folder}': no labelme JSON files")
    export = Export(images=images, labels={name: name for name in names}, errors=errors, warnings=warnings)
    if listed is not None:
        unknown = sorted({shape.label for image in images for shape in image.shapes} - set(names))
        for label in unknown:
            export.errors.append(f"'{listed}': does not list the label '{label}' used in "
                                 f"'{next(i.source for i in images if any(s.label == label for s in i.shapes))}'")
    return export
