"""A scene's labels, read for one window at a time on the scene's own grid.

- a label raster (class ids per pixel; its nodata is the ignore label): read directly when it lies on the
  scene's grid, else through a nearest-neighbour WarpedVRT onto it (said once);
- a vector file (GeoJSON, GeoPackage, Shapefile: anything fiona opens): polygons whose `data.label_attribute`
  names the class (an index, or a name of data.class_names), reprojected to the scene's CRS when theirs differs
  (said once), drawn into each window (later features over earlier ones); pixels no polygon covers are
  data.uncovered (background = class 0, or ignored: sparse polygons).

And the regions that split scenes into training and validation (data.val_region).
"""
from __future__ import annotations

import math
import os
from typing import Any, Sequence

import numpy as np

from syncseg.data.raster.scenes import GEO_EXTRA, RasterError, Scene, Window, open_raster, rasterio_module, say_once

VAL_FRACTION = 0.2  # without data.val_region: the bottom fifth of each scene's rows validate


def fiona_module() -> Any:
    try:
        import fiona
    except ImportError:
        raise RasterError(f"vector labels are read with fiona, which is not installed: {GEO_EXTRA}") from None
    return fiona


def _coordinates(geometry: dict[str, Any]) -> np.ndarray:
    """Every vertex of a GeoJSON-like geometry as an N x 2 array."""
    points: list[Any] = []

    def walk(part: Any) -> None:
        if part and isinstance(part[0], (int, float)):
            points.append(part[:2])
        else:
            for item in part:
                walk(item)

    if geometry.get("type") == "GeometryCollection":
        for item in geometry.get("geometries", []):
            points.extend(_coordinates(item).tolist())
    else:
        walk(geometry.get("coordinates", []))
    return np.asarray(points, dtype=np.float64).reshape(-1, 2)


def _pixel_bounds(scene: Scene, xy: np.ndarray) -> tuple[float, float, float, float]:
    """(top, left, bottom, right) in the scene's pixels of points in its CRS."""
    columns, rows = ~scene.transform @ (xy[:, 0], xy[:, 1])
    return float(np.min(rows)), float(np.min(columns)), float(np.max(rows)), float(np.max(columns))


def read_vectors(path: str, scene: Scene, *, attribute: str = "", class_names: Sequence[str] = (),
                 num_classes: int = 0) -> list[tuple[dict[str, Any], int]]:
    """The features of the vector file `path` as (geometry in the scene's CRS, value): the class index of
    `attribute` (checked against `num_classes` / `class_names`), or with attribute "" the feature's order (for
    regions)."""
    fiona = fiona_module()
    if not os.path.isfile(path):
        raise RasterError(f"vector file '{path}' not found")
    try:
        with fiona.open(path) as layer:
            crs = layer.crs
            features = [(dict(feature.geometry.__geo_interface__) if feature.geometry is not None else None,
                         dict(feature.properties or {}), feature.id) for feature in layer]
    except fiona.errors.FionaError as error:
        raise RasterError(f"cannot read vector file '{path}': {error}") from None
    features = [item for item in features if item[0] is not None]
    if not features:
        raise RasterError(f"vector file '{path}' has no features with a geometry")
    crs_text = crs.to_string() if crs else ""
    if crs_differs(crs_text, scene):
        say_once(f"vector file '{path}' is in {crs_text}, the scene '{scene.path}' in {scene.describe_crs()}: its "
                 "geometries are reprojected to the scene's CRS")
        from rasterio.warp import transform_geom

        features = [(transform_geom(crs, scene.crs, geometry), properties, fid)
                    for geometry, properties, fid in features]
    shapes = []
    for order, (geometry, properties, fid) in enumerate(features):
        if not attribute:
            shapes.append((geometry, order))
            continue
        if attribute not in properties or properties[attribute] is None:
            raise RasterError(f"vector file '{path}': feature {fid} has no '{attribute}' attribute "
                              f"(data.label_attribute); its attributes: {sorted(properties)}")
        shapes.append((geometry, _class_index(properties[attribute], path, fid, attribute, class_names, num_classes)))
    return shapes


