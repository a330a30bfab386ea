"""What every annotation reader shares: its options (the data.* keys), what it returns, paths kept inside
the data root, and the one-line problems it collects."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from syncseg.data.annotations.shapes import AnnotatedImage

BACKGROUND_NAMES = ("background", "_background_", "__background__")  # what tools call the background class
NAMED_PROBLEMS = 20  # problems one error message quotes; verify_dataset prints them all


class AnnotationError(ValueError):
    """Annotation files that cannot be trained on; `problems` holds one line per problem (file and annotation)."""

    def __init__(self, problems: list[str], *, description: str) -> None:
        self.problems = list(problems)
        shown = "; ".join(self.problems[:3])
        more = f" (and {len(self.problems) - 3} more: `python -m syncseg verify` lists them all)" if len(
            self.problems) > 3 else ""
        super().__init__(f"{description}: {shown}{more}")


@dataclass(frozen=True)
class AnnotationOptions:
    """The data.* settings the readers take (syncseg.engine.config.schema.DataConfig documents them)."""

    uncovered: str = "background"  # pixels no shape covers: the background class, or "ignore"
    ignore_labels: tuple[str, ...] = ("__ignore__",)  # label names whose shapes mark ignored pixels
    iscrowd: str = "ignore"  # COCO iscrowd=1 regions: ignored, or "category" (their category's class)
    line_width: float = 10.0  # pixels: lines and polylines (labelme's default); points are discs of half that
    skip_bad_samples: bool = False

    @classmethod
    def of(cls, data_cfg: Any) -> "AnnotationOptions":
        return cls(uncovered=data_cfg.uncovered, ignore_labels=tuple(data_cfg.ignore_labels),
                   iscrowd=data_cfg.iscrowd, line_width=float(data_cfg.line_width),
                   skip_bad_samples=data_cfg.skip_bad_samples)


@dataclass
class Export:
    """What a reader found in one export: its images, the labels the file declares (key -> name, in the file's
    order: COCO category ids, YOLO class ids, label names), and the problems, each one line: `errors` make the
    export unusable (exit 2), `warnings` are said once (the start of training, verify_dataset)."""

    images: list[AnnotatedImage]
    labels: dict[Any, str]
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    numeric_labels: bool = False  # the keys are ids (data.label_map applies to them)


def require_pycocotools(kind: str) -> None:
    """ValueError (bad input: the config names what this environment cannot read) naming the pip extra when
    pycocotools, which draws COCO's and CVAT's polygons and RLE, is missing."""
    import importlib.util

    if importlib.util.find_spec("pycocotools") is None:
        raise ValueError(f"data.dataset={kind} draws polygons and RLE with pycocotools, which is not installed: "
                         "pip install \"syncseg[annotations]\" (or pip install pycocotools)")


def inside_root(root: Path, path: Path, *, source: Path | str, what: str) -> Path:
    """`path` resolved, which must lie inside the data root `root`; ValueError naming `source` otherwise: no
    annotation file may point a reader outside the data it was given."""
    resolved = Path(os.path.realpath(path))
    base = Path(os.path.realpath(root))
    if resolved != base and base not in resolved.parents:
        raise ValueError(f"'{source}': {what} '{path}' lies outside data.root '{root}'; annotation files may only "
                         "name files inside the data root")
    return resolved


def read_json(path: Path) -> Any:
    """The JSON in `path`; ValueError naming the file, the line and the column of malformed JSON."""
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except json.JSONDecodeError as error:
        raise ValueError(f"'{path}': not valid JSON (line {error.lineno}, column {error.colno}: {error.msg})") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"'{path}': not UTF-8 text ({error.reason} at byte {error.start})") from None


def find_image(names: list[str], folders: list[Path]) -> Path | None:
    """The first existing file `folder / name` over `folders` x `names` (None when none exists)."""
    for folder in folders:
        for name in names:
            if name and (folder / name).is_file():
                return folder / name
    return None


@dataclass
class ImageFinder:
    """An export's image files, looked for in `folders` by the names an annotation gives and kept inside
    `root`; the ones found nowhere make one line (`missing_problems`) instead of one per image."""

    root: Path
    folders: list[Path]
    source: Path
    missing: list[str] = field(default_factory=list)

    def find(self, names: list[str], *, what: str, errors: list[str], shown: str = "") -> Path | None:
        """The first of `names` in the folders (None, counted as missing under `shown` or the first name, when
        there is none; None and a line in `errors` when it lies outside the root)."""
        found = find_image(names, self.folders)
        if found is None:
            self.missing.append(shown or names[0])
            return None
        try:
            return inside_root(self.root, found, source=self.source, what=what)
        except ValueError as error:
            errors.append(str(error))
            return None

    def missing_problems(self, *, noun: str = "image file(s) not found", hint: str = "") -> list[str]:
        if not self.missing:
            return []
        return [f"'{self.source}': {counted(self.missing, noun)} (looked in "
                f"{', '.join(str(folder) for folder in self.folders)}{hint})"]


def repeated_names(source: Path, ids_by_name: dict[str, list[Any]]) -> list[str]:
    """One warning per file name that several images of the export share."""
    return [f"'{source}': the file name '{name}' is listed for {len(ids)} images (ids "
            f"{', '.join(map(str, ids[:5]))}): predictions of one overwrite the other's"
            for name, ids in ids_by_name.items() if len(ids) > 1]


def counted(items: list[str], what: str) -> str:
    """'3 images (first: a.jpg, b.jpg, c.jpg)' with at most three named."""
    shown = ", ".join(items[:3]) + (" ..." if len(items) > 3 else "")
    return f"{len(items)} {what} (first: {shown})"
