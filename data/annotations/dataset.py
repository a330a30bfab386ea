"""The annotation data set kinds: an export's images with their shapes drawn into masks when loaded.

`build_<format>(data_cfg, split, transform)` is the registered builder of each kind (syncseg.data.registry).
It finds the split's export under data.root (each reader's `candidates`, or data.annotations with `<split>.txt`
lists of image names), reads it once, builds the class table and returns an `AnnotatedSegmentation`. Problems
that make the export unusable (malformed files, unknown categories, missing images, paths outside data.root)
are one AnnotationError listing every one; the rest are listing warnings, said once at the start of training
and by verify_dataset. Masks are drawn on the fly, in the loader's workers (benchmarks/bench_data.py measures
what it costs against decoding alone): no cache to go stale when the export changes.

The classes: data.class_names when given (labels map to them by name), else the export's own labels in its
order (COCO categories by id, labelme's labels.txt, CVAT's <labels>, YOLO's names; sorted where the tool keeps
no list) with a `background` class first when data.uncovered=background and no label is the background
(`background`, `_background_`). data.ignore_labels (default `__ignore__`) mark ignored regions; data.label_map
maps numeric ids (COCO category ids, YOLO class ids) to a class index or ignore.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from syncseg.data.annotations import coco, cvat, label_studio, labelme, yolo_seg
from syncseg.data.annotations.common import BACKGROUND_NAMES, AnnotationError, AnnotationOptions, Export
from syncseg.data.annotations.problems import shape_problems
from syncseg.data.annotations.shapes import AnnotatedImage, Shape, decode_embedded_image, rasterize
from syncseg.data.base import SegmentationDataset, Transform
from syncseg.data.constants import IGNORE
from syncseg.data.images import ImageFormat, read_image
from syncseg.data.masks import BadSampleError, MaskSampleReport
from syncseg.data.palettes import bit_palette
from syncseg.data.transforms import IGNORE_INDEX

logger = logging.getLogger(__name__)

READERS = {"coco": coco, "labelme": labelme, "cvat": cvat, "yolo_seg": yolo_seg, "label_studio": label_studio}
FOLDER_EXPORTS = ("labelme", "yolo_seg")  # exports that are a folder of files, not one file
MAX_PROBLEM_LINES = 20  # lines of shape problems the start of training logs; verify_dataset prints them all
# below this share of pixels drawn by some shape, data.uncovered=background is worth a second look: sparse labels
# (a few polygons per image) train every undrawn pixel as background; exhaustive ones (COCO) cover more
SPARSE_COVERAGE = 0.2


@dataclass(frozen=True)
class ClassTable:
    """The classes, each label key's class index (or the ignore index), and the value of uncovered pixels."""

    classes: tuple[str, ...]
    values: dict[Any, int]
    uncovered: int


def _is_background(name: str) -> bool:
    return name.lower() in BACKGROUND_NAMES


