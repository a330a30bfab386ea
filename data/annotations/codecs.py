"""The bitmap encodings tools store masks in, decoded when an image is loaded (not when its file is read, so
a large export holds its masks compressed): CVAT's mask RLE, Label Studio's brush RLE (thi.ng rle-pack), and
labelme's base64 PNG. COCO's RLE is pycocotools'. numpy, PIL and the standard library only."""
from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
from PIL import Image


def decode_cvat_rle(counts: str, *, width: int, height: int) -> np.ndarray:
    """CVAT's mask RLE (comma-separated runs over a width x height box, row-major, starting with a run of 0s)
    -> bool height x width; ValueError when the runs do not cover the box exactly."""
    runs = np.asarray([int(value) for value in counts.split(",") if value.strip()], dtype=np.int64)
    if (runs < 0).any() or runs.sum() != width * height:
        raise ValueError(f"its runs sum to {int(runs.sum())} pixels, not the box's {width} x {height} = "
                         f"{width * height}")
    values = np.zeros(len(runs), dtype=bool)
    values[1::2] = True
    return np.repeat(values, runs).reshape(height, width)


def encode_cvat_rle(mask: np.ndarray) -> tuple[str, int, int, int, int]:
    """bool H x W -> (rle, left, top, width, height): CVAT's mask RLE, run lengths ", "-separated over the
    inclusive box of the mask's pixels, row by row, alternating and starting with a (maybe empty) run of 0s.
    Raises ValueError for a mask that is not 2-D or has no pixel."""
    mask = np.asarray(mask, dtype=bool)
    if mask.ndim != 2 or not mask.any():
        raise ValueError(f"mask of shape {mask.shape} with {int(mask.sum())} pixels: expected H x W with a pixel set")
    rows, columns = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    top, left = int(rows[0]), int(columns[0])
    height, width = int(rows[-1]) - top + 1, int(columns[-1]) - left + 1
    flat = mask[top:top + height, left:left + width].ravel()
    runs = np.diff(np.concatenate([[0], np.flatnonzero(flat[1:] != flat[:-1]) + 1, [flat.size]])).tolist()
    return ", ".join(str(run) for run in ([0] + runs if flat[0] else runs)), left, top, width, height


def cvat_rle_length(counts: str) -> int:
    """The pixels CVAT's RLE `counts` covers (ValueError for values that are not integers)."""
    return sum(int(value) for value in counts.split(",") if value.strip())


def decode_png_bitmap(data: str) -> np.ndarray:
    """A base64 PNG (labelme's mask shapes) -> bool HxW, nonzero = inside."""
    with Image.open(io.BytesIO(base64.b64decode(data))) as image:
        array = np.asarray(image)
    return (array.any(axis=-1) if array.ndim == 3 else array) > 0


class _Bits:
    """Reads a byte string as big-endian bit fields (thi.ng rle-pack, which Label Studio's brush uses)."""

    def __init__(self, data: bytes) -> None:
        self.bits = np.unpackbits(np.frombuffer(bytes(data), dtype=np.uint8))
        self.position = 0

    def read(self, count: int) -> int:
        if self.position + count > len(self.bits):
            raise ValueError("the RLE ends early")
        value = 0
        for bit in self.bits[self.position:self.position + count]:
            value = (value << 1) | int(bit)
        self.position += count
        return value


def decode_brush_rle(rle: list[int]) -> np.ndarray:
    """Label Studio's brush RLE (a list of byte values) -> the flat uint8 values it packs (RGBA per pixel).
    ValueError for a truncated stream."""
    stream = _Bits(bytes(int(v) & 255 for v in rle))
    count = stream.read(32)
    word_size = stream.read(5) + 1
    run_sizes = [stream.read(4) + 1 for _ in range(4)]
    out = np.zeros(count, dtype=np.uint8)
    index = 0
    while index < count:
        repeated = stream.read(1)
        end = index + 1 + stream.read(run_sizes[stream.read(2)])
        if end > count:
            raise ValueError(f"a run ends at value {end}, past the {count} the header states")
        if repeated:
            out[index:end] = stream.read(word_size)
        else:
            for position in range(index, end):
                out[position] = stream.read(word_size)
        index = end
    return out


def encode_brush_rle(values: np.ndarray) -> list[int]:
    """The inverse of decode_brush_rle for uint8 values (8-bit words; runs of equal values packed), so that
    tests and writers can make Label Studio brushes."""
    values = np.asarray(values, dtype=np.uint8).reshape(-1)
    bits: list[str] = [format(len(values), "032b"), format(8 - 1, "05b")]
    run_bits = [3, 6, 10, 16]  # run-length field sizes, one chosen per run by a 2-bit selector
    bits += [format(size - 1, "04b") for size in run_bits]
    index = 0
    while index < len(values):
        end = index + 1
        while end < len(values) and values[end] == values[index] and end - index < (1 << run_bits[-1]):
            end += 1
        length = end - index
        if length > 1:
            selector = next(i for i, size in enumerate(run_bits) if length - 1 < (1 << size))
            bits += ["1", format(selector, "02b"), format(length - 1, f"0{run_bits[selector]}b"),
                     format(int(values[index]), "08b")]
            index = end
            continue
        # a literal run: values until the next repeat, at most 2**16 of them
        end = index + 1
        while end < len(values) and (end + 1 >= len(values) or values[end] != values[end + 1]) and end - index < (
                1 << run_bits[-1]):
            end += 1
        length = end - index
        selector = next(i for i, size in enumerate(run_bits) if length - 1 < (1 << size))
        bits += ["0", format(selector, "02b"), format(length - 1, f"0{run_bits[selector]}b")]
        bits += [format(int(v), "08b") for v in values[index:end]]
        index = end
    text = "".join(bits)
    text += "0" * (-len(text) % 8)
    return [int(text[i:i + 8], 2) for i in range(0, len(text), 8)]



def brush_rle_length(rle: list[int]) -> int:
    """The number of values a Label Studio brush RLE states in its header (-1 when it has no header)."""
    if len(rle) < 4:
        return -1
    return int.from_bytes(bytes(int(v) & 255 for v in rle[:4]), "big")


def decode_bitmap(encoding: str, encoded: Any) -> np.ndarray:
    """bool HxW from one of the encodings: ("cvat", (counts, width, height)), ("brush", (rle, width, height):
    the alpha of its RGBA values), ("png", base64 text)."""
    if encoding == "cvat":
        counts, width, height = encoded
        return decode_cvat_rle(counts, width=width, height=height)
    if encoding == "brush":
        rle, width, height = encoded
        return decode_brush_rle(list(rle)).reshape(height, width, 4)[..., 3] > 0
    if encoding == "png":
        return decode_png_bitmap(encoded)
    raise AssertionError(f"unknown bitmap encoding {encoding!r}")
