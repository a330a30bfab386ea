"""Image files -> arrays: 8-bit RGB as photo datasets are read, and images beyond it (1, 3 or N channels,
8 or 16 bits, PNG and TIFF) for data.in_channels / data.max_value.

The config's `ImageFormat` chooses one of two readers:

- 8-bit RGB (data.in_channels=3 and data.max_value <= 255, the default): cv2's IMREAD_COLOR_RGB, as
  syncseg always read images: a grey image is tripled, an alpha channel dropped, a 16-bit file cut to 8 bits.
  A TIFF of more than 4 bands, which cv2 cannot decode, is a BadSampleError naming its band count and the
  keys that read it (its header is read first: it never reaches cv2).
- any other format: the file as stored (`read_stored_image`: cv2's IMREAD_UNCHANGED, tifffile for
  TIFF, which holds any number of bands), and a file whose channel count or bit depth is not the
  format's is a BadSampleError naming the file, what it holds and what the config expects.

The bit depth follows data.max_value: up to 255 the images are 8-bit (uint8), above it 16-bit (uint16);
batches keep that type to the device, where syncseg.data.transforms.normalize_batch divides by data.max_value.
cv2 decodes colour as BGR(A); 3- and 4-channel files come back in their stored RGB(A) order, so an
RGB-NIR image saved as a 4-channel PNG is R, G, B, NIR.
"""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Iterator

import cv2
import numpy as np

from syncseg.data.constants import COLOUR_READER_CHANNELS, MAX_8BIT, RGB_CHANNELS
from syncseg.data.masks import BadSampleError

