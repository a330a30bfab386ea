"""The data set kinds: one registry for `data.dataset`, with each kind's classes, palette and rules.

A kind is a `DatasetKind`: its name, its class list (or "from data.num_classes"), its colours, what the
config may set for it, and its builder `(data_cfg, split, transform) -> Dataset`, held as a
"package.module:function" string so this module imports neither torch nor cv2 (the config schema and
--help read it). Adding a kind is its own file (the Dataset and the builder) plus one
`register_dataset_kind(DatasetKind(...))` line, here for a built-in kind or in the user's code
(docs/extending.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from syncseg.data.label_tables import (ADE20K_CLASSES, ADE20K_COLOURS, CITYSCAPES_CLASSES, CITYSCAPES_COLOURS,
                                       SYNTHETIC_CLASSES, SYNTHETIC_DEFAULT_NUM_CLASSES, VOC_CLASSES)
from syncseg.lazy_registry import Registry, load_object

RGB = tuple[int, int, int]
MAX_LABEL = 255  # masks are 8-bit: class indices and the ignore label fit in 0..255


@dataclass(frozen=True)
class DatasetKind:
    """One `data.dataset` value and the facts the config, the builders and the palettes take from it.

    `build(data_cfg, split, transform) -> Dataset` (or its "package.module:function" name) makes the
    data set: items are (image uint8 C x H x W, mask int64 H x W) after `transform`, and the object carries
    `classes`, `palette`, `num_classes`, `ignore_index` and `name_of(index)` (syncseg/data/__init__.py).
    """

    name: str
    build: str | Callable[..., Any]
    classes: tuple[str, ...] = ()  # a fixed class list; () = data.num_classes classes (named by data.class_names)
    palette: tuple[RGB, ...] = ()  # the classes' colours; () = VOC's bit palette for any class count
    min_classes: int = 1  # data.num_classes' range when the classes are not fixed
    max_classes: int = MAX_LABEL
    default_num_classes: int = 0  # what data.num_classes=0 means; 0 = data.num_classes is required
    reads_mask_files: bool = True  # data.label_map and data.class_colors apply
    reduces_zero_label: bool = False  # data.reduce_zero_label applies
    any_image_format: bool = False  # images beyond 8-bit RGB (data.in_channels, data.max_value)
    # the classes come from the data's own files (annotation exports): data.num_classes is not set, and
    # data.class_names, when given, is the class list; label_ids: data.label_map maps the files' numeric label
    # ids (COCO category ids, YOLO class ids) to classes
    classes_from_files: bool = False
    label_ids: bool = False
    # class index -> the raw label the benchmark server expects (256 entries, "package.module:attribute"),
    # for eval.py --save-predictions; None = the class index itself
    benchmark_labels: str | None = None

    @property
    def fixed_num_classes(self) -> int:
        """The class count of a kind whose classes come with it; 0 when data.num_classes decides."""
        return len(self.classes)

    def palette_for(self, num_classes: int) -> Any:
        """num_classes x 3 uint8 colours: the kind's palette when it has that many, else VOC's bit palette
        (numpy, imported here: the registry itself stays light)."""
        import numpy as np

        from syncseg.data.palettes import bit_palette

        if len(self.palette) == num_classes:
            return np.asarray(self.palette, dtype=np.uint8)
        return bit_palette(num_classes)

    def builder(self) -> Callable[..., Any]:
        """The builder function (its module is imported now)."""
        return load_object(self.build)


DATASET_KINDS: Registry[DatasetKind] = Registry("data.dataset")


def register_dataset_kind(kind: DatasetKind, *, replace: bool = False) -> DatasetKind:
    """Make `kind.name` a valid data.dataset value (checked when a config is validated)."""
    return DATASET_KINDS.register(kind.name, kind, replace=replace)


def dataset_kind(name: str) -> DatasetKind:
    """The kind registered as `name`; ValueError listing the registered kinds and the closest one."""
    return DATASET_KINDS.get(name)


def build_dataset(data_cfg: Any, split: str, *, train: bool, compact_masks: bool = False) -> Any:
    """The dataset named by a validated `data` config section for `split`, with the train (train=True)
    or eval pipeline. Raises FileNotFoundError naming the missing path and the expected layout.
    `compact_masks` (the trainer's and eval.py's loaders): uint8 masks stay uint8 tensors
    (syncseg.data.transforms.to_tensors); the default gives int64 masks, what cross_entropy takes."""
    from syncseg.data.transforms import build_eval_transform, build_train_transform

    transform = (build_train_transform(data_cfg, compact_masks=compact_masks) if train
                 else build_eval_transform(data_cfg, compact_masks=compact_masks))
    return dataset_kind(data_cfg.dataset).builder()(data_cfg, split, transform)


# the built-in kinds, in the order --help and errors list them
register_dataset_kind(DatasetKind("voc", "syncseg.data.voc:build_voc", classes=VOC_CLASSES))
register_dataset_kind(DatasetKind(
    "cityscapes", "syncseg.data.cityscapes:build_cityscapes", classes=CITYSCAPES_CLASSES, palette=CITYSCAPES_COLOURS,
    benchmark_labels="syncseg.data.cityscapes:TRAINID_TO_LABELID"))
register_dataset_kind(DatasetKind(
    "ade20k", "syncseg.data.ade20k:build_ade20k", classes=ADE20K_CLASSES, palette=ADE20K_COLOURS,
    benchmark_labels="syncseg.data.ade20k:CLASS_TO_RAW"))
register_dataset_kind(DatasetKind(
    "synthetic", "syncseg.data.synthetic:build_synthetic", min_classes=2, max_classes=len(SYNTHETIC_CLASSES),
    default_num_classes=SYNTHETIC_DEFAULT_NUM_CLASSES, reads_mask_files=False))
register_dataset_kind(DatasetKind("folder", "syncseg.data.folder:build_folder", reduces_zero_label=True,
                                  any_image_format=True))
# labels as annotation tools export them (syncseg.data.annotations)
for _name, _label_ids in (("coco", True), ("labelme", False), ("cvat", False), ("yolo_seg", True),
                          ("label_studio", False)):
    register_dataset_kind(DatasetKind(_name, f"syncseg.data.annotations.dataset:build_{_name}", reads_mask_files=False,
                                      any_image_format=True, classes_from_files=True, label_ids=_label_ids))
register_dataset_kind(DatasetKind("cvat_mask", "syncseg.data.annotations.cvat_mask:build_cvat_mask",
                                  reads_mask_files=False, any_image_format=True, classes_from_files=True))
# georeferenced scenes (syncseg.data.raster: rasterio and fiona, the geo extra)
register_dataset_kind(DatasetKind("raster", "syncseg.data.raster.dataset:build_raster", any_image_format=True))