def _class_index(value: Any, path: str, fid: Any, attribute: str, class_names: Sequence[str], num_classes: int) -> int:
    if isinstance(value, str) and value in class_names:
        return list(class_names).index(value)
    try:
        index = int(value)
    except (TypeError, ValueError):
        index = -1
    if isinstance(value, float) and index != value:
        index = -1
    if not 0 <= index < num_classes:
        named = f" or one of data.class_names {list(class_names)}" if class_names else ""
        raise RasterError(f"vector file '{path}': feature {fid} has {attribute}={value!r}; expected a class index "
                          f"0..{num_classes - 1}{named}")
    return index


def crs_differs(crs: str, scene: Scene) -> bool:
    """Whether a vector file's CRS (as text, "" without one) is another than the scene's (both must have one)."""
    return bool(scene.crs and crs) and rasterio_module().crs.CRS.from_user_input(crs) != scene.crs


def vector_crs(path: str) -> str:
    """The CRS of a vector file, as text ("" without one)."""
    with fiona_module().open(path) as layer:
        return layer.crs.to_string() if layer.crs else ""


class VectorLabels:
    """Polygons drawn into windows of one scene; each window draws only the polygons whose bounds meet it."""

    def __init__(self, path: str, scene: Scene, *, attribute: str, class_names: Sequence[str], num_classes: int,
                 uncovered: int) -> None:
        self.path, self.scene, self.uncovered = path, scene, uncovered
        self.shapes = read_vectors(path, scene, attribute=attribute, class_names=class_names, num_classes=num_classes)
        bounds = np.asarray([_pixel_bounds(scene, _coordinates(geometry)) for geometry, _ in self.shapes])
        self.bounds = bounds  # N x (top, left, bottom, right) in pixels
        if not ((bounds[:, 2] > 0) & (bounds[:, 0] < scene.height) & (bounds[:, 3] > 0)
                & (bounds[:, 1] < scene.width)).any():
            raise RasterError(f"vector file '{path}': none of its {len(self.shapes)} features overlaps the scene "
                              f"'{scene.path}' ({scene.describe_crs()}); expected labels on the scene")

    def read(self, window: Window) -> np.ndarray:
        """H x W uint8 labels of the window (`uncovered` where no polygon is)."""
        from rasterio.features import rasterize
        from rasterio.windows import transform as window_transform

        b = self.bounds
        meets = ((b[:, 0] <= window.bottom) & (b[:, 2] >= window.top) & (b[:, 1] <= window.right)
                 & (b[:, 3] >= window.left))
        shapes = [self.shapes[i] for i in np.flatnonzero(meets)]
        if not shapes:
            return np.full((window.height, window.width), self.uncovered, np.uint8)
        return rasterize(shapes, out_shape=(window.height, window.width), fill=self.uncovered, dtype=np.uint8,
                         transform=window_transform(window.rasterio(), self.scene.transform))


