"""Mask files -> class labels: the one raw-value -> class lookup, colour-coded masks, and the start-up
look at a sample of masks that names the encodings people save by mistake.

Three encodings, one result (HxW uint8: class index, or `ignore_index` for unlabeled pixels):

- index masks (palette 'P' or grayscale PNGs): raw value -> label through one 256-entry table, built
  from the dataset's own table (Cityscapes labelIds, ADE20K's reduced labels; the identity otherwise),
  the raw ignore value, `reduce_zero_label` (0 ignored, k -> k-1) and, last, the user's `label_map`
  entries (data.label_map), which win over everything else for the raw values they list;
- colour-coded masks (data.class_colors): every pixel's RGB colour -> label through one colour table;
  a colour that is not listed makes the sample bad.

Every problem is a BadSampleError naming the file, the values or colours found and what was expected.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Sequence

import cv2
import numpy as np
from PIL import Image

from syncseg.data.constants import IGNORE, NAMED_FILES, LabelTarget

INDEX_MODES = ("P", "L", "I", "I;16")  # single-channel PIL modes read as raw values
MAX_LISTED = 10  # values or colours quoted in one message


class BadSampleError(ValueError):
    """An image/mask pair that cannot be used; the message names the file and the problem."""


def colour_name(code: int) -> str:
    """24-bit 0xRRGGBB -> '#rrggbb (R,G,B)'."""
    red, green, blue = (code >> 16) & 255, (code >> 8) & 255, code & 255
    return f"#{code:06x} ({red},{green},{blue})"


def _colour_codes(rgb: np.ndarray) -> np.ndarray:
    """HxWx3 uint8 -> HxW uint32 0xRRGGBB."""
    rgb = rgb.astype(np.uint32)
    return (rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2]


def _listed_colours(codes: np.ndarray) -> str:
    """The colours of `codes`, most frequent first, at most MAX_LISTED of them."""
    colours, counts = np.unique(codes, return_counts=True)
    order = np.argsort(-counts, kind="stable")[:MAX_LISTED]
    more = f" and {len(colours) - len(order)} more" if len(colours) > len(order) else ""
    return ", ".join(colour_name(int(colours[i])) for i in order) + more


def label_map_override(entries: dict[int, LabelTarget]) -> str:
    """{85: 1, 255: 'ignore'} -> '85:1,255:ignore' (the KEY=VALUE form of data.label_map)."""
    return ",".join(f"{raw}:{target}" for raw, target in entries.items())


def suggested_label_map(values: Sequence[int], *, num_classes: int, raw_ignore: int) -> dict[int, int] | None:
    """The data.label_map entries that turn the raw `values` found in masks into classes 0, 1, ... in
    their order (grey-level-coded masks such as 0, 85, 170, 255; binary masks saved as 0 and 255), or
    None unless there is one value per class (the raw ignore value aside, if that leaves one per class)
    and some value is not a class already. Entries that map a value to itself are left out."""
    values = sorted(set(int(v) for v in values))
    candidates = values if len(values) == num_classes else [v for v in values if v != raw_ignore]
    if len(candidates) != num_classes or all(v < num_classes for v in candidates):
        return None
    return {value: index for index, value in enumerate(candidates) if value != index}


def read_index_mask(path: str | os.PathLike) -> np.ndarray:
    """HxW uint8 raw values from a single-channel mask (palette 'P' or grayscale 'L' / 'I;16'); an RGB
    mask is a BadSampleError that lists its colours and points to data.class_colors."""
    try:
        with Image.open(path) as image:
            if image.mode not in INDEX_MODES:
                kind = f"a {image.mode}-mode image"
                if image.mode in ("RGB", "RGBA", "LA", "PA"):
                    codes = _colour_codes(np.asarray(image.convert("RGB")))
                    kind = f"a colour image ({image.mode}) holding {_listed_colours(codes)}"
                raise BadSampleError(
                    f"mask '{path}' is {kind}; colour-coded masks need data.class_colors, a "
                    "colour -> class table (e.g. data.class_colors=#000000:0,#ff0000:1,#ffffff:ignore); otherwise "
                    "save a single-channel index PNG (palette or grayscale, pixel value = class index, 255 = ignore)")
            mask = np.asarray(image)
    except BadSampleError:
        raise
    except (OSError, SyntaxError, ValueError) as error:
        raise BadSampleError(f"cannot read mask '{path}': {error}") from None
    if mask.dtype != np.uint8:
        if mask.size and (mask.min() < 0 or mask.max() > 255):
            raise BadSampleError(f"mask '{path}' has values in [{mask.min()}, {mask.max()}]; expected 8-bit "
                                 "class indices (0-255)")
        mask = mask.astype(np.uint8)
    return mask


def read_colour_mask(path: str | os.PathLike) -> np.ndarray:
    """HxW uint32 0xRRGGBB: each pixel's colour as it is shown (a palette PNG through its palette,
    grayscale as grey, alpha dropped)."""
    try:
        with Image.open(path) as image:
            return _colour_codes(np.asarray(image.convert("RGB")))
    except (OSError, SyntaxError, ValueError) as error:
        raise BadSampleError(f"cannot read mask '{path}': {error}") from None


class MaskDecoder:
    """Reads mask files and turns them into labels (see the module docstring).

    `raw_table` (256 entries) is a dataset's own raw -> label table, whose `raw_table_ignore` entries
    mean "ignored" and whose valid raw values are 0..num_raw_labels-1; without it the raw values
    0..num_classes-1 are the classes. `raw_ignore` is the value the files use for unlabeled pixels.
    `label_map` ((raw, class or IGNORE), ...), `reduce_zero_label` and `class_colors`
    (((R, G, B), class or IGNORE), ...) are data.label_map, data.reduce_zero_label and
    data.class_colors, validated by syncseg.engine.config.
    """

    def __init__(self, *, num_classes: int, ignore_index: int, raw_ignore: int,
                 raw_table: np.ndarray | None = None, raw_table_ignore: int | None = None,
                 num_raw_labels: int | None = None, label_map: Sequence[tuple[int, LabelTarget]] = (),
                 reduce_zero_label: bool = False,
                 class_colors: Sequence[tuple[Sequence[int], LabelTarget]] = ()) -> None:
        self.num_classes, self.ignore_index, self.raw_ignore = num_classes, ignore_index, raw_ignore
        self.label_map = tuple((int(raw), target) for raw, target in label_map)
        self.reduce_zero_label = reduce_zero_label
        self.has_raw_table = raw_table is not None
        self.colour_coded = bool(class_colors)
        if raw_table is None:
            lookup = np.arange(256, dtype=np.uint8)
            num_valid = num_classes
            if reduce_zero_label:  # ADE-style: 0 = "other", k = class k-1
                lookup[0] = ignore_index
                lookup[1:num_classes + 1] = np.arange(num_classes, dtype=np.uint8)
                num_valid = num_classes + 1
        else:
            assert num_raw_labels is not None, "a raw_table needs num_raw_labels"
            lookup = np.asarray(raw_table, dtype=np.uint8).reshape(256).copy()
            if raw_table_ignore is not None:
                lookup[lookup == raw_table_ignore] = ignore_index
            num_valid = num_raw_labels
        self.num_valid_raw = num_valid
        valid = np.zeros(256, dtype=bool)
        valid[:num_valid] = True
        lookup[raw_ignore], valid[raw_ignore] = ignore_index, True
        for raw, target in self.label_map:  # last: the user's entries win
            lookup[raw], valid[raw] = self._label(target), True
        self.valid = valid
        self._invalid_lut = (~valid).astype(np.uint8)
        identity = np.array_equal(lookup, np.arange(256, dtype=np.uint8))
        self._lookup = None if identity else lookup
        self._colour_keys, self._colour_labels = self._colour_table(class_colors)

    def _label(self, target: LabelTarget) -> int:
        return self.ignore_index if target == IGNORE else int(target)

    def _colour_table(self, class_colors: Sequence[tuple[Sequence[int], LabelTarget]]) -> tuple[np.ndarray, np.ndarray]:
        codes = np.array([(int(r) << 16) | (int(g) << 8) | int(b) for (r, g, b), _ in class_colors], dtype=np.uint32)
        labels = np.array([self._label(target) for _, target in class_colors], dtype=np.uint8)
        order = np.argsort(codes, kind="stable")
        return codes[order], labels[order]

    # ------------------------------------------------------------------------------------ reading
    def read_raw(self, path: str | os.PathLike) -> np.ndarray:
        """HxW uint8 raw values of an index mask, or HxW uint32 0xRRGGBB colours with class_colors."""
        return read_colour_mask(path) if self.colour_coded else read_index_mask(path)

    def to_labels(self, raw: np.ndarray, path: str | os.PathLike) -> np.ndarray:
        """read_raw's array -> HxW uint8 labels; BadSampleError naming `path` and the values or colours
        that have no class."""
        if self.colour_coded:
            return self._colours_to_labels(raw, path)
        if raw.size and cv2.LUT(raw, self._invalid_lut).max():
            raise BadSampleError(self._invalid_values(raw, path))
        return raw if self._lookup is None else cv2.LUT(raw, self._lookup)

    def _invalid_values(self, raw: np.ndarray, path: str | os.PathLike) -> str:
        bad = np.unique(raw[self._invalid_lut[raw].astype(bool)])
        mapped = " and not in data.label_map" if self.label_map else ""
        message = (f"mask '{path}' has values {bad[:MAX_LISTED].tolist()} outside [0, {self.num_valid_raw - 1}] "
                   f"and != {self.raw_ignore} (the ignore label, data.ignore_index){mapped}")
        if not self.has_raw_table:
            message += ("; if the masks store classes as other values (grey levels such as 0, 85, 170, 255), map "
                        "each value to its class with data.label_map (e.g. data.label_map=85:1,170:2,255:3; "
                        "`python -m syncseg verify` suggests one)")
        return message

    def _colours_to_labels(self, codes: np.ndarray, path: str | os.PathLike) -> np.ndarray:
        keys = self._colour_keys
        position = np.searchsorted(keys, codes).clip(max=len(keys) - 1)
        known = keys[position] == codes
        if not known.all():
            listed = ", ".join(colour_name(int(key)) for key in keys[:MAX_LISTED])
            raise BadSampleError(f"mask '{path}' has colours not in data.class_colors: {_listed_colours(codes[~known])} "
                                 f"({int((~known).sum())} pixels); expected one of {listed}"
                                 f"{' ...' if len(keys) > MAX_LISTED else ''} (a lossless PNG: JPEG changes colours)")
        return self._colour_labels[position]

    def decode(self, path: str | os.PathLike) -> np.ndarray:
        """The HxW uint8 labels of the mask file `path`."""
        return self.to_labels(self.read_raw(path), path)


@dataclass
class MaskSampleReport:
    """What a look at some masks found: `bad` holds the per-mask errors, `warnings` the findings about the
    whole sample (an encoding that trains wrong), `fix` the config that would read them (or "")."""

    num_checked: int = 0
    bad: list[str] = field(default_factory=list)
    bad_paths: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    fix: str = ""


def mask_pages(path: str | os.PathLike) -> int:
    """How many pages (TIFF) or frames (APNG, GIF) the mask file holds; masks are read from the first."""
    try:
        with Image.open(path) as image:
            return int(getattr(image, "n_frames", 1))
    except (OSError, SyntaxError, ValueError):
        return 1  # unreadable: reading it says so


def inspect_masks(paths: Sequence[str | os.PathLike], decoder: MaskDecoder, *, description: str) -> MaskSampleReport:
    """Decode every mask of `paths` and look at their raw values together: values outside the classes
    that look grey-level-coded (a data.label_map suggestion), binary 0/255 masks whose 255 is the ignore
    label (the foreground would be ignored, with any data.num_classes), and files of several pages or
    frames (only the first is read)."""
    report = MaskSampleReport(num_checked=len(paths))
    counts = np.zeros(256, dtype=np.int64)
    paged = []
    for path in paths:
        try:
            raw = decoder.read_raw(path)
        except BadSampleError as error:
            report.bad.append(str(error))
            report.bad_paths.append(os.fspath(path))
            continue
        pages = mask_pages(path)
        if pages > 1:
            paged.append(f"'{os.fspath(path)}' ({pages} pages)")
        if not decoder.colour_coded:
            counts += np.bincount(raw.ravel(), minlength=256)
        try:
            decoder.to_labels(raw, path)
        except BadSampleError as error:
            report.bad.append(str(error))
            report.bad_paths.append(os.fspath(path))
    if paged:
        more = f" and {len(paged) - NAMED_FILES} more" if len(paged) > NAMED_FILES else ""
        report.warnings.append(
            f"{description}: {len(paged)} of the {len(paths)} masks checked hold more than one page or frame "
            f"({', '.join(paged[:NAMED_FILES])}{more}); only the first is read as the mask: save each "
            "mask as a single-page, single-frame file")
    if decoder.colour_coded or decoder.has_raw_table or decoder.label_map or decoder.reduce_zero_label:
        return report  # values read through a table: no guess at what a raw value means
    present = np.flatnonzero(counts)
    suggestion = suggested_label_map(present, num_classes=decoder.num_classes, raw_ignore=decoder.raw_ignore)
    if suggestion and report.bad:
        report.fix = label_map_override(suggestion)
        report.warnings.append(
            f"{description}: the {len(paths)} masks checked hold the values {present[:MAX_LISTED].tolist()} "
            f"({len(report.bad)} bad, first '{report.bad_paths[0]}'), which skip classes (data.num_classes="
            f"{decoder.num_classes}): grey-level-coded? map them with data.label_map: {suggestion} in the config "
            f"(command line: data.label_map={report.fix})")
    elif set(present.tolist()) == {0, decoder.raw_ignore} and decoder.raw_ignore >= decoder.num_classes:
        # with any class count: 0/255 masks with 3 classes trained the background alone and scored mIoU 1.0
        ignore, classes = decoder.raw_ignore, decoder.num_classes
        report.fix = label_map_override({ignore: 1}) + ("" if classes > 1 else " data.num_classes=2")
        setting = f"data.label_map: {{{ignore}: 1}}" + ("" if classes > 1 else " and data.num_classes: 2")
        report.warnings.append(
            f"{description}: the {len(paths)} masks checked hold only the values 0 and {ignore}, and with "
            f"data.num_classes={classes} the value {ignore} is data.ignore_index: those pixels are ignored, so the "
            f"model never learns the foreground; if {ignore} marks the foreground, set {setting} in the config "
            f"(command line: data.label_map={report.fix})")
    return report
