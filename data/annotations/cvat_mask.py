"""CVAT's "Segmentation mask 1.1" export: colour PNG masks whose colours `labelmap.txt` names.

Layout under data.root, as CVAT writes it: `labelmap.txt` (`# label:color_rgb:parts:actions`, then lines such as
`background:0,0,0::` and `car:250,50,83::`), `SegmentationClass/<name>.png` (each pixel the colour of its
label), `JPEGImages/<name>.<ext>` (exported with images) and `ImageSets/Segmentation/<split>.txt` (CVAT writes
`default.txt`; `all` takes every mask). The classes are labelmap.txt's labels in its order; with
data.uncovered=ignore the background label (`background`) becomes the ignore label instead, and labels named in
data.ignore_labels are ignored. A colour labelmap.txt does not list makes the mask bad, naming the colours.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from syncseg.data.annotations.common import BACKGROUND_NAMES, AnnotationOptions
from syncseg.data.base import SegmentationDataset, Transform
from syncseg.data.constants import IGNORE
from syncseg.data.images import ImageFormat
from syncseg.data.masks import BadSampleError, MaskSampleReport
from syncseg.data.palettes import bit_palette

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp")


def read_labelmap(path: Path) -> list[tuple[str, tuple[int, int, int]]]:
    """labelmap.txt -> [(label, (R, G, B))] in its order; ValueError naming the line that is not `name:R,G,B:...`."""
    entries = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        fields = line.split(":")
        try:
            red, green, blue = (int(value) for value in fields[1].split(","))
        except (IndexError, ValueError):
            raise ValueError(f"'{path}' line {number}: expected 'label:R,G,B:parts:actions', "
                             f"got {line[:60]!r}") from None
        if not all(0 <= value <= 255 for value in (red, green, blue)):
            raise ValueError(f"'{path}' line {number}: colour values must be 0..255, got {fields[1]!r}")
        entries.append((fields[0], (red, green, blue)))
    if not entries:
        raise ValueError(f"'{path}': no labels")
    return entries


class CvatMaskSegmentation(SegmentationDataset):
    """A Segmentation mask 1.1 export: colour masks read through `labelmap`'s colours, which its messages name
    (the colours come from that file, not from data.class_colors)."""

    def __init__(self, *args: Any, labelmap: Path, **kwargs: Any) -> None:
        self.labelmap = labelmap
        super().__init__(*args, **kwargs)

    def _named(self, message: str) -> str:
        return message.replace("not in data.class_colors", f"not in '{self.labelmap}'")

    def load(self, index: int) -> Any:
        try:
            return super().load(index)
        except BadSampleError as error:
            raise BadSampleError(self._named(str(error))) from None

    def inspect_masks(self, limit: int) -> MaskSampleReport:
        report = super().inspect_masks(limit)
        report.bad = [self._named(message) for message in report.bad]
        return report


def build_cvat_mask(data_cfg: Any, split: str, transform: Transform) -> CvatMaskSegmentation:
    """data.dataset=cvat_mask: `split` of a validated `data` config section."""
    root = Path(data_cfg.root).expanduser()
    labelmap = root / "labelmap.txt"
    if not str(data_cfg.root) or not labelmap.is_file():
        raise FileNotFoundError(f"cvat_mask dataset: '{labelmap}' not found; data.root must be the folder of CVAT's "
                                "'Segmentation mask 1.1' export (labelmap.txt, SegmentationClass/, JPEGImages/)")
    options = AnnotationOptions.of(data_cfg)
    entries = read_labelmap(labelmap)
    ignored = set(options.ignore_labels) | ({name for name, _ in entries if name.lower() in BACKGROUND_NAMES}
                                             if options.uncovered == "ignore" else set())
    classes = [name for name, _ in entries if name not in ignored]
    if data_cfg.class_names:
        unknown = [name for name in classes if name not in data_cfg.class_names]
        if unknown:
            raise ValueError(f"'{labelmap}': the label '{unknown[0]}' is not in data.class_names "
                             f"({', '.join(data_cfg.class_names)}); add it, or list it in data.ignore_labels")
        classes = list(data_cfg.class_names)
    colours = [(rgb, IGNORE if name in ignored else classes.index(name)) for name, rgb in entries]
    masks = root / "SegmentationClass"
    list_file = root / "ImageSets" / "Segmentation" / f"{split}.txt"
    if list_file.is_file():
        names = [line.split()[0] for line in list_file.read_text().splitlines() if line.strip()]
    elif split == "all":
        names = sorted(path.stem for path in masks.glob("*.png"))
    else:
        raise FileNotFoundError(f"cvat_mask dataset: split '{split}' not found: no '{list_file}' (CVAT writes "
                                "default.txt: data.train_split=default, or 'all')")
    samples = []
    for name in names:
        found = [root / "JPEGImages" / f"{name}{suffix}" for suffix in IMAGE_EXTENSIONS]
        image = next((path for path in found if path.is_file()), found[0])
        samples.append((image, masks / f"{name}.png"))
    return CvatMaskSegmentation(samples, labelmap=labelmap, classes=classes, palette=bit_palette(len(classes)),
                               ignore_index=data_cfg.ignore_index, transform=transform,
                               skip_bad_samples=data_cfg.skip_bad_samples, class_colors=colours,
                               description=f"cvat_mask {split} ({root})", image_format=ImageFormat.of(data_cfg),
                               listed_in=f"'{list_file}'" if list_file.is_file() else None)
