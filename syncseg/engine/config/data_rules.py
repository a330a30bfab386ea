"""The data section's rules that depend on its data set kind (syncseg.data.registry.DatasetKind): the class
count, the mask encodings a kind reads, the image formats it takes. Part of
syncseg.engine.config.schema.validate; the messages name the key, the value and the kinds that would take it.
"""
from __future__ import annotations

from typing import Any

from syncseg.data.constants import IGNORE, IMAGENET_MEAN, IMAGENET_STD, MAX_8BIT, RGB_CHANNELS
from syncseg.data.registry import DATASET_KINDS, DatasetKind, dataset_kind


def check_data_for_its_kind(data: Any, source: str) -> None:
    """ValueError when the `data` section (a DataConfig) asks of its data.dataset kind what the kind does not do."""
    kind = dataset_kind(data.dataset)
    _check_raster_keys(data, source)
    if kind.classes_from_files:
        _check_annotation_kind(data, kind, source)
        _check_image_format(data, source)
        return
    _check_class_count(data, kind, source)
    if data.class_names and len(data.class_names) != data.num_classes:
        raise ValueError(f"{source}: data.class_names has {len(data.class_names)} names but "
                         f"data.num_classes={data.num_classes}")
    _check_mask_encodings(data, source)
    _check_image_format(data, source)


def _check_raster_keys(data: Any, source: str) -> None:
    """data.scenes and its companions are the raster kind's, which needs scenes and their labels."""
    used = [key for key, value in (("data.scenes", data.scenes), ("data.labels", data.labels),
                                   ("data.val_region", data.val_region), ("data.raster_scale", data.raster_scale))
            if value]
    if data.dataset != "raster":
        if used:
            raise ValueError(f"{source}: {used[0]} is set but it is read by dataset 'raster' (georeferenced scenes), "
                             f"not '{data.dataset}'; set data.dataset=raster or remove {used[0]}")
        return
    for key, value in (("data.scenes", data.scenes), ("data.labels", data.labels)):
        if not value:
            raise ValueError(f"{source}: dataset 'raster' needs {key}: the image rasters (data.scenes) and one label "
                             "raster or vector file per scene or for all (data.labels), paths under data.root")
    patterns = any(char in entry for entry in (*data.scenes, *data.labels) for char in "*?[")
    if not patterns and len(data.labels) not in (1, len(data.scenes)):  # patterns: counted once expanded
        raise ValueError(f"{source}: data.labels has {len(data.labels)} entries for {len(data.scenes)} data.scenes; "
                         "expected one per scene, or one for all")
    if data.class_colors or data.reduce_zero_label:
        key = "data.class_colors" if data.class_colors else "data.reduce_zero_label"
        raise ValueError(f"{source}: {key} is set, but dataset 'raster' reads label rasters of class ids (data.label_map "
                         "maps other values) or vector files (data.label_attribute); remove it")


def _check_class_count(data: Any, kind: DatasetKind, source: str) -> None:
    if kind.classes and data.num_classes:
        raise ValueError(f"{source}: data.num_classes={data.num_classes} but dataset '{kind.name}' has a fixed "
                         "class list; leave data.num_classes at 0 (or use dataset 'folder' for a custom label set)")
    if kind.classes:
        return
    if not kind.default_num_classes and data.num_classes < 1:
        raise ValueError(f"{source}: dataset '{kind.name}' needs data.num_classes ({kind.min_classes} to "
                         f"{kind.max_classes}), the number of classes in its masks")
    if data.num_classes and not kind.min_classes <= data.num_classes <= kind.max_classes:
        default = f" (0 = its default, {kind.default_num_classes})" if kind.default_num_classes else ""
        raise ValueError(f"{source}: data.num_classes={data.num_classes}: the {kind.name} dataset has "
                         f"{kind.min_classes} to {kind.max_classes} classes{default}")


def _check_annotation_kind(data: Any, kind: DatasetKind, source: str) -> None:
    """A kind whose classes come from its annotation files: data.num_classes is not set, data.class_names (when
    given) is the class list, and data.label_map maps numeric label ids where the files have them."""
    if data.num_classes and data.num_classes != len(data.class_names):
        raise ValueError(f"{source}: data.num_classes={data.num_classes}, but dataset '{kind.name}' takes its classes "
                         "from its annotation files (or data.class_names); leave data.num_classes at 0")
    if len(set(data.class_names)) != len(data.class_names):
        raise ValueError(f"{source}: data.class_names lists a name twice: {list(data.class_names)}")
    if len(data.class_names) >= min(data.ignore_index, 256) and data.ignore_index < 256:
        raise ValueError(f"{source}: data.class_names has {len(data.class_names)} classes, which reaches "
                         f"data.ignore_index={data.ignore_index}")
    used = [key for key, value in (("data.class_colors", data.class_colors),
                                   ("data.reduce_zero_label", data.reduce_zero_label)) if value]
    if data.label_map and not kind.label_ids:
        used.insert(0, "data.label_map")
    if used:
        advice = ("data.class_names sets the class list and data.ignore_labels the labels that mark ignored pixels"
                  + ("; data.label_map maps the numeric ids of coco and yolo_seg" if used[0] == "data.label_map"
                     else ""))
        raise ValueError(f"{source}: {used[0]} is set but dataset '{kind.name}' has no mask files: its labels are "
                         f"the names in its annotation files; {advice}")
    raws = [raw for raw, _ in data.label_map]
    for raw, target in data.label_map:
        if raws.count(raw) > 1:
            raise ValueError(f"{source}: data.label_map lists the id {raw} twice")
        if target != IGNORE and data.class_names and not 0 <= target < len(data.class_names):
            raise ValueError(f"{source}: data.label_map maps {raw} to {target}; expected a class index 0.."
                             f"{len(data.class_names) - 1} of data.class_names or {IGNORE}")