def build_class_table(export: Export, *, class_names: Sequence[str], label_map: Sequence[tuple[int, Any]],
                      options: AnnotationOptions, ignore_index: int, description: str) -> ClassTable:
    """The ClassTable of `export` under the config (see the module docstring); AnnotationError naming every
    label that has no class."""
    ignored = set(options.ignore_labels)
    problems: list[str] = []
    mapped = {int(raw): (ignore_index if target == IGNORE else int(target)) for raw, target in label_map}
    if class_names:
        classes = tuple(class_names)
    else:
        names = list(dict.fromkeys(name for name in export.labels.values() if name not in ignored))
        if options.uncovered == "background" and not any(_is_background(name) for name in names):
            names.insert(0, "background")
        classes = tuple(names)
    values: dict[Any, int] = {}
    for key, name in export.labels.items():
        if key in mapped:
            values[key] = mapped[key]
        elif name in ignored:
            values[key] = ignore_index
        elif name in classes:
            values[key] = classes.index(name)
        else:
            id_note = f" (id {key})" if export.numeric_labels else ""
            fix = " or map its id with data.label_map" if export.numeric_labels else ""
            problems.append(f"{description}: the label '{name}'{id_note} is not in data.class_names "
                            f"({', '.join(classes)}); add it{fix}, or list it in data.ignore_labels")
    used = {shape.label for image in export.images for shape in image.shapes}
    for key in sorted(used - set(values), key=str):
        values[key] = ignore_index if str(key) in ignored else -1
        if values[key] < 0:
            example = next(image for image in export.images if any(s.label == key for s in image.shapes))
            problems.append(f"{description}: {example.describe()} uses the label {key!r}, which the export does not "
                            "declare")
    for raw, value in mapped.items():
        if value != ignore_index and not 0 <= value < len(classes):
            problems.append(f"{description}: data.label_map maps {raw} to {value}; there are {len(classes)} classes "
                            f"({', '.join(classes)})")
    if options.uncovered == "background":
        backgrounds = [index for index, name in enumerate(classes) if _is_background(name)]
        if not backgrounds:
            problems.append(f"{description}: data.uncovered=background but no class is the background "
                            f"(data.class_names {', '.join(classes)}); name one 'background', or set "
                            "data.uncovered=ignore")
            uncovered = ignore_index
        else:
            uncovered = backgrounds[0]
    else:
        uncovered = ignore_index
    if not classes:
        problems.append(f"{description}: no classes: the export declares no labels; give data.class_names")
    if len(classes) >= ignore_index and ignore_index < 256:
        problems.append(f"{description}: {len(classes)} classes reach data.ignore_index={ignore_index}")
    if problems:
        raise AnnotationError(problems, description=description)
    return ClassTable(classes=classes, values=values, uncovered=uncovered)


