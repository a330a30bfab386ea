"""predict.py on a whole georeferenced scene: tiles in, blended logits, a GeoTIFF of class ids out.

The scene is read in tiles of `tile` pixels that overlap by `overlap`. Each tile's logits are weighted by
`blend_weights`: zero within a quarter of the overlap of a tile edge that has a neighbour (the pixels whose
context the tile cuts off), rising linearly to one at half the overlap, one at the scene's own borders. The
weighted logits are summed and divided by the summed weights, so seams fade over the overlap, and a model
that sees less than a quarter of the overlap around a pixel gives exactly the whole-image prediction.

Memory is bounded by the tile, not the scene: the tiles go through the scene in column bands of
`BAND_TILES` tiles, row by row; only one row of tiles' logits for one band is held, and the rows no later
tile touches are written out. The bands are cut where one tile alone covers the columns, and that tile
is predicted for both bands (1 / BAND_TILES more work). GDAL's block cache is held to GDAL_CACHE_MB.

Outputs appear whole or not at all: each is written to `.<name>.partial` in the output folder and renamed
once complete (the classes as a Cloud-Optimized GeoTIFF), so a stopped prediction leaves no GeoTIFF with a
valid header under the output's name; a stale partial file is removed at the next start.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from syncseg.data.transforms import window_starts
from syncseg.data.raster.scenes import RasterError, Scene, SceneReader, Window, rasterio_module

logger = logging.getLogger(__name__)

BAND_TILES = 8  # tiles per column band: the memory held is one row of them
GDAL_CACHE_MB = 16
NODATA_CLASS = 255  # the class raster's nodata (the ignore label's value)
NODATA_PROBABILITY = 255  # probabilities are written in percent, 0..100
VECTOR_BLOCK = 4096  # polygons are traced in blocks of this many pixels a side, and cut at their borders

LogitsFn = Callable[[list[np.ndarray]], torch.Tensor]  # H x W x C tiles -> N x K x H x W float logits


def tile_starts(length: int, tile: int, overlap: int) -> list[int]:
    """The tiles' starts along one axis: every tile - overlap pixels, the last shifted back to end at the border."""
    return window_starts(length, tile, tile - overlap)


def blend_weights(tile: int, overlap: int, *, first: bool, last: bool) -> np.ndarray:
    """One axis of a tile's weights (float64, `tile` values); `first` / `last`: that side is the scene's border."""
    weights = np.ones(tile)
    if overlap < 2:
        return weights
    dead, full = overlap // 4, overlap // 2
    ramp = np.clip((np.arange(tile) - dead + 1) / (full - dead + 1), 0.0, 1.0)
    if not first:
        weights *= ramp
    if not last:
        weights *= ramp[::-1]
    return weights


def check_tiling(scene: Scene, tile: int, overlap: int) -> None:
    """RasterError naming the value when the scene cannot be tiled so."""
    if tile < 16:
        raise RasterError(f"--tile {tile}: expected at least 16 pixels")
    if not 0 <= overlap < tile:
        raise RasterError(f"--overlap {overlap}: expected 0 <= overlap < --tile {tile}")
    if scene.width < tile or scene.height < tile:
        raise RasterError(f"raster '{scene.path}' is {scene.width}x{scene.height}, smaller than one --tile {tile}; "
                          f"use --tile {min(scene.width, scene.height)} or less")


@dataclass
class SceneOutputs:
    """The files of one scene's prediction (written or not) and what was measured."""

    classes: Path
    probabilities: Path | None = None
    vectors: Path | None = None
    seconds: float = 0.0
    tiles: int = 0
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # pixels per class

    def written(self) -> list[Path]:
        return [path for path in (self.classes, self.probabilities, self.vectors) if path is not None]


def partial_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial")


def _profile(scene: Scene, *, count: int, dtype: str, nodata: int) -> dict[str, Any]:
    return {"driver": "GTiff", "width": scene.width, "height": scene.height, "count": count, "dtype": dtype,
            "crs": scene.crs, "transform": scene.transform, "nodata": nodata, "tiled": True, "blockxsize": 256,
            "blockysize": 256, "compress": "deflate", "BIGTIFF": "IF_SAFER"}


