"""Class colours: VOC's bit palette (the colours of every kind without its own), the 256-entry colour table
of a palette with the ignore label's colour. numpy only (syncseg.data.registry's kinds read it lazily)."""
from __future__ import annotations

import numpy as np

from syncseg.data.constants import IGNORE_INDEX


def bit_palette(num_colors: int) -> np.ndarray:
    """The Pascal VOC color map (bits of the index spread over R, G, B): num_colors x 3 uint8."""
    palette = np.zeros((num_colors, 3), dtype=np.uint8)
    for index in range(num_colors):
        value, red, green, blue = index, 0, 0, 0
        for bit in range(8):
            red |= ((value >> 0) & 1) << (7 - bit)
            green |= ((value >> 1) & 1) << (7 - bit)
            blue |= ((value >> 2) & 1) << (7 - bit)
            value >>= 3
        palette[index] = (red, green, blue)
    return palette


IGNORE_COLOR = (224, 224, 192)  # VOC's cream for its 255 "void" label: apart from every class and from black


def palette_table(palette: np.ndarray, *, ignore_index: int = IGNORE_INDEX) -> np.ndarray:
    """256 x 3 uint8 colours by label value: `palette` (num_classes x 3) for the classes, IGNORE_COLOR
    at `ignore_index` (when it is not a class index), black for every other value."""
    palette = np.asarray(palette, dtype=np.uint8).reshape(-1, 3)[:256]
    table = np.zeros((256, 3), dtype=np.uint8)
    table[: len(palette)] = palette
    if len(palette) <= ignore_index < 256:
        table[ignore_index] = IGNORE_COLOR
    return table
