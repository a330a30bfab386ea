"""The data checks that the start of training and `python -m syncseg verify` share, one function per check,
so that both give the same warning in the same words: how the split lists its files (names listed twice,
two images of one name) and how the config reads the images as their files store them (16-bit files
cut to 8 bits, fewer channels than data.in_channels, values above data.max_value). The masks' own
checks (binary 0/255, grey levels, multi-page files) are syncseg.data.masks.inspect_masks.

Every warning starts with the dataset's description, names a few of the files and how many there are,
and says what to change (the config key, or the file). Nothing here logs: the callers do, once.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from syncseg.data.constants import COLOUR_READER_CHANNELS, NAMED_FILES
from syncseg.data.images import ImageFormat, read_stored_image
from syncseg.data.masks import BadSampleError

FULL_SCALES = (1023, 4095, 16383, 65535)  # 10-, 12-, 14- and 16-bit data stored in 16-bit files


def named(items: Sequence[object], *, limit: int = NAMED_FILES) -> str:
    """"'a', 'b', 'c' and 4 more": the first `limit` items quoted, the rest counted."""
    shown = ", ".join(f"'{item}'" for item in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


# ------------------------------------------------------------------------------ listings
def repeated_names_warning(names: Sequence[str], *, description: str, listed_in: str) -> str | None:
    """The names `listed_in` (a split's list file) holds more than once, or None: each repeat is trained on
    as often as it is listed, which is silent oversampling unless meant."""
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    repeated = [f"'{name}' ({count} times)" for name, count in counts.items() if count > 1]
    if not repeated:
        return None
    shown = ", ".join(repeated[:NAMED_FILES])
    more = f" and {len(repeated) - NAMED_FILES} more" if len(repeated) > NAMED_FILES else ""
    return (f"{description}: {listed_in} lists {len(repeated)} name(s) more than once ({shown}{more}); each is used "
            f"as often as it is listed: unless that oversampling is meant, remove the repeated lines from {listed_in}")


def same_stem_warning(clashes: dict[str, Sequence[os.PathLike | str]], *, description: str) -> str | None:
    """Image files that share a name (stem) in one folder, e.g. s000.jpg beside s000.png, or None.
    `clashes` maps each such name to its files, the one that is read last (as sorted)."""
    if not clashes:
        return None
    shown = "; ".join(f"'{stem}': {', '.join(os.path.basename(p) for p in paths)} (reads "
                      f"{os.path.basename(paths[-1])})" for stem, paths in list(clashes.items())[:NAMED_FILES])
    more = f"; and {len(clashes) - NAMED_FILES} more" if len(clashes) > NAMED_FILES else ""
    folder = os.path.dirname(os.fspath(next(iter(clashes.values()))[0]))
    return (f"{description}: {len(clashes)} name(s) have more than one image file in '{folder}' ({shown}{more}); one "
            "name, one image: rename or remove the others")


# -------------------------------------------------------------------------------- images
@dataclass
class StoredFormat:
    """Images of one stored format among those looked at: `channels`, `bits` per sample (8 or 16), the
    `largest` value seen and their `paths`."""

    channels: int
    bits: int
    largest: float = 0.0
    paths: list[str] = field(default_factory=list)


def full_scale(bits: int, largest: float) -> int:
    """The data.max_value of images of `bits` whose largest value is `largest`: 255 for 8-bit files, else the
    smallest of FULL_SCALES that holds `largest`."""
    if bits == 8:
        return 255
    return next((scale for scale in FULL_SCALES if largest <= scale), FULL_SCALES[-1])


def stored_formats(paths: Iterable[os.PathLike | str]) -> list[StoredFormat]:
    """The images of `paths` read as their files store them (syncseg.data.images.read_stored_image), grouped
    by (channels, bits) in the order first seen. Files that cannot be read so are left out: the loader
    names them when it reads them its own way."""
    formats: dict[tuple[int, int], StoredFormat] = {}
    for path in paths:
        try:
            image = read_stored_image(path)
        except BadSampleError:
            continue
        key = (image.shape[2], 8 * image.dtype.itemsize)
        group = formats.setdefault(key, StoredFormat(*key))
        group.largest = max(group.largest, float(image.max()) if image.size else 0.0)
        group.paths.append(os.fspath(path))
    return list(formats.values())


def image_format_warnings(formats: Sequence[StoredFormat], image_format: ImageFormat, *,
                          description: str) -> list[str]:
    """What reading the images of `formats` (all those looked at) with `image_format` (data.in_channels,
    data.max_value) loses or distorts, one warning per format, with the config that reads them as stored.

    8-bit RGB (the default reader, cv2's colour conversion): 16-bit files are cut to their top 8 bits,
    2-channel files lose their second channel and files of more than 4 bands cannot be read at all, in any
    number; grey (tripled) and 4-channel files (cut to RGB) only when they are the most common format,
    since a few grey or RGBA files among photos are read as photos should be. Other formats: values above
    data.max_value. A file of another channel count or bit depth than a non-RGB format is a bad sample of its
    own (read_image), not a warning."""
    num_checked = sum(len(group.paths) for group in formats)
    most_common = max(formats, key=lambda group: len(group.paths)) if formats else None
    warnings = []
    for group in formats:
        scale = full_scale(group.bits, group.largest)
        which = (f"{description}: {len(group.paths)} of the {num_checked} images checked ({named(group.paths)}) "
                 f"{'are' if len(group.paths) > 1 else 'is'}")
        as_stored = (f"to read them as stored, set data.in_channels={group.channels} and data.max_value={scale} "
                     "(`python -m syncseg verify` prints these with their data.mean and data.std)")
        reads = f"data.in_channels={image_format.channels} with data.max_value={image_format.max_value}"
        if image_format.is_rgb8 and group.bits == 16:
            warnings.append(f"{which} 16-bit (values up to {group.largest:g}) but {reads} reads images as 8-bit RGB: "
                            f"they are cut to their top 8 bits; {as_stored}")
        elif image_format.is_rgb8 and group.channels == 2:
            warnings.append(f"{which} 2-channel, fewer than data.in_channels={image_format.channels}: read as RGB, "
                            f"the first channel is tripled and the second dropped; {as_stored}")
        elif image_format.is_rgb8 and group.channels > COLOUR_READER_CHANNELS:
            warnings.append(f"{which} {group.channels}-channel; {reads} reads images as 8-bit RGB, from files of 1 to "
                            f"{COLOUR_READER_CHANNELS} channels: each of them is a bad sample; {as_stored}")
        elif image_format.is_rgb8 and group is most_common and group.channels != image_format.channels:
            kept = "grey tripled" if group.channels == 1 else "the 4th channel dropped"
            warnings.append(f"{which} {group.channels}-channel; {reads} reads them as RGB ({kept}): {as_stored}")
        elif not image_format.is_rgb8 and (group.channels, group.bits) == (image_format.channels,
                                                                           8 * np.dtype(image_format.dtype).itemsize):
            if group.largest > image_format.max_value:
                warnings.append(f"{which} holding values up to {group.largest:g}, above data.max_value="
                                f"{image_format.max_value}, the full scale they are divided by; set data.max_value="
                                f"{scale}")
    return warnings