_IMAGE_READ_FLAGS = cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION  # masks ignore EXIF too
_JPEG_START, _JPEG_END = b"\xff\xd8", b"\xff\xd9"
_JPEG_TAIL = 4096  # where the end marker must be; tools append at most a little padding after it
_TIFF_STARTS = (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+")  # classic and BigTIFF, both byte orders
_SAMPLE_TYPES = (np.uint8, np.uint16)
# the Python image libraries log their own guesses about a file they cannot read ("More samples per pixel
# than can be decoded: 13"); the caller's one line naming the file says it instead
_CHATTY_LOGGERS = ("PIL", "tifffile")


def image_dtype(max_value: int) -> type:
    """The sample type images of full scale `max_value` (data.max_value) are read as: uint8 up to 255,
    else uint16."""
    return np.uint8 if max_value <= MAX_8BIT else np.uint16


def _bits(dtype: np.dtype | type) -> int:
    return 8 * np.dtype(dtype).itemsize


@dataclass(frozen=True)
class ImageFormat:
    """What the config says the images are: `channels` (data.in_channels) and `max_value`
    (data.max_value, whose size decides 8 or 16 bits)."""

    channels: int = RGB_CHANNELS
    max_value: int = MAX_8BIT

    @classmethod
    def of(cls, data_cfg: object) -> "ImageFormat":
        """The format of a validated data config section."""
        return cls(int(data_cfg.in_channels), int(data_cfg.max_value))  # type: ignore[attr-defined]

    @property
    def dtype(self) -> type:
        return image_dtype(self.max_value)

    @property
    def is_rgb8(self) -> bool:
        """The 8-bit RGB format every photo dataset uses (cv2's colour reader)."""
        return self.channels == RGB_CHANNELS and self.dtype is np.uint8


def _decode(data: np.ndarray, flags: int, path: str | os.PathLike) -> np.ndarray:
    """cv2.imdecode of a file's bytes, or BadSampleError naming the file and, when Pillow can tell, why.

    cv2's own log lines ('[ WARN:0@...] ... PNG input buffer is incomplete', '[ERROR:...]') are
    switched off for the call: the user gets one line naming the file, not the library's guesses first.
    The level is cv2's global one, restored afterwards (decodes run in one thread per process)."""
    level = cv2.utils.logging.getLogLevel()
    cv2.utils.logging.setLogLevel(cv2.utils.logging.LOG_LEVEL_SILENT)
    try:
        image = cv2.imdecode(data, flags) if data.size else None
    finally:
        cv2.utils.logging.setLogLevel(level)
    if image is None:
        raise BadSampleError(f"cannot read image '{path}' ({_why_unreadable(path) if data.size else 'empty file'})")
    return image


def _why_unreadable(path: str | os.PathLike) -> str:
    """Pillow's reason a file cv2 could not decode is unreadable (it raises where cv2 only logs)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with _quiet_image_loggers(), Image.open(path) as image:
            image.load()
    except UnidentifiedImageError:
        return "not an image, or damaged at its start"
    except (OSError, SyntaxError, ValueError) as error:
        return f"damaged or truncated: {error}"
    return "a format or variant cv2 does not decode"


def _file_bytes(path: str | os.PathLike) -> np.ndarray:
    try:
        data = np.fromfile(os.fspath(path), dtype=np.uint8)
    except OSError as error:
        raise BadSampleError(f"cannot read image '{path}': {error.strerror or error}") from None
    if data[:2].tobytes() == _JPEG_START and _JPEG_END not in data[-_JPEG_TAIL:].tobytes():
        raise BadSampleError(f"image '{path}' is a truncated JPEG (no end marker: a partial download or copy?); "
                             "replace the file")
    return data


@contextlib.contextmanager
def _quiet_image_loggers() -> Iterator[None]:
    """Pillow's and tifffile's log records dropped for the block (restored after it): an unreadable file is one
    BadSampleError naming it, not the library's lines first. Decodes run in one thread per process."""
    loggers = [logging.getLogger(name) for name in _CHATTY_LOGGERS]
    disabled = [item.disabled for item in loggers]
    for item in loggers:
        item.disabled = True
    try:
        yield
    finally:
        for item, was in zip(loggers, disabled):
            item.disabled = was


@dataclass(frozen=True)
class TiffLayout:
    """The first image of a TIFF as its header describes it: `height`, `width`, `bands` (samples, planes or
    pages) and `bits` per sample; `bands_first` when the bands are planes or pages (a band axis before YX)."""

    height: int
    width: int
    bands: int
    bits: int
    bands_first: bool


def _layout_of(shape: tuple[int, ...], axes: str, dtype: np.dtype, path: str | os.PathLike) -> TiffLayout:
    bits = _bits(dtype)
    if len(shape) == 2:
        return TiffLayout(shape[0], shape[1], 1, bits, False)
    if len(shape) == 3 and axes.endswith("YXS"):
        return TiffLayout(shape[0], shape[1], shape[2], bits, False)
    if len(shape) == 3 and axes.endswith("YX"):
        return TiffLayout(shape[1], shape[2], shape[0], bits, True)
    raise BadSampleError(f"TIFF image '{path}' holds an array of shape {shape} (axes {axes}); expected one "
                         "image: height x width, with its bands as samples (YXS), planes or pages (a band axis "
                         "before YX)")


def tiff_layout(path: str | os.PathLike) -> TiffLayout:
    """The TIFF `path`'s first image from its header, no pixel decoded; BadSampleError naming the file when
    the header cannot be read or holds more than one image."""
    import tifffile

    try:
        with _quiet_image_loggers(), tifffile.TiffFile(os.fspath(path)) as tiff:
            series = tiff.series[0]
            shape, axes, dtype = tuple(series.shape), series.axes, series.dtype
    except Exception as error:  # tifffile raises its own types for corrupt or unsupported files
        raise BadSampleError(f"cannot read TIFF image '{path}': {error}") from None
    return _layout_of(shape, axes, dtype, path)


def _tiff_bands_last(path: str | os.PathLike) -> np.ndarray:
    """The first image of a TIFF as H x W x bands, whether its bands are samples (YXS), planes (SYX) or
    pages (a band axis before YX)."""
    import tifffile

    try:
        with _quiet_image_loggers(), tifffile.TiffFile(os.fspath(path)) as tiff:
            series = tiff.series[0]
            array, axes = series.asarray(), series.axes
    except Exception as error:  # tifffile raises its own types for corrupt or unsupported files
        raise BadSampleError(f"cannot read TIFF image '{path}': {error}") from None
    layout = _layout_of(array.shape, axes, array.dtype, path)
    if array.ndim == 2:
        return array[..., None]
    return np.moveaxis(array, 0, -1) if layout.bands_first else array


def _check_colour_readable(path: str | os.PathLike, image_format: ImageFormat) -> None:
    """BadSampleError for a TIFF of more bands than cv2's colour reader decodes, naming the keys that read it as
    stored. A header tifffile cannot parse is left to cv2, whose failure is named as any other."""
    try:
        layout = tiff_layout(path)
    except BadSampleError:
        return
    if layout.bands <= COLOUR_READER_CHANNELS:
        return
    scale = "255" if layout.bits == 8 else "its full scale (4095 for 12-bit values, 65535 for 16-bit)"
    raise BadSampleError(
        f"image '{path}' is a TIFF of {layout.bands} bands ({layout.bits}-bit), but data.in_channels="
        f"{image_format.channels} with data.max_value={image_format.max_value} reads images as 8-bit RGB, from "
        f"files of 1 to {COLOUR_READER_CHANNELS} channels; to read it as stored, set data.in_channels="
        f"{layout.bands} and data.max_value to {scale} (`python -m syncseg verify` prints these with their "
        "data.mean and data.std)")


def starts_as_tiff(path: str | os.PathLike) -> bool:
    """Whether the file begins with a TIFF signature (False when it cannot be read: _file_bytes says why)."""
    try:
        with open(path, "rb") as file:
            return file.read(4) in _TIFF_STARTS
    except OSError:
        return False


def read_stored_image(path: str | os.PathLike) -> np.ndarray:
    """H x W x C as the file stores it: C channels in RGB(A) order for colour files, uint8 or uint16.
    BadSampleError naming the file when it is missing, not an image, or holds samples that are not 8- or
    16-bit unsigned integers."""
    if starts_as_tiff(path):  # tifffile reads the file itself: no second read of it into memory
        image = _tiff_bands_last(path)
    else:
        image = _decode(_file_bytes(path), cv2.IMREAD_UNCHANGED, path)
        if image.ndim == 2:
            image = image[..., None]
        elif image.shape[2] in (3, 4):  # cv2's BGR(A) -> the file's RGB(A)
            image = image[..., [2, 1, 0, 3][: image.shape[2]]]
    if image.dtype not in _SAMPLE_TYPES:
        raise BadSampleError(f"image '{path}' holds {image.dtype} samples; expected 8- or 16-bit unsigned integers "
                             "(uint8 or uint16): convert it, scaling its values to that range")
    return image


def read_image(path: str | os.PathLike, image_format: ImageFormat = ImageFormat(), *,
               exif_orientation: bool = False) -> np.ndarray:
    """H x W x image_format.channels, uint8 or uint16 by image_format.max_value (see the module
    docstring); BadSampleError naming the file if it is missing, not an image, a JPEG cut short
    (decoders fill the missing part in grey silently), or of another channel count or bit depth.

    8-bit RGB ignores the EXIF orientation for training data, like the masks drawn on the stored pixels;
    `exif_orientation=True` applies it (photos to predict: a phone's portrait shot is stored sideways
    with an orientation tag). Other formats are read as stored."""
    if not image_format.is_rgb8:
        image = read_stored_image(path)
        _check_format(image, path, image_format)
        return image
    if starts_as_tiff(path):
        _check_colour_readable(path, image_format)
    flags = cv2.IMREAD_COLOR_RGB if exif_orientation else _IMAGE_READ_FLAGS
    return _decode(_file_bytes(path), flags, path)


def _check_format(image: np.ndarray, path: str | os.PathLike, image_format: ImageFormat) -> None:
    expected = image_format.dtype
    if image.dtype != expected:
        fix = ("set data.max_value to their full scale, e.g. 4095 for 12-bit or 65535 for 16-bit values "
               "(`python -m syncseg verify` prints it)" if expected is np.uint8 else
               "8-bit images take data.max_value <= 255")
        raise BadSampleError(f"image '{path}' is {_bits(image.dtype)}-bit but data.max_value={image_format.max_value} "
                             f"expects {_bits(expected)}-bit images; {fix}")
    if image.shape[2] != image_format.channels:
        raise BadSampleError(f"image '{path}' has {image.shape[2]} channel(s) but data.in_channels="
                             f"{image_format.channels} expects {image_format.channels}; set data.in_channels to the "
                             "images' channel count, or convert the image")


def display_rgb(image: np.ndarray, max_value: int) -> np.ndarray:
    """H x W x 3 uint8 to look at, from an H x W x C image of full scale `max_value`: 3 channels as they
    are, 1 or 2 the first as grey, more than 3 the first three as RGB, values scaled to 0..255. An
    8-bit RGB image of full scale 255 is returned as it is."""
    channels = image.shape[2]
    rgb = image if channels == 3 else image[..., :3] if channels > 3 else np.repeat(image[..., :1], 3, axis=2)
    if rgb.dtype == np.uint8 and max_value == MAX_8BIT:
        return rgb
    scaled = rgb.astype(np.float32) * np.float32(MAX_8BIT / max_value)
    return np.clip(np.rint(scaled), 0, MAX_8BIT).astype(np.uint8)
