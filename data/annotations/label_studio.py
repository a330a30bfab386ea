"""Label Studio JSON export: BrushLabels (Label Studio's RLE) and PolygonLabels results, per task.

Where the file is, for split `s` under data.root: `<s>.json`, `annotations/<s>.json`, and for `all` also
`result.json` / `export.json`. Each task's image (`data.image`, or the task's only data value) is an upload
path (`/data/upload/3/8f1e2d3c-photo.jpg`), a local-files path (`/data/local-files/?d=images/photo.jpg`) or a
URL: syncseg looks for its file name in `images/` and data.root, with and without the 8-character prefix Label
Studio gives uploads. The classes are data.class_names when given, else the background and every label of
the file, sorted. A task's last annotation that was not cancelled is its labels (a task labelled by several
people is said once).

Polygons are in percent of the image (`original_width`, `original_height`) and drawn with PIL as Label
Studio's converter does; brushes are RLE-packed RGBA images whose alpha is the mask. Overlaps: results in
their order, later on top.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

import numpy as np

from syncseg.data.annotations.codecs import brush_rle_length
from syncseg.data.annotations.common import Export, ImageFinder, counted, read_json
from syncseg.data.annotations.shapes import AnnotatedImage, Shape

UPLOAD_PREFIX = re.compile(r"^[0-9a-f]{8}-")


def candidates(root: Path, split: str) -> list[Path]:
    found = [root / f"{split}.json", root / "annotations" / f"{split}.json"]
    if split == "all":
        found += [root / "result.json", root / "export.json"]
    return found


def image_reference(task: dict[str, Any]) -> str:
    data = task.get("data") if isinstance(task.get("data"), dict) else {}
    value = data.get("image")
    if value is None and len(data) == 1:
        value = next(iter(data.values()))
    return str(value) if value else ""


def _names_for(reference: str) -> list[str]:
    parsed = urlparse(reference)
    query = parse_qs(parsed.query)
    if "d" in query:  # local files: the path is relative to Label Studio's document root
        local = unquote(query["d"][0])
        return [local, Path(local).name]
    name = Path(unquote(parsed.path)).name
    return [name, UPLOAD_PREFIX.sub("", name)]


def _results(task: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
    annotations = [a for a in task.get("annotations") or [] if isinstance(a, dict) and not a.get("was_cancelled")]
    if not annotations:
        return [], 0
    return [r for r in annotations[-1].get("result") or [] if isinstance(r, dict)], len(annotations)


def _shape(result: dict[str, Any], ident: str, errors: list[str]) -> Shape | None:
    kind = str(result.get("type", "")).lower()
    value = result.get("value") if isinstance(result.get("value"), dict) else {}
    width, height = result.get("original_width"), result.get("original_height")
    if kind not in ("polygonlabels", "brushlabels"):
        return None
    labels = value.get(kind) or []
    if not labels:
        errors.append(f"{ident}: a {kind} result without a label")
        return None
    if not width or not height:
        errors.append(f"{ident}: no original_width / original_height: Label Studio's coordinates are relative "
                      "to them")
        return None
    if kind == "polygonlabels":
        points = np.asarray(value.get("points") or [], dtype=np.float64).reshape(-1, 2)
        points = points / 100.0 * np.array([width, height])
        return Shape(label=str(labels[0]), kind="polygon", ident=ident, rings=[points], style="pil")
    rle = [int(v) for v in value.get("rle") or []]
    count = brush_rle_length(rle)
    if count != int(width) * int(height) * 4:
        errors.append(f"{ident}: its brush RLE holds {count / 4:g} pixels but the image is {width}x{height}")
        return None
    return Shape(label=str(labels[0]), kind="bitmap", ident=ident, encoding="brush",
                 encoded=(tuple(rle), int(width), int(height)))


def read(path: Path, *, root: Path, split: str) -> Export:
    """The Label Studio JSON export `path` (images under `root`) as an Export."""
    document = read_json(path)
    if not isinstance(document, list):
        raise ValueError(f"'{path}': a Label Studio JSON export is a list of tasks (export as 'JSON', not 'JSON_MIN')")
    errors: list[str] = []
    warnings: list[str] = []
    folders = [root / "images", path.parent, root]
    images, several, seen = [], [], set()
    finder = ImageFinder(root, folders, path)
    other_types: dict[str, int] = {}  # results that are not regions: rectangles, choices, keypoints ...
    for number, task in enumerate(document):
        if not isinstance(task, dict):
            errors.append(f"'{path}' task {number}: not an object")
            continue
        ident = f"task {task.get('id', number)}"
        reference = image_reference(task)
        if not reference:
            errors.append(f"'{path}' {ident}: has no image (data.image)")
            continue
        found = finder.find(_names_for(reference), what=f"{ident}'s image", errors=errors, shown=reference)
        if found is None:
            continue
        results, num_annotations = _results(task)
        if num_annotations > 1:
            several.append(str(task.get("id", number)))
        shapes, stated = [], None
        for index, result in enumerate(results):
            kind = str(result.get("type", "")).lower()
            if kind not in ("polygonlabels", "brushlabels"):
                other_types[kind] = other_types.get(kind, 0) + 1
                continue
            shape = _shape(result, f"'{path}' {ident} result {result.get('id', index)}", errors)
            if shape is not None:
                shapes.append(shape)
                seen.add(shape.label)
                stated = (int(result["original_height"]), int(result["original_width"]))
        images.append(AnnotatedImage(name=found.stem, image=found, source=path, shapes=shapes, stated_size=stated,
                                     ident=ident))
    errors += finder.missing_problems(noun="image(s) not found",
                                      hint="; put the files Label Studio was given there")
    if other_types:
        listed = ", ".join(f"{count} {kind or 'untyped'}" for kind, count in sorted(other_types.items()))
        warnings.append(f"'{path}': results that are not polygons or brushes are left out ({listed})")
    if several:
        warnings.append(f"'{path}': {counted(several, 'task(s) annotated more than once')}: the last annotation "
                        "of each is read")
    empty = [image.name for image in images if not image.shapes]
    if empty:
        warnings.append(f"'{path}': {counted(empty, 'task(s) without regions')}")
    return Export(images=images, labels={name: name for name in sorted(seen)}, errors=errors, warnings=warnings)
