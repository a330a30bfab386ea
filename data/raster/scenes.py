"""Georeferenced image rasters (GeoTIFF, COG, anything GDAL reads) read window by window with rasterio.

A `Scene` is a raster's header (size, bands, sample type, CRS, transform, nodata) read once; `SceneReader`
reads windows of it in the format the config trains on (data.in_channels bands, uint8 or uint16 by
data.max_value; float rasters through data.raster_scale) together with the window's valid pixels (the
raster's nodata value, its mask band or alpha: GDAL's dataset mask). A scene is never read whole. Each process
opens its own handle (a DataLoader worker is a fork: a GDAL handle must not cross it).

Everything a user can get wrong raises `RasterError`, one line naming the file and the value.
"""
from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

GEO_EXTRA = 'pip install "syncseg[geo]"'
_SAID: set[str] = set()  # the things said once per process (a raster without a CRS, labels reprojected)


class RasterError(ValueError):
    """A raster or vector file that cannot be used as it is: the message names the file and the value."""


def say_once(message: str) -> None:
    """A warning logged once per process."""
    if message not in _SAID:
        _SAID.add(message)
        logger.warning("%s", message)


def rasterio_module() -> Any:
    """rasterio, or RasterError naming the extra that installs it."""
    try:
        import rasterio
    except ImportError:
        raise RasterError(f"georeferenced rasters are read with rasterio, which is not installed: {GEO_EXTRA}") \
            from None
    # GDAL's own messages ("GDAL signalled an error: ... TIFFReadDirectory ...") come through this logger at INFO;
    # the one line naming the file says it instead (as syncseg.data.images quiets PIL and tifffile)
    logging.getLogger("rasterio._env").setLevel(logging.WARNING)
    return rasterio


@dataclass(frozen=True)
class Window:
    """A pixel rectangle of a scene: rows top..top+height, columns left..left+width."""

    top: int
    left: int
    height: int
    width: int

    @property
    def bottom(self) -> int:
        return self.top + self.height

    @property
    def right(self) -> int:
        return self.left + self.width

    def intersects(self, other: "Window") -> bool:
        return (self.top < other.bottom and other.top < self.bottom and self.left < other.right
                and other.left < self.right)

    def rasterio(self) -> Any:
        return rasterio_module().windows.Window(self.left, self.top, self.width, self.height)


@dataclass(frozen=True)
class Scene:
    """One image raster's header."""

    path: str
    width: int
    height: int
    count: int
    dtype: str
    crs: Any  # rasterio CRS, None without one
    transform: Any  # affine.Affine: pixel -> CRS coordinates
    nodata: float | None

    @property
    def name(self) -> str:
        return os.path.splitext(os.path.basename(self.path))[0]

    @property
    def is_float(self) -> bool:
        return np.issubdtype(np.dtype(self.dtype), np.floating)

    def describe_crs(self) -> str:
        return self.crs.to_string() if self.crs else "no CRS"


def open_raster(path: str | os.PathLike) -> Any:
    """rasterio's dataset for `path`; RasterError naming the file when it is missing or not a raster."""
    rasterio = rasterio_module()
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise RasterError(f"raster '{path}' not found")
    try:
        return rasterio.open(path)
    except rasterio.errors.RasterioError as error:
        raise RasterError(f"cannot read raster '{path}': {error}") from None


def read_scene(path: str | os.PathLike) -> Scene:
    """The header of the image raster at `path` (a raster without a CRS is allowed, and said once)."""
    with warnings.catch_warnings():  # rasterio's NotGeoreferencedWarning: said once below instead
        warnings.simplefilter("ignore", rasterio_module().errors.NotGeoreferencedWarning)
        source = open_raster(path)
        transform = source.transform
    with source:
        dtypes = set(source.dtypes)
        if len(dtypes) > 1:
            raise RasterError(f"raster '{path}' mixes sample types {sorted(dtypes)} across its bands; "
                              "expected one type for every band")
        scene = Scene(os.fspath(path), source.width, source.height, source.count, source.dtypes[0], source.crs,
                      transform, source.nodata)
    if scene.crs is None:
        say_once(f"raster '{path}' has no CRS: it is read in pixel coordinates, and what is written from it has "
                 "no CRS either")
    return scene