class RasterLabels:
    """A label raster: the scene's grid, or warped onto it with nearest neighbour. Its nodata is `ignore`."""

    def __init__(self, path: str, scene: Scene, *, ignore: int) -> None:
        self.path, self.scene, self.ignore = path, scene, ignore
        with open_raster(path) as source:
            if source.count != 1:
                raise RasterError(f"label raster '{path}' has {source.count} bands; expected one band of class ids")
            self.nodata = source.nodata
            same = (source.width, source.height) == (scene.width, scene.height) and source.transform == scene.transform
            same_crs = source.crs == scene.crs
            if not same_crs and (source.crs is None or scene.crs is None):
                raise RasterError(f"label raster '{path}' is in {source.crs or 'no CRS'} and the scene '{scene.path}' "
                                  f"in {scene.describe_crs()}: one of them has no CRS, so they cannot be aligned")
            from rasterio.warp import transform_bounds

            left, bottom, right, top = transform_bounds(source.crs, scene.crs, *source.bounds) if not same_crs \
                else source.bounds
            scene_left, scene_top = scene.transform @ (0, 0)
            scene_right, scene_bottom = scene.transform @ (scene.width, scene.height)
            if (min(right, max(scene_left, scene_right)) <= max(left, min(scene_left, scene_right))
                    or min(top, max(scene_top, scene_bottom)) <= max(bottom, min(scene_top, scene_bottom))):
                raise RasterError(f"label raster '{path}' does not overlap the scene '{scene.path}'")
        self.warped = not (same and same_crs)
        if self.warped:
            say_once(f"label raster '{path}' is not on the grid of the scene '{scene.path}' ({scene.describe_crs()}, "
                     f"{scene.width}x{scene.height}): it is resampled onto it (nearest neighbour)")
        self._handle: Any = None
        self._pid = -1

    def handle(self) -> Any:
        if self._handle is None or self._pid != os.getpid():
            source = open_raster(self.path)
            if self.warped:
                from rasterio.enums import Resampling
                from rasterio.vrt import WarpedVRT

                source = WarpedVRT(source, crs=self.scene.crs, transform=self.scene.transform, width=self.scene.width,
                                   height=self.scene.height, resampling=Resampling.nearest,
                                   nodata=self.nodata if self.nodata is not None else self.ignore)
            self._handle, self._pid = source, os.getpid()
        return self._handle

    def read(self, window: Window) -> np.ndarray:
        """H x W raw label values (int64), the label raster's nodata (and what it does not cover) as `ignore`."""
        try:
            handle = self.handle()
            values = handle.read(1, window=window.rasterio(), masked=True)
        except rasterio_module().errors.RasterioError as error:
            raise RasterError(f"cannot read label raster '{self.path}' at {window}: {error}") from None
        return np.ma.filled(values.astype(np.int64), self.ignore)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handle": None, "_pid": -1}


def is_vector(path: str) -> bool:
    return os.path.splitext(path)[1].lower() in (".geojson", ".json", ".gpkg", ".shp", ".fgb", ".kml", ".gml")


def is_box(region: str) -> bool:
    """Whether data.val_region is a box "minx,miny,maxx,maxy" (else a vector file)."""
    parts = region.split(",")
    try:
        return len(parts) == 4 and all(math.isfinite(float(part)) for part in parts)
    except ValueError:
        return False


def val_windows(region: str, scene: Scene) -> list[Window]:
    """The pixel windows of `scene` that data.val_region names: "" = its bottom VAL_FRACTION of rows;
    "minx,miny,maxx,maxy" = a box in the scene's CRS (pixels without one); a vector file = each feature's
    bounding box. Clipped to the scene; [] when the region misses it."""
    if not region:
        rows = max(1, round(scene.height * VAL_FRACTION))
        return [Window(scene.height - rows, 0, rows, scene.width)]
    if not is_box(region):
        if not is_vector(region):
            raise RasterError(f"data.val_region={region!r}: expected a vector file (.geojson, .gpkg, .shp) or a box "
                              "'minx,miny,maxx,maxy' in the scene's CRS")
        boxes = [_pixel_bounds(scene, _coordinates(geometry)) for geometry, _ in read_vectors(region, scene)]
    else:
        minx, miny, maxx, maxy = (float(part) for part in region.split(","))
        if minx >= maxx or miny >= maxy:
            raise RasterError(f"data.val_region={region!r}: minx must be below maxx and miny below maxy")
        boxes = [_pixel_bounds(scene, np.array([[minx, miny], [maxx, maxy], [minx, maxy], [maxx, miny]]))]
    windows = []
    for top, left, bottom, right in boxes:
        top, left = max(0, int(np.floor(top))), max(0, int(np.floor(left)))
        bottom, right = min(scene.height, int(np.ceil(bottom))), min(scene.width, int(np.ceil(right)))
        if bottom > top and right > left:
            windows.append(Window(top, left, bottom - top, right - left))
    return windows
