"""Georeferenced scenes written for the raster tests: bright square "buildings" on a textured ground, a nodata
frame, any band count and sample type, in a projected CRS, with their labels as a raster and as polygons."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

UTM = "EPSG:32633"
ORIGIN = (500000.0, 4200000.0)  # the scene's top-left corner in UTM 33N
PIXEL = 0.5  # metres


@dataclass
class WrittenScene:
    image: Path
    labels: Path  # label raster on the scene's grid: 0 ground, 1 building
    truth: np.ndarray  # H x W uint8: the same labels
    boxes: list[tuple[int, int, int, int]]  # (top, left, bottom, right) pixels of each building
    frame: int  # nodata pixels on each side


def scene_transform(origin: tuple[float, float] = ORIGIN, pixel: float = PIXEL):
    from rasterio.transform import from_origin

    return from_origin(origin[0], origin[1], pixel, pixel)


def write_scene(folder: Path, name: str = "scene", *, size: tuple[int, int] = (200, 240), bands: int = 1,
                dtype: str = "uint16", crs: str | None = UTM, frame: int = 12, buildings: int = 24,
                seed: int = 0, nodata: float | None = 0) -> WrittenScene:
    """An image raster of `size` (height, width) whose `frame` outermost pixels are `nodata` (None: 0 and no
    nodata value), and its label raster (`<name>_labels.tif`)."""
    import rasterio

    height, width = size
    rng = np.random.default_rng(seed)
    truth = np.zeros(size, np.uint8)
    boxes = []
    for _ in range(buildings):
        side = int(rng.integers(8, 20))
        top, left = int(rng.integers(frame, height - frame - side)), int(rng.integers(frame, width - frame - side))
        truth[top:top + side, left:left + side] = 1
        boxes.append((top, left, top + side, left + side))
    ground = rng.uniform(0.05, 0.35, (bands, height, width))
    values = np.where(truth[None] == 1, rng.uniform(0.6, 0.9, (bands, height, width)), ground)
    floating = np.issubdtype(np.dtype(dtype), np.floating)
    pixels = values.astype(dtype) if floating else np.maximum(1, values * np.iinfo(dtype).max).astype(dtype)
    if frame:
        border = np.ones(size, bool)
        border[frame:-frame, frame:-frame] = False
        pixels[:, border] = 0 if nodata is None else nodata
    folder.mkdir(parents=True, exist_ok=True)
    transform = scene_transform()
    profile = {"driver": "GTiff", "height": height, "width": width, "transform": transform, "crs": crs,
               "tiled": True, "blockxsize": 64, "blockysize": 64}
    image = folder / f"{name}.tif"
    with rasterio.open(image, "w", count=bands, dtype=dtype, nodata=nodata, **profile) as sink:
        sink.write(pixels)
    labels = folder / f"{name}_labels.tif"
    with rasterio.open(labels, "w", count=1, dtype="uint8", **profile) as sink:
        sink.write(truth[None])
    return WrittenScene(image, labels, truth, boxes, frame)


def box_polygon(box: tuple[int, int, int, int], transform) -> list[list[float]]:
    top, left, bottom, right = box
    corners = [(left, top), (right, top), (right, bottom), (left, bottom), (left, top)]
    return [list(transform @ corner) for corner in corners]


def write_polygons(path: Path, scene: WrittenScene, *, crs: str = UTM, only: int | None = None,
                   attribute: str = "class", value: object = 1) -> Path:
    """The scene's buildings as a GeoJSON of polygons (the first `only` of them), reprojected into `crs`."""
    from rasterio.warp import transform_geom

    features = []
    for index, box in enumerate(scene.boxes[:only]):
        geometry = {"type": "Polygon", "coordinates": [box_polygon(box, scene_transform())]}
        if crs != UTM:
            geometry = transform_geom(UTM, crs, geometry)
        features.append({"type": "Feature", "id": index, "geometry": geometry, "properties": {attribute: value}})
    collection = {"type": "FeatureCollection", "features": features}
    if crs != "EPSG:4326":  # GeoJSON's own CRS is WGS84; anything else is named (GDAL reads the old member)
        collection["crs"] = {"type": "name", "properties": {"name": f"urn:ogc:def:crs:{crs.replace(':', '::')}"}}
    path.write_text(json.dumps(collection))
    return path


def raster_overrides(root: Path, scenes: list[str], labels: list[str], *, bands: int = 1, max_value: int = 65535,
                     crop: int = 48, extra: tuple[str, ...] = ()) -> list[str]:
    """KEY=VALUE lines for a raster config over files under `root`."""
    return [
        "data.dataset=raster", f"data.root={root}", f"data.scenes=[{','.join(scenes)}]",
        f"data.labels=[{','.join(labels)}]", "data.num_classes=2", "data.class_names=[ground,building]",
        f"data.in_channels={bands}", f"data.max_value={max_value}", f"data.mean=[{','.join(['0.4'] * bands)}]",
        f"data.std=[{','.join(['0.25'] * bands)}]", f"data.crop_size={crop}", *extra]