def _list_file_names(path: Path) -> list[str]:
    return [Path(line.split()[0]).stem for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def find_export(kind: str, root: Path, split: str, annotations: str) -> tuple[Path, list[str] | None]:
    """(the export's file or folder for `split`, the image names `<split>.txt` keeps or None for all of them);
    FileNotFoundError naming what was looked for."""
    reader = READERS[kind]
    list_file = root / f"{split}.txt"
    if annotations:
        export = root / annotations
        if not export.exists():
            raise FileNotFoundError(f"{kind} dataset: data.annotations '{export}' not found")
        if split == "all":
            return export, None
        if list_file.is_file():
            return export, _list_file_names(list_file)
        raise FileNotFoundError(f"{kind} dataset: split '{split}': with data.annotations set, a split is 'all' or a "
                                f"list of image names in '{list_file}' (one per line), which is not there")
    tried = reader.candidates(root, split)
    for place in tried:
        if (place.is_dir() if kind in FOLDER_EXPORTS else place.is_file()):
            return place, None
    if list_file.is_file():
        for place in reader.candidates(root, "all"):
            if (place.is_dir() if kind in FOLDER_EXPORTS else place.is_file()):
                return place, _list_file_names(list_file)
    raise FileNotFoundError(f"{kind} dataset: split '{split}' not found under '{root}': looked for "
                            f"{', '.join(repr(str(p)) for p in tried)} and '{list_file}'; or set data.annotations to "
                            "the export's path (docs/own-data.md)")


def read_export(kind: str, root: Path, split: str, *, annotations: str = "",
                options: AnnotationOptions = AnnotationOptions()) -> tuple[Export, str]:
    """The export of `split` (images filtered by a list file) and a description naming it; AnnotationError for
    its errors (all of them, one line each)."""
    place, names = find_export(kind, root, split, annotations)
    description = f"{kind} {split} ({place})"
    if kind == "coco":
        export = coco.read(place, root=root, split=split)
    elif kind == "labelme":
        export = labelme.read(place, root=root, split=split, line_width=options.line_width)
    elif kind == "cvat":
        export = cvat.read(place, root=root, split=split, line_width=options.line_width)
    elif kind == "yolo_seg":
        export = yolo_seg.read(place, root=root, split=split)
    else:
        export = label_studio.read(place, root=root, split=split)
    if names is not None:
        wanted = set(names)
        found = {image.name for image in export.images}
        unknown = [name for name in names if name not in found]
        if unknown:
            export.errors.append(f"'{root / (split + '.txt')}' lists {len(unknown)} name(s) with no image in "
                                 f"'{place}' (first: {unknown[0]!r})")
        order = {name: position for position, name in reversed(list(enumerate(names)))}
        # the list's order, as a folder data set keeps it: the same list gives the same batches
        export.images = sorted((image for image in export.images if image.name in wanted),
                               key=lambda image: order[image.name])
    if export.errors:
        raise AnnotationError(export.errors, description=description)
    if not export.images:
        raise AnnotationError([f"'{place}': no images"], description=description)
    return export, description


def _scaled(shapes: list[Shape], height: int, width: int) -> list[Shape]:
    scale = np.array([width, height], dtype=np.float64)
    return [replace(shape, rings=[ring * scale for ring in shape.rings]) for shape in shapes]


class AnnotatedSegmentation(SegmentationDataset):
    """An annotation export as a data set: `images` (AnnotatedImage) drawn through `table` when loaded;
    samples are (image file, annotation file) pairs (the annotation file twice for an embedded image)."""

    def __init__(self, images: list[AnnotatedImage], table: ClassTable, *, description: str,
                 options: AnnotationOptions, ignore_index: int = IGNORE_INDEX, transform: Transform | None = None,
                 image_format: ImageFormat = ImageFormat(), listing_warnings: Sequence[str] = (),
                 numeric_labels: bool = False) -> None:
        self.images = images
        self.table = table
        self.options = options
        self.numeric_labels = numeric_labels
        # (image, annotation file): a YOLO image without a label file stands for its own annotation
        samples = [(image.image or image.source, image.source if image.source.is_file() else image.image)
                   for image in images]
        super().__init__(samples, classes=table.classes,
                         palette=bit_palette(len(table.classes)), ignore_index=ignore_index, transform=transform,
                         skip_bad_samples=options.skip_bad_samples, description=description,
                         image_format=image_format, listing_warnings=listing_warnings)

    def name_of(self, index: int) -> str:
        return self.images[index].name

    @property
    def label_ids(self) -> list[int | None] | None:
        """Class index -> the export's numeric label id that draws it (COCO category id, YOLO class id; None for
        a class no id draws, such as an added background), or None for exports of named labels."""
        if not self.numeric_labels:
            return None
        ids: list[int | None] = [None] * len(self.classes)
        for key, value in self.table.values.items():
            if 0 <= value < len(ids) and ids[value] is None:
                ids[value] = int(key)
        return ids

    def value_of(self, shape: Shape) -> int:
        if shape.crowd and self.options.iscrowd == "ignore":
            return self.ignore_index
        return self.table.values[shape.label]

    def _image(self, index: int) -> np.ndarray:
        record = self.images[index]
        if record.image is None:
            try:
                return decode_embedded_image(record.embedded or "")
            except (OSError, ValueError) as error:
                raise BadSampleError(f"'{record.source}': its embedded image (imageData) cannot be read: "
                                     f"{error}") from None
        return read_image(record.image, self.image_format)

    def image_size(self, index: int) -> tuple[int, int]:
        if self.images[index].image is None:
            return self._image(index).shape[:2]
        return super().image_size(index)

    def shapes_for(self, index: int, height: int, width: int) -> list[Shape]:
        """Sample `index`'s shapes in the pixels of its `height` x `width` image; BadSampleError when the
        annotation file states another size."""
        record = self.images[index]
        if record.stated_size is not None and tuple(record.stated_size) != (height, width):
            raise BadSampleError(f"{record.describe()}: the annotation states the image as {record.stated_size[1]}x"
                                 f"{record.stated_size[0]} but '{record.image or record.source}' is {width}x{height} "
                                 "(width x height): the shapes belong to another version of the image")
        return _scaled(record.shapes, height, width) if record.normalized else record.shapes

    def labels_for(self, index: int, height: int, width: int) -> np.ndarray:
        """HxW uint8 labels of sample `index` drawn for an image of `height` x `width`; BadSampleError."""
        shapes = self.shapes_for(index, height, width)
        try:
            return rasterize(shapes, height, width, value_of=self.value_of, uncovered=self.table.uncovered)
        except ValueError as error:
            raise BadSampleError(f"{self.images[index].describe()}: {error}") from None

    def load(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        image = self._image(index)
        return image, self.labels_for(index, *image.shape[:2])

    def shape_report(self, index: int) -> tuple[list[str], list[str]]:
        """(errors, warnings) about sample `index`'s shapes, one line each (syncseg.data.annotations.shapes)."""
        try:
            height, width = self.image_size(index)
            shapes = self.shapes_for(index, height, width)
        except BadSampleError as error:
            return [str(error)], []
        errors, warnings = [], []
        for shape in shapes:
            found_errors, found_warnings = shape_problems(shape, height, width)
            errors += found_errors
            warnings += found_warnings
        return errors, warnings

    def inspect_masks(self, limit: int, *, every_line: bool = False) -> MaskSampleReport:
        """The shapes of `limit` samples spread over the split (all when limit <= 0): a self-intersecting polygon,
        an RLE or a stated size that is not the image's are bad samples; polygons of fewer than 3 points, zero
        areas and coordinates outside the image are warnings (at most MAX_PROBLEM_LINES lines, unless every_line), and
        so is data.uncovered=background where the shapes cover less than SPARSE_COVERAGE of the pixels."""
        indices = self._spread(limit)
        report = MaskSampleReport(num_checked=len(indices))
        warnings = []
        covered = pixels = 0
        for index in indices:
            errors, found = self.shape_report(index)
            warnings += found
            if errors:
                report.bad.append("; ".join(errors))
                report.bad_paths.append(str(self.images[index].source))
            elif self.options.uncovered == "background":
                height, width = self.image_size(index)
                drawn = rasterize(self.shapes_for(index, height, width), height, width, value_of=lambda shape: 1,
                                  uncovered=0)
                covered, pixels = covered + int(drawn.sum()), pixels + drawn.size
        if pixels and covered / pixels < SPARSE_COVERAGE:
            warnings.insert(0, f"{self.description}: the shapes cover {covered / pixels:.1%} of the pixels of the "
                               f"{len(indices)} images checked, and data.uncovered=background trains the rest as "
                               "background; if they are not all background (sparse labels: a few polygons per "
                               "image), set data.uncovered=ignore and start from base: small_data.yaml")
        if not every_line and len(warnings) > MAX_PROBLEM_LINES:
            warnings = [*warnings[:MAX_PROBLEM_LINES], f"{self.description}: and {len(warnings) - MAX_PROBLEM_LINES} "
                        "more shape warnings (`python -m syncseg verify` lists them all)"]
        report.warnings = warnings
        return report

    def inspect_images(self, limit: int) -> list[str]:
        if any(image.image is None for image in self.images):
            return []  # embedded images are decoded as 8-bit RGB: nothing stored otherwise to warn about
        return super().inspect_images(limit)


def build_annotated(kind: str, data_cfg: Any, split: str, transform: Transform) -> AnnotatedSegmentation:
    """The `kind` data set of `split` under a validated `data` config section."""
    if not str(data_cfg.root):
        raise FileNotFoundError(f"data.root is empty for dataset '{kind}'; set it to the folder of the export "
                                "(docs/own-data.md)")
    root = Path(data_cfg.root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"{kind} dataset: data.root '{root}' is not a folder")
    options = AnnotationOptions.of(data_cfg)
    export, description = read_export(kind, root, split, annotations=data_cfg.annotations, options=options)
    table = build_class_table(export, class_names=data_cfg.class_names, label_map=data_cfg.label_map,
                              options=options, ignore_index=data_cfg.ignore_index, description=description)
    return AnnotatedSegmentation(export.images, table, description=description, options=options,
                                 ignore_index=data_cfg.ignore_index, transform=transform,
                                 image_format=ImageFormat.of(data_cfg), listing_warnings=export.warnings,
                                 numeric_labels=export.numeric_labels)


def build_coco(data_cfg: Any, split: str, transform: Transform) -> AnnotatedSegmentation:
    return build_annotated("coco", data_cfg, split, transform)


def build_labelme(data_cfg: Any, split: str, transform: Transform) -> AnnotatedSegmentation:
    return build_annotated("labelme", data_cfg, split, transform)


def build_cvat(data_cfg: Any, split: str, transform: Transform) -> AnnotatedSegmentation:
    return build_annotated("cvat", data_cfg, split, transform)


def build_yolo_seg(data_cfg: Any, split: str, transform: Transform) -> AnnotatedSegmentation:
    return build_annotated("yolo_seg", data_cfg, split, transform)


def build_label_studio(data_cfg: Any, split: str, transform: Transform) -> AnnotatedSegmentation:
    return build_annotated("label_studio", data_cfg, split, transform)
