"""verify_dataset for data.dataset=raster: what each scene and its labels hold, read at a reduced resolution
(a scene is never read whole), the mismatches between them, and the config lines that read them.

Per scene: CRS, pixel size, size, bands, sample type, nodata value and share, each band's value range, mean and
std over the valid pixels only. Per label source: its kind, CRS and grid against the scene's (one line each when
they differ: it is reprojected or resampled), the share of the scene's valid pixels it labels, the pixels of each
class. Then the lines: data.in_channels, data.max_value (data.raster_scale for float rasters), data.mean and
data.std, data.uncovered and the base config that fits the labels (`advice`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from syncseg.data.raster.labels import RasterLabels, VectorLabels, crs_differs, is_vector, vector_crs
from syncseg.data.raster.scenes import Scene, check_scene_format, open_raster, read_scene

SAMPLE_SIDE = 1024  # the longer side of the reduced read
SPARSE = 0.2  # labels on less than this share of the valid pixels are sparse
# the shipped base configs for each kind of labels (configs/*.yaml)
DENSE_BASE, SPARSE_BASE = "scenes.yaml", "small_data.yaml"


@dataclass
class SceneReport:
    scene: Scene
    valid_share: float
    low: np.ndarray
    high: np.ndarray
    mean: np.ndarray  # in the sample type's units
    std: np.ndarray
    labels: str = ""
    label_lines: list[str] = field(default_factory=list)
    labelled_share: float = 0.0  # of the valid pixels
    class_pixels: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


def _reduced(scene: Scene) -> tuple[int, int, float]:
    factor = max(1.0, max(scene.width, scene.height) / SAMPLE_SIDE)
    return max(1, round(scene.height / factor)), max(1, round(scene.width / factor)), factor


def inspect_scene(scene: Scene, labels: str, *, num_classes: int, class_names: Sequence[str], attribute: str,
                  uncovered: str, ignore: int) -> SceneReport:
    """The scene and its labels, from a read of at most SAMPLE_SIDE pixels a side (nearest neighbour)."""
    from rasterio.enums import Resampling
    from rasterio.features import rasterize

    height, width, factor = _reduced(scene)
    with open_raster(scene.path) as source:
        bands = source.read(out_shape=(scene.count, height, width), resampling=Resampling.nearest)
        valid = source.dataset_mask(out_shape=(height, width), resampling=Resampling.nearest) > 0
    if np.issubdtype(bands.dtype, np.floating):
        valid &= np.isfinite(bands).all(axis=0)
    values = bands[:, valid].astype(np.float64)
    empty = np.full(scene.count, np.nan)
    report = SceneReport(scene, float(valid.mean()), values.min(1) if values.size else empty,
                         values.max(1) if values.size else empty, values.mean(1) if values.size else empty,
                         values.std(1) if values.size else empty, labels)
    transform = scene.transform @ scene.transform.scale(scene.width / width, scene.height / height)
    if is_vector(labels):
        source = VectorLabels(labels, scene, attribute=attribute, class_names=class_names, num_classes=num_classes,
                              uncovered=ignore)
        drawn = rasterize(source.shapes, out_shape=(height, width), fill=ignore, dtype=np.uint8, transform=transform)
        covered = (drawn != ignore) & valid
        report.label_lines.append(f"{len(source.shapes)} features in {labels}")
        crs = vector_crs(labels)
        if crs_differs(crs, scene):
            report.label_lines.append(f"{labels} is in {crs}, the scene in {scene.describe_crs()}: reprojected")
        if uncovered == "background":
            drawn = np.where(drawn == ignore, 0, drawn)
    else:
        source = RasterLabels(labels, scene, ignore=ignore)
        if source.warped:
            report.label_lines.append(f"{labels} is not on the scene's grid: resampled onto it (nearest neighbour)")
        drawn = source.handle().read(1, out_shape=(height, width), resampling=Resampling.nearest, masked=True)
        drawn = np.ma.filled(drawn.astype(np.int64), ignore)
        covered = (drawn != ignore) & valid
    report.labelled_share = float(covered.sum() / max(1, valid.sum()))
    counted = drawn[covered & (drawn < num_classes)].astype(np.int64)
    report.class_pixels = np.bincount(counted, minlength=num_classes)[:num_classes] * round(factor * factor)
    return report


def full_scale(report: Sequence[SceneReport]) -> tuple[int, float]:
    """(data.max_value, data.raster_scale) that read these scenes: the sample type's full scale, 4095 for 12-bit
    data in 16-bit files; floats are scaled so that their largest valid value is 65535."""
    scene = report[0].scene
    kind = np.dtype(scene.dtype)
    high = max(float(np.nanmax(item.high)) for item in report)
    if np.issubdtype(kind, np.floating):
        return 65535, 65535 / high if high > 0 else 1.0
    if kind == np.uint8:
        return 255, 0.0
    return (4095 if high <= 4095 else 65535), 0.0


def advice(reports: Sequence[SceneReport], uncovered: str) -> tuple[str, str]:
    """(the base config, why) for these labels: dense masks or sparse polygons."""
    share = sum(r.labelled_share * r.valid_share for r in reports) / max(1e-9, sum(r.valid_share for r in reports))
    if share < SPARSE or (uncovered == "ignore" and share < 0.5):
        return SPARSE_BASE, (f"sparse labels: {share:.1%} of the valid pixels are labelled; the rest is ignored "
                             "(data.uncovered=ignore)")
    return DENSE_BASE, f"dense labels: {share:.1%} of the valid pixels are labelled"


def describe(data_cfg: Any) -> tuple[list[str], dict[str, Any]]:
    """The report's lines (each scene and its labels, then the config lines) and the same figures as a dict."""
    from syncseg.data.raster.dataset import scene_files

    scenes, labels = scene_files(data_cfg)
    reports = []
    lines = []
    for path, label in zip(scenes, labels):
        scene = read_scene(path)
        report = inspect_scene(scene, str(label), num_classes=data_cfg.num_classes,
                               class_names=tuple(data_cfg.class_names), attribute=data_cfg.label_attribute,
                               uncovered=data_cfg.uncovered, ignore=data_cfg.ignore_index)
        reports.append(report)
        x_size, y_size = abs(scene.transform.a), abs(scene.transform.e)
        unit = scene.crs.linear_units if scene.crs and scene.crs.is_projected else ("degrees" if scene.crs else "px")
        nodata = "none" if scene.nodata is None else f"{scene.nodata:g}"
        lines.append(f"[raster] {scene.path}: {scene.width}x{scene.height} px, {scene.count} band(s) {scene.dtype}, "
                     f"{scene.describe_crs()}, pixel {x_size:g} x {y_size:g} {unit}; nodata {nodata}, "
                     f"{1 - report.valid_share:.1%} of the pixels")
        for band in range(scene.count):
            lines.append(f"  band {band + 1}: {report.low[band]:g}..{report.high[band]:g}, "
                         f"mean {report.mean[band]:.4g}, "
                         f"std {report.std[band]:.4g} (valid pixels)")
        lines.extend(f"  labels: {line}" for line in report.label_lines)
        classes = ", ".join(f"{name} {count}" for name, count in
                            zip(data_cfg.class_names or [f"class_{i}" for i in range(data_cfg.num_classes)],
                                report.class_pixels.tolist()))
        lines.append(f"  labels {label}: {report.labelled_share:.1%} of the valid pixels labelled; class pixels "
                     f"(about): {classes}")
    first = reports[0].scene
    for report in reports[1:]:
        if report.scene.count != first.count:
            lines.append(f"  BAD: {report.scene.path} has {report.scene.count} bands, {first.path} {first.count}")
        if report.scene.crs != first.crs:
            lines.append(f"  WARNING: {report.scene.path} is in {report.scene.describe_crs()}, {first.path} in "
                         f"{first.describe_crs()}")
    max_value, scale = full_scale(reports)
    factor = scale if scale else 1.0
    weights = np.array([r.valid_share * r.scene.width * r.scene.height for r in reports])
    mean = sum(w * r.mean for w, r in zip(weights, reports)) / weights.sum() * factor / max_value
    std = sum(w * r.std for w, r in zip(weights, reports)) / weights.sum() * factor / max_value
    base, why = advice(reports, data_cfg.uncovered)
    config = [f"data.in_channels={first.count}", f"data.max_value={max_value}",
              *([f"data.raster_scale={scale:.6g}"] if scale else []),
              f"data.mean=[{','.join(f'{v:.4f}' for v in mean)}]",
              f"data.std=[{','.join(f'{max(v, 1e-4):.4f}' for v in std)}]"]
    try:
        check_scene_format(first, channels=first.count, max_value=max_value, raster_scale=scale)
    except ValueError as error:
        lines.append(f"  BAD: {error}")
    lines += ["config lines that read these scenes (valid pixels only):", *(f"  {line}" for line in config),
              f"base config: `base: {base}` ({why})"]
    return lines, {"scenes": [{"path": r.scene.path, "crs": r.scene.describe_crs(), "bands": r.scene.count,
                               "dtype": r.scene.dtype, "nodata_share": 1 - r.valid_share,
                               "labelled_share": r.labelled_share, "class_pixels": r.class_pixels.tolist()}
                              for r in reports],
                   "config_lines": config, "base": base, "labels_kind": why.split(":")[0]}
