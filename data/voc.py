"""Pascal VOC 2012 segmentation (21 classes), with the SBD-augmented `train_aug` split.

Layout under `root` (a `VOC2012` folder; a `VOCdevkit` folder holding one works too):
    JPEGImages/<id>.jpg
    SegmentationClass/<id>.png          palette PNGs, read as class indices (255 = boundary/ignore)
    ImageSets/Segmentation/{train,val,trainval}.txt
    SegmentationClassAug/<id>.png       split `train_aug` only (built by `python -m syncseg prepare-voc`)
    ImageSets/Segmentation/train_aug.txt
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from syncseg.data.base import LabelTarget, SegmentationDataset, Transform, mask_encoding
from syncseg.data.label_tables import VOC_CLASSES
from syncseg.data.palettes import bit_palette
from syncseg.data.transforms import IGNORE_INDEX

VOC_PALETTE = bit_palette(len(VOC_CLASSES))
AUG_SPLIT = "train_aug"
VOC_VOID = 255  # the annotations' value for object boundaries and unlabeled pixels (read as the ignore label)

LAYOUT = (
    "expected a VOC2012 folder with JPEGImages/<id>.jpg, SegmentationClass/<id>.png and "
    "ImageSets/Segmentation/<split>.txt (split train | val | trainval); split train_aug also needs "
    "SegmentationClassAug/<id>.png and ImageSets/Segmentation/train_aug.txt, built by "
    "`python -m syncseg prepare-voc --voc-root VOC2012 --sbd-root benchmark_RELEASE`"
)


def resolve_voc_root(root: str | Path) -> Path:
    """`root` itself, or `root/VOC2012` when `root` is a VOCdevkit folder; FileNotFoundError otherwise."""
    path = Path(root).expanduser()
    if not str(root):
        raise FileNotFoundError(f"data.root is empty for dataset 'voc'; {LAYOUT}")
    if not (path / "JPEGImages").is_dir() and (path / "VOC2012" / "JPEGImages").is_dir():
        path = path / "VOC2012"
    if not path.is_dir():
        raise FileNotFoundError(f"VOC root '{path}' does not exist; {LAYOUT}")
    if not (path / "JPEGImages").is_dir():
        raise FileNotFoundError(f"VOC root '{path}' has no JPEGImages/ folder; {LAYOUT}")
    return path


def read_split_ids(list_file: Path) -> list[str]:
    """Image ids, one per line (VOC lists hold bare ids; SBD-style 'image mask' pairs keep the image stem)."""
    ids = []
    for line in list_file.read_text().splitlines():
        line = line.strip()
        if line:
            ids.append(Path(line.split()[0]).stem)
    return ids


class VOCSegmentation(SegmentationDataset):
    """Pascal VOC 2012: `split` is train | val | trainval | train_aug (or any list in ImageSets/Segmentation)."""

    def __init__(
        self,
        root: str | Path,
        split: str,
        *,
        ignore_index: int = IGNORE_INDEX,
        transform: Transform | None = None,
        skip_bad_samples: bool = False,
        label_map: Sequence[tuple[int, LabelTarget]] = (),
        class_colors: Sequence[tuple[Sequence[int], LabelTarget]] = (),
    ) -> None:
        self.root = resolve_voc_root(root)
        list_file = self.root / "ImageSets" / "Segmentation" / f"{split}.txt"
        if not list_file.is_file():
            raise FileNotFoundError(f"VOC split file '{list_file}' not found; {LAYOUT}")
        mask_dir = self.root / ("SegmentationClassAug" if split == AUG_SPLIT else "SegmentationClass")
        if not mask_dir.is_dir():
            raise FileNotFoundError(f"VOC mask folder '{mask_dir}' not found; {LAYOUT}")
        ids = read_split_ids(list_file)
        if not ids:
            raise FileNotFoundError(f"VOC split file '{list_file}' lists no images; {LAYOUT}")
        self.split = split
        super().__init__(
            [(self.root / "JPEGImages" / f"{i}.jpg", mask_dir / f"{i}.png") for i in ids],
            classes=VOC_CLASSES,
            palette=VOC_PALETTE,
            ignore_index=ignore_index,
            raw_ignore=VOC_VOID,
            transform=transform,
            skip_bad_samples=skip_bad_samples,
            label_map=label_map,
            class_colors=class_colors,
            description=f"VOC {split} ({list_file})",
            listed_in=f"'{list_file}'",
        )


def build_voc(data_cfg: Any, split: str, transform: Transform) -> VOCSegmentation:
    """data.dataset=voc: `split` of a validated `data` config section, read through `transform`."""
    return VOCSegmentation(data_cfg.root, split, ignore_index=data_cfg.ignore_index, transform=transform,
                           skip_bad_samples=data_cfg.skip_bad_samples, **mask_encoding(data_cfg))