def check_scene_format(scene: Scene, *, channels: int, max_value: int, raster_scale: float) -> None:
    """RasterError when the config cannot read `scene`'s bands as data.in_channels / data.max_value say."""
    if scene.count != channels:
        raise RasterError(f"raster '{scene.path}' has {scene.count} band(s) but data.in_channels={channels}; set "
                          f"data.in_channels={scene.count} (with data.mean and data.std of that many values: "
                          "`python -m syncseg verify` prints them)")
    kind = np.dtype(scene.dtype)
    if scene.is_float:
        if raster_scale <= 0:
            raise RasterError(f"raster '{scene.path}' holds {scene.dtype} values; set data.raster_scale to the "
                              f"factor that takes them to 0..data.max_value={max_value} (`python -m syncseg verify` "
                              "prints one from the values it finds)")
        return
    if kind == np.uint16 and max_value <= 255:
        raise RasterError(f"raster '{scene.path}' is 16-bit (uint16) but data.max_value={max_value} reads 8-bit "
                          "images; set data.max_value to its full scale (65535, or 4095 for 12-bit data)")
    if kind not in (np.uint8, np.uint16):
        say_once(f"raster '{scene.path}' holds {scene.dtype} values: they are clipped to 0..{max_value} "
                 f"(data.max_value)")


def to_image_type(bands: np.ndarray, *, max_value: int, raster_scale: float) -> np.ndarray:
    """C x H x W samples as stored -> H x W x C uint8 (max_value <= 255) or uint16: floats times
    `raster_scale`, other types clipped to 0..max_value."""
    target = np.uint8 if max_value <= 255 else np.uint16
    if np.issubdtype(bands.dtype, np.floating):
        bands = np.rint(np.nan_to_num(bands, nan=0.0) * raster_scale)
        bands = np.clip(bands, 0, max_value)
    elif bands.dtype not in (np.uint8, np.uint16) or bands.dtype.itemsize > np.dtype(target).itemsize:
        bands = np.clip(bands, 0, max_value)
    return np.ascontiguousarray(bands.astype(target, copy=False).transpose(1, 2, 0))


class SceneReader:
    """Windows of one scene as training reads them: (image H x W x C uint8 / uint16, valid H x W bool).

    The handle is opened on first use in each process; the format was checked by check_scene_format."""

    def __init__(self, scene: Scene, *, max_value: int, raster_scale: float) -> None:
        self.scene = scene
        self.max_value = max_value
        self.raster_scale = raster_scale
        self._handle: Any = None
        self._pid = -1

    def handle(self) -> Any:
        if self._handle is None or self._pid != os.getpid():
            self._handle = open_raster(self.scene.path)
            self._pid = os.getpid()
        return self._handle

    def valid(self, window: Window) -> np.ndarray:
        """H x W bool: the window's pixels that hold data (GDAL's dataset mask: nodata, mask band, alpha)."""
        try:
            return self.handle().dataset_mask(window=window.rasterio()) > 0
        except rasterio_module().errors.RasterioError as error:
            raise RasterError(f"cannot read raster '{self.scene.path}' at {window}: {error}") from None

    def read(self, window: Window) -> tuple[np.ndarray, np.ndarray]:
        """The window's image in the config's format, and its valid pixels (invalid ones read as 0)."""
        try:
            bands = self.handle().read(window=window.rasterio())
        except rasterio_module().errors.RasterioError as error:
            raise RasterError(f"cannot read raster '{self.scene.path}' at {window}: {error}") from None
        valid = self.valid(window)
        if np.issubdtype(bands.dtype, np.floating):
            valid &= np.isfinite(bands).all(axis=0)
        image = to_image_type(bands, max_value=self.max_value, raster_scale=self.raster_scale)
        image[~valid] = 0
        return image, valid

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handle": None, "_pid": -1}
