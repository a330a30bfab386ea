"""A generic dataset for custom data: images/ and masks/ folders paired by file stem.

Layout under `root`:
    images/<name>.{jpg,jpeg,png,bmp,tif,tiff,webp}   8-bit RGB, or 1 / N channels, 8 / 16 bits as
                                        data.in_channels and data.max_value say (syncseg.data.images)
    masks/<name>.png                    single-channel index PNGs (palette or grayscale); the value
                                        data.ignore_index (default 255) marks unlabeled pixels; other
                                        values through data.label_map / data.reduce_zero_label, colour
                                        masks through data.class_colors (syncseg.data.masks)
    <split>.txt                         optional: one image stem per line
Split resolution: `root/<split>.txt` if it exists, else subfolders `images/<split>/` + `masks/<split>/`,
else split "all" takes every image in images/.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from syncseg.data.base import LabelTarget, SegmentationDataset, Transform, mask_encoding
from syncseg.data.checks import same_stem_warning
from syncseg.data.images import ImageFormat
from syncseg.data.palettes import bit_palette
from syncseg.data.transforms import IGNORE_INDEX

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp")
LAYOUT = (
    "expected images/<name>.jpg|png and masks/<name>.png (index PNGs, data.ignore_index = unlabeled) under data.root, "
    "and either <split>.txt (one name per line), images/<split>/ + masks/<split>/ subfolders, or split 'all'"
)


def _images_by_stem(folder: Path) -> tuple[dict[str, Path], dict[str, list[Path]]]:
    """{name: image file} of the images in `folder`, and {name: its files} for the names that have more than
    one (s000.jpg beside s000.png): the last file in sorted order is the one read."""
    files: dict[str, list[Path]] = {}
    for path in sorted(folder.iterdir()):
        if path.suffix.lower() in IMAGE_EXTENSIONS and path.is_file():
            files.setdefault(path.stem, []).append(path)
    return {stem: paths[-1] for stem, paths in files.items()}, {s: p for s, p in files.items() if len(p) > 1}


class FolderSegmentation(SegmentationDataset):
    """Custom data: `num_classes` classes (1..255, with `class_names` of that length when given; the
    config checks both), names from `class_names` or class_0, class_1, ...; images in `image_format`."""

    def __init__(
        self,
        root: str | Path,
        split: str,
        *,
        num_classes: int,
        class_names: Sequence[str] = (),
        ignore_index: int = IGNORE_INDEX,
        transform: Transform | None = None,
        skip_bad_samples: bool = False,
        label_map: Sequence[tuple[int, LabelTarget]] = (),
        reduce_zero_label: bool = False,
        class_colors: Sequence[tuple[Sequence[int], LabelTarget]] = (),
        image_format: ImageFormat = ImageFormat(),
    ) -> None:
        if not str(root):
            raise FileNotFoundError(f"data.root is empty for dataset 'folder'; {LAYOUT}")
        self.root = Path(root).expanduser()
        image_dir, mask_dir = self.root / "images", self.root / "masks"
        for folder in (self.root, image_dir, mask_dir):
            if not folder.is_dir():
                raise FileNotFoundError(f"folder dataset: '{folder}' not found; {LAYOUT}")
        list_file = self.root / f"{split}.txt"
        listed_in = None
        if list_file.is_file():
            available, clashes = _images_by_stem(image_dir)
            listed_in = f"'{list_file}'"
            names = [Path(line.split()[0]).stem for line in list_file.read_text().splitlines() if line.strip()]
            unknown = [n for n in names if n not in available]
            if unknown and not skip_bad_samples:
                raise FileNotFoundError(
                    f"folder dataset: '{list_file}' lists {len(unknown)} name(s) with no image in '{image_dir}' "
                    f"(first: {unknown[0]!r}); {LAYOUT}"
                )
            samples = [(available[n], mask_dir / f"{n}.png") for n in names if n in available]
        elif (image_dir / split).is_dir() and (mask_dir / split).is_dir():
            available, clashes = _images_by_stem(image_dir / split)
            samples = [(p, mask_dir / split / f"{s}.png") for s, p in available.items()]
        elif split == "all":
            available, clashes = _images_by_stem(image_dir)
            samples = [(p, mask_dir / f"{s}.png") for s, p in available.items()]
        else:
            raise FileNotFoundError(
                f"folder dataset: split '{split}' not found: no '{list_file}' and no "
                f"'{image_dir / split}' + '{mask_dir / split}' folders; {LAYOUT}"
            )
        if not samples:
            raise FileNotFoundError(f"folder dataset: split '{split}' under '{self.root}' has no images; {LAYOUT}")
        self.split = split
        description = f"folder {split} ({self.root})"
        used = {image.stem for image, _ in samples}  # a clash among images the split does not use is harmless
        clash = same_stem_warning({s: p for s, p in clashes.items() if s in used}, description=description)
        super().__init__(
            samples,
            classes=tuple(class_names) or tuple(f"class_{i}" for i in range(num_classes)),
            palette=bit_palette(num_classes),
            ignore_index=ignore_index,
            transform=transform,
            skip_bad_samples=skip_bad_samples,
            label_map=label_map,
            reduce_zero_label=reduce_zero_label,
            class_colors=class_colors,
            description=description,
            image_format=image_format,
            listed_in=listed_in,
            listing_warnings=[clash] if clash else [],
        )


def build_folder(data_cfg: Any, split: str, transform: Transform) -> FolderSegmentation:
    """data.dataset=folder: `split` of a validated `data` config section, read through `transform`."""
    return FolderSegmentation(data_cfg.root, split, num_classes=data_cfg.num_classes,
                              class_names=tuple(data_cfg.class_names), ignore_index=data_cfg.ignore_index,
                              transform=transform, skip_bad_samples=data_cfg.skip_bad_samples,
                              reduce_zero_label=data_cfg.reduce_zero_label, image_format=ImageFormat.of(data_cfg),
                              **mask_encoding(data_cfg))