def _kinds_where(flag: str) -> str:
    """The registered data set kinds whose DatasetKind.`flag` is true, for an error's advice."""
    return ", ".join(f"'{name}'" for name, kind in DATASET_KINDS.items() if getattr(kind, flag))


def _colour(rgb: tuple[int, int, int]) -> str:
    return ",".join(map(str, rgb))


def _check_mask_encodings(data: Any, source: str) -> None:
    kind = dataset_kind(data.dataset)
    if not kind.reads_mask_files:
        used = [key for key, value in (("data.label_map", data.label_map), ("data.class_colors", data.class_colors),
                                       ("data.reduce_zero_label", data.reduce_zero_label)) if value]
        if used:
            raise ValueError(f"{source}: {used[0]} is set but the {kind.name} dataset has no mask files to read; use "
                             f"a dataset that reads them: {_kinds_where('reads_mask_files')}")
        return
    if data.reduce_zero_label and not kind.reduces_zero_label:
        raise ValueError(f"{source}: data.reduce_zero_label is for dataset {_kinds_where('reduces_zero_label')} "
                         f"(dataset '{kind.name}' reads its masks its own way; ade20k already reduces them); use "
                         "data.label_map to change them")
    if data.reduce_zero_label and data.num_classes >= data.ignore_index:
        raise ValueError(f"{source}: data.reduce_zero_label reads raw values 1..{data.num_classes} as classes, which "
                         f"reaches data.ignore_index={data.ignore_index}; use a smaller data.num_classes or another "
                         "data.ignore_index")
    if data.class_colors and (data.label_map or data.reduce_zero_label):
        other = "data.label_map" if data.label_map else "data.reduce_zero_label"
        raise ValueError(f"{source}: data.class_colors and {other} are both set: colour-coded masks get their classes "
                         f"from data.class_colors alone; remove {other}")
    num_classes = kind.fixed_num_classes or data.num_classes
    expected = f"a class index 0..{num_classes - 1} (dataset '{data.dataset}' has {num_classes} classes) or {IGNORE}"
    raws = [raw for raw, _ in data.label_map]
    for raw, target in data.label_map:
        if not 0 <= raw <= 255:
            raise ValueError(f"{source}: data.label_map has the raw value {raw}; masks are 8-bit, values 0..255")
        if raws.count(raw) > 1:
            raise ValueError(f"{source}: data.label_map lists the raw value {raw} twice")
        if target != IGNORE and not 0 <= target < num_classes:
            raise ValueError(f"{source}: data.label_map maps {raw} to {target}; expected {expected}")
    colours = [rgb for rgb, _ in data.class_colors]
    for rgb, target in data.class_colors:
        if len(rgb) != 3 or not all(0 <= part <= 255 for part in rgb):
            raise ValueError(f"{source}: data.class_colors has the colour {_colour(rgb)}; expected R,G,B, each 0..255")
        if colours.count(rgb) > 1:
            raise ValueError(f"{source}: data.class_colors lists the colour {_colour(rgb)} twice")
        if target != IGNORE and not 0 <= target < num_classes:
            raise ValueError(f"{source}: data.class_colors maps {_colour(rgb)} to {target}; expected {expected}")


def _check_image_format(data: Any, source: str) -> None:
    rgb8 = data.in_channels == RGB_CHANNELS and data.max_value <= MAX_8BIT
    shown = f"data.in_channels={data.in_channels} and data.max_value={data.max_value}"
    if not rgb8 and not dataset_kind(data.dataset).any_image_format:
        raise ValueError(f"{source}: {shown}: images other than 8-bit RGB are read by dataset "
                         f"{_kinds_where('any_image_format')}; dataset "
                         f"'{data.dataset}' has 8-bit RGB images (data.in_channels=3, data.max_value=255)")
    if not rgb8 and data.photometric:
        raise ValueError(f"{source}: data.photometric (colour jitter and blur) works on 8-bit RGB images, not on "
                         f"these ({shown}); set data.photometric=false")
    for key, values in (("data.mean", data.mean), ("data.std", data.std)):
        if len(values) != data.in_channels:
            default = " (ImageNet's RGB values, the default)" if values in (IMAGENET_MEAN, IMAGENET_STD) else ""
            raise ValueError(f"{source}: {key} has {len(values)} value(s){default} but data.in_channels="
                             f"{data.in_channels}; give one value per channel, in units of data.max_value "
                             "(`python -m syncseg verify` prints them)")