def _bands(width: int, tile: int, overlap: int) -> list[tuple[int, int, list[int]]]:
    """(first output column, end column, tile starts that reach them) of each column band."""
    starts = tile_starts(width, tile, overlap)
    cuts = [0]
    for index in range(BAND_TILES - 1, len(starts) - 1, BAND_TILES):  # the last tile of each band but the last
        single = (starts[index - 1] + tile if index else 0, starts[index + 1])  # its columns no other tile has
        # a cut there: that tile alone is predicted for both bands; else the middle of the overlap (two are)
        cuts.append(sum(single) // 2 if single[0] < single[1] else (starts[index] + tile + starts[index + 1]) // 2)
    cuts.append(width)
    return [(first, end, [s for s in starts if s < end and s + tile > first]) for first, end in zip(cuts, cuts[1:])]


def blend_scene(reader: SceneReader, logits_of: LogitsFn, *, num_classes: int, tile: int, overlap: int,
                batch_size: int, write: Callable[[Window, np.ndarray, np.ndarray], None]) -> int:
    """Predict `reader`'s scene tile by tile and hand each finished block to `write(window, logits K x h x w
    float32 (blended), valid h x w bool)`; returns the number of tiles predicted."""
    scene = reader.scene
    rows = tile_starts(scene.height, tile, overlap)
    column_weights = {}
    tiles = 0
    for first, end, columns in _bands(scene.width, tile, overlap):
        width = end - first
        sums = np.zeros((num_classes, tile, width), np.float32)
        weights = np.zeros((tile, width), np.float32)
        for row_index, top in enumerate(rows):
            y_weights = blend_weights(tile, overlap, first=top == 0, last=top + tile == scene.height)
            windows = [Window(top, left, tile, tile) for left in columns]
            for start in range(0, len(windows), batch_size):
                chunk = windows[start:start + batch_size]
                images = [reader.read(window)[0] for window in chunk]
                logits = logits_of(images).float().numpy()
                tiles += len(chunk)
                for window, tile_logits in zip(chunk, logits):
                    key = window.left
                    if key not in column_weights:
                        column_weights[key] = blend_weights(tile, overlap, first=key == 0,
                                                            last=key + tile == scene.width)
                    weight = (y_weights[:, None] * column_weights[key][None, :]).astype(np.float32)
                    a, b = max(first, window.left), min(end, window.right)  # the tile's columns in this band
                    part = slice(a - window.left, b - window.left)
                    sums[:, :, a - first:b - first] += tile_logits[:, :, part] * weight[None, :, part]
                    weights[:, a - first:b - first] += weight[:, part]
            done = (rows[row_index + 1] if row_index + 1 < len(rows) else top + tile) - top  # rows no later tile meets
            block = Window(top, first, done, width)
            write(block, sums[:, :done] / np.maximum(weights[:done], 1e-12), reader.valid(block))
            sums[:, :tile - done] = sums[:, done:].copy()  # in place: no new buffers per row of tiles
            sums[:, tile - done:] = 0
            weights[:tile - done] = weights[done:].copy()
            weights[tile - done:] = 0
    return tiles


def predict_scene(reader: SceneReader, logits_of: LogitsFn, *, num_classes: int, class_names: Sequence[str],
                  output: Path, tile: int, overlap: int, batch_size: int = 1, probabilities: bool = False,
                  vectors: bool = False) -> SceneOutputs:
    """Write `<output>/<scene>_classes.tif` (and `_probabilities.tif`, `_classes.geojson`) for the scene."""
    rasterio = rasterio_module()
    scene = reader.scene
    check_tiling(scene, tile, overlap)
    outputs = SceneOutputs(classes=output / f"{scene.name}_classes.tif",
                           probabilities=output / f"{scene.name}_probabilities.tif" if probabilities else None,
                           vectors=output / f"{scene.name}_classes.geojson" if vectors else None)
    if any(Path(scene.path).resolve() == path.resolve() for path in outputs.written()):
        raise RasterError(f"--output '{output}' would overwrite the input '{scene.path}'")
    partials = [partial_path(path) for path in outputs.written()]
    for path in partials:
        path.unlink(missing_ok=True)  # a stale one from a prediction that was stopped
    counts = np.zeros(num_classes + 1, np.int64)
    started = time.perf_counter()
    try:
        with rasterio.Env(GDAL_CACHEMAX=GDAL_CACHE_MB):
            classes_partial = partial_path(outputs.classes)
            with rasterio.open(classes_partial, "w", **_profile(scene, count=1, dtype="uint8", nodata=NODATA_CLASS)) \
                    as classes_file:
                probability_file = rasterio.open(partial_path(outputs.probabilities), "w", **_profile(
                    scene, count=num_classes, dtype="uint8", nodata=NODATA_PROBABILITY)) if probabilities else None
                try:
                    def write(window: Window, logits: np.ndarray, valid: np.ndarray) -> None:
                        labels = logits.argmax(0).astype(np.uint8)
                        labels[~valid] = NODATA_CLASS
                        counts[:] += np.bincount(np.where(valid, labels, num_classes).ravel(),
                                                 minlength=num_classes + 1)
                        classes_file.write(labels[None], window=window.rasterio())
                        if probability_file is not None:
                            scores = torch.from_numpy(logits).softmax(0).mul_(100).round_().to(torch.uint8).numpy()
                            scores[:, ~valid] = NODATA_PROBABILITY
                            probability_file.write(scores, window=window.rasterio())

                    outputs.tiles = blend_scene(reader, logits_of, num_classes=num_classes, tile=tile, overlap=overlap,
                                                batch_size=batch_size, write=write)
                finally:
                    if probability_file is not None:
                        probability_file.close()
            outputs.seconds = time.perf_counter() - started
            _as_cog(classes_partial, partial_path(outputs.classes.with_name(outputs.classes.name + ".cog")))
            if vectors:
                _write_vectors(classes_partial, partial_path(outputs.vectors), class_names)
        for path in outputs.written():
            os.replace(partial_path(path), path)
    except BaseException:
        for path in partials:
            path.unlink(missing_ok=True)
        partial_path(outputs.classes.with_name(outputs.classes.name + ".cog")).unlink(missing_ok=True)
        logger.error("%s: prediction stopped; nothing complete was written for it (%s are as they were)",
                     scene.path, ", ".join(str(path) for path in outputs.written()))
        raise
    outputs.counts = counts[:num_classes]
    return outputs


def _as_cog(source: Path, target: Path) -> None:
    """The tiled GeoTIFF at `source` rewritten as a Cloud-Optimized GeoTIFF (overviews by mode), in place."""
    from rasterio.shutil import copy

    copy(source, target, driver="COG", compress="DEFLATE", overview_resampling="mode", BIGTIFF="IF_SAFER")
    os.replace(target, source)


def _write_vectors(classes: Path, target: Path, class_names: Sequence[str]) -> None:
    """Polygons of each class of the class raster as GeoJSON (EPSG:4326 as RFC 7946 has it, when the raster has a
    CRS), traced block by block (polygons are cut at block borders), every class but nodata."""
    from syncseg.data.raster.labels import fiona_module

    fiona = fiona_module()
    rasterio = rasterio_module()
    from rasterio.features import shapes
    from rasterio.warp import transform_geom
    from rasterio.windows import Window as RasterioWindow
    from rasterio.windows import transform as window_transform

    schema = {"geometry": "Polygon", "properties": {"class": "int", "name": "str"}}
    with rasterio.open(classes) as source:
        crs = source.crs
        with fiona.open(target, "w", driver="GeoJSON", schema=schema, crs="EPSG:4326" if crs else None) as sink:
            for top in range(0, source.height, VECTOR_BLOCK):
                for left in range(0, source.width, VECTOR_BLOCK):
                    window = RasterioWindow(left, top, min(VECTOR_BLOCK, source.width - left),
                                            min(VECTOR_BLOCK, source.height - top))
                    labels = source.read(1, window=window)
                    for geometry, value in shapes(labels, mask=labels != NODATA_CLASS,
                                                  transform=window_transform(window, source.transform)):
                        if crs:
                            geometry = transform_geom(crs, "EPSG:4326", geometry)
                        index = int(value)
                        sink.write({"geometry": geometry, "properties": {
                            "class": index, "name": class_names[index] if index < len(class_names) else str(index)}})
