"""YOLO segmentation labels: one `.txt` per image, lines `class x1 y1 x2 y2 ...` normalized to 0..1.

Where the files are, for split `s` under data.root: the images in the folder the data YAML (`data.yaml`,
`dataset.yaml`, or the only `*.yaml` of data.root) names for `s` (`train:`, `val:`, `test:`; relative to its
`path:` or to the YAML's folder; Ultralytics' and Roboflow's exports), else `images/<s>/`, else `<s>/images/`;
`all` is `images/`. Each image's labels are the `.txt` of its stem in the matching `labels/` folder (the last
`images` of its path replaced by `labels`), or beside the image. An image without a label file has no shapes.
The classes are the YAML's `names` (a list, or a map of id -> name).

Coordinates are fractions of the image's width and height, 0 and 1 its outer edges; a pixel is inside a
polygon when its centre is. Lines of 4 coordinates are boxes (cx cy w h, YOLO's
detection format), drawn as rectangles. Overlaps: lines in file order, later on top. YOLO has no ignore id
and no background id: with data.uncovered=background the background is a class of its own before the names.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from syncseg.data.annotations.common import Export, counted, inside_root
from syncseg.data.annotations.shapes import AnnotatedImage, Shape

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp")
SPLIT_KEYS = {"val": ("val", "valid", "validation"), "valid": ("valid", "val"), "train": ("train",),
              "test": ("test",)}


def data_yaml(root: Path) -> Path | None:
    for name in ("data.yaml", "dataset.yaml", "data.yml"):
        if (root / name).is_file():
            return root / name
    found = sorted(root.glob("*.yaml"))
    return found[0] if len(found) == 1 else None


def _read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise ValueError(f"'{path}': not valid YAML ({str(error).splitlines()[0]})") from None
    if not isinstance(document, dict):
        raise ValueError(f"'{path}': a YOLO data YAML is a mapping with 'names' (and 'train:', 'val:')")
    return document


def names_of(root: Path) -> tuple[dict[int, str], Path | None]:
    """{class id: name} from the data YAML's `names` ({} without a YAML), and the YAML's path."""
    path = data_yaml(root)
    if path is None:
        return {}, None
    names = _read_yaml(path).get("names")
    if isinstance(names, list):
        return {index: str(name) for index, name in enumerate(names)}, path
    if isinstance(names, dict):
        try:
            return {int(key): str(value) for key, value in sorted(names.items(), key=lambda item: int(item[0]))}, path
        except (TypeError, ValueError):
            raise ValueError(f"'{path}': 'names' must map class ids (integers) to names") from None
    raise ValueError(f"'{path}': no 'names' list: a YOLO data YAML names its classes there")


def candidates(root: Path, split: str) -> list[Path]:
    found = []
    path = data_yaml(root)
    if path is not None:
        document = _read_yaml(path)
        base = Path(document["path"]) if document.get("path") else path.parent
        if not base.is_absolute():
            base = path.parent / base
        for key in SPLIT_KEYS.get(split, (split,)):
            value = document.get(key)
            if isinstance(value, str):
                found.append(base / value)
    found += [root / "images" / split, root / split / "images"]
    if split == "all":
        found.append(root / "images")
    return found


def label_file(image: Path) -> Path:
    parts = list(image.parts)
    if "images" in parts:
        index = len(parts) - 1 - parts[::-1].index("images")
        beside = Path(*parts[:index], "labels", *parts[index + 1:]).with_suffix(".txt")
        if beside.is_file():
            return beside
    return image.with_suffix(".txt")


def read_labels(path: Path, *, class_ids: set[int], errors: list[str], warnings: list[str]) -> list[Shape]:
    shapes = []
    boxes = outside = 0
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        fields = line.split()
        if not fields:
            continue
        ident = f"'{path}' line {number}"
        try:
            class_id, values = int(fields[0]), np.asarray([float(v) for v in fields[1:]])
        except ValueError:
            errors.append(f"{ident}: expected 'class x1 y1 x2 y2 ...' (an integer and numbers), got {line[:60]!r}")
            continue
        if class_id not in class_ids:
            errors.append(f"{ident}: class id {class_id} is not in the data YAML's names (ids 0..{max(class_ids)})"
                          if class_ids else f"{ident}: class id {class_id}, but no class names are known")
            continue
        if len(values) % 2:
            errors.append(f"{ident}: {len(values)} coordinates, an odd number; expected x, y pairs")
            continue
        if len(values) and (values.min() < 0 or values.max() > 1):
            outside += 1
        if len(values) == 4:  # a detection box: cx cy w h
            boxes += 1
            cx, cy, w, h = values
            shapes.append(Shape(label=class_id, kind="rectangle", ident=ident, style="corners",
                                rings=[np.array([[cx - w / 2, cy - h / 2], [cx + w / 2, cy + h / 2]])]))
            continue
        shapes.append(Shape(label=class_id, kind="polygon", ident=ident, style="corners",
                            rings=[values.reshape(-1, 2)]))
    if boxes:
        warnings.append(f"'{path}': {boxes} line(s) are boxes (4 coordinates), drawn as rectangles")
    if outside:
        warnings.append(f"'{path}': {outside} line(s) have coordinates outside 0..1: clipped at the image's edges")
    return shapes


def read(folder: Path, *, root: Path, split: str) -> Export:
    """The images under `folder` and their label files as one Export (coordinates still normalized: the
    dataset scales them to each image's size)."""
    names, yaml_path = names_of(root)
    errors: list[str] = []
    warnings: list[str] = []
    if not names:
        errors.append(f"'{root}': no data YAML (data.yaml) with the 'names' of the class ids: write one, as "
                      "Ultralytics' exports have")
    images = []
    unlabelled = []
    for image_path in sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()):
        try:
            image_path = inside_root(root, image_path, source=yaml_path or folder, what="image")
        except ValueError as error:
            errors.append(str(error))
            continue
        labels = label_file(image_path)
        shapes = read_labels(labels, class_ids=set(names), errors=errors, warnings=warnings) if labels.is_file() else []
        if not labels.is_file():
            unlabelled.append(image_path.name)
        images.append(AnnotatedImage(name=image_path.stem, image=image_path, source=labels, shapes=shapes,
                                     normalized=True))
    if unlabelled:
        warnings.append(f"'{folder}': {counted(unlabelled, 'image(s) without a label file')}: no shapes")
    if not images:
        errors.append(f"'{folder}': no images")
    return Export(images=images, labels=names, errors=errors, warnings=warnings, numeric_labels=True)
