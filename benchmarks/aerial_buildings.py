"""A 16-bit single-band aerial scene of buildings for data.dataset=raster: the base config verify_dataset advises,
measured against the other shipped recipes and a per-pixel baseline (no timing).

The scene (`write_scene`): SIZE x SIZE pixels, uint16 (full 16-bit scale), UTM 33N at 0.3 m, whose footprint is a
rotated square inside a nodata (0) frame, as a satellite or orthophoto tile arrives. The ground is grass and gravel
(two of benchmarks/textures' CC0 photographs, in grey) in irregular fields crossed by gravel roads; buildings are
rectangles of brick roofs with a shadow on one side, each roof at its own brightness, so that the grey level alone
confuses roofs with bright gravel. Labels: a label raster on the same grid (0 ground, 1 building) and the buildings as
polygons (GeoJSON, in EPSG:4326: reprojected when read). The bottom fifth of the scene validates (data.val_region's
default).

The baseline (`threshold_baseline`): the grey-level interval that best separates roofs on the training rows (its
building IoU there maximal), applied to the validation rows. A recipe must beat its building IoU.

    python -m benchmarks.aerial_buildings --root /tmp/aerial                    # data, verify's advice, baseline
    python -m benchmarks.aerial_buildings --root /tmp/aerial train.iters=400 \
        --train scenes.yaml small_data.yaml demo.yaml
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
TEXTURES = REPO / "benchmarks" / "textures"
SIZE = 1024
SEED = 3
VAL_ROWS = SIZE // 5  # the default validation region: the bottom fifth


def _grey(name: str) -> np.ndarray:
    from PIL import Image

    with Image.open(TEXTURES / f"{name}.png") as file:
        grey = np.asarray(file.convert("L"), dtype=np.float64) / 255
    return np.tile(grey, (SIZE // grey.shape[0] + 1, SIZE // grey.shape[1] + 1))[:SIZE, :SIZE]


def build(seed: int = SEED) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[int, int, int, int]]]:
    """(image SIZE x SIZE float 0..1, buildings bool, valid bool, the buildings' boxes top, left, bottom, right)."""
    from scipy.ndimage import gaussian_filter, rotate

    rng = np.random.default_rng(seed)
    grass, gravel, brick = _grey("grass"), _grey("gravel"), _grey("brick")
    field = gaussian_filter(rng.normal(size=(SIZE, SIZE)), 40) > 0
    image = np.where(field, 0.55 * grass + 0.1, 0.7 * gravel + 0.2)
    rows, cols = np.mgrid[0:SIZE, 0:SIZE]
    for _ in range(6):  # roads: bright gravel bands, across or down
        centre, half = int(rng.integers(0, SIZE)), int(rng.integers(6, 14))
        band = np.abs((rows if rng.random() < 0.5 else cols) - centre) < half
        image[band] = (0.8 * gravel + 0.25)[band]
    buildings = np.zeros((SIZE, SIZE), bool)
    boxes = []
    for _ in range(260):
        height, width = int(rng.integers(12, 48)), int(rng.integers(12, 48))
        top, left = int(rng.integers(0, SIZE - height - 6)), int(rng.integers(0, SIZE - width - 6))
        if buildings[max(0, top - 3):top + height + 3, max(0, left - 3):left + width + 3].any():
            continue
        level = rng.uniform(0.35, 0.95)
        image[top + height:top + height + 5, left + 3:left + width + 5] *= 0.45  # the shadow
        image[top:top + height, left:left + width] = level * (0.6 + 0.5 * brick[top:top + height, left:left + width])
        buildings[top:top + height, left:left + width] = True
        boxes.append((top, left, top + height, left + width))
    image = np.clip(image + rng.normal(0, 0.02, image.shape), 0.001, 1.0)
    footprint = rotate(np.pad(np.ones((SIZE - 200, SIZE - 200)), 100), 8, reshape=False, order=0) > 0.5
    return image, buildings, footprint, boxes


def write_scene(root: Path, seed: int = SEED) -> dict[str, Path]:
    """The scene's files under `root`: scene.tif, labels.tif, buildings.geojson."""
    import rasterio
    from rasterio.transform import from_origin
    from rasterio.warp import transform_geom

    image, buildings, footprint, boxes = build(seed)
    root.mkdir(parents=True, exist_ok=True)
    transform = from_origin(500000, 4200000, 0.3, 0.3)
    profile = {"driver": "GTiff", "width": SIZE, "height": SIZE, "count": 1, "crs": "EPSG:32633",
               "transform": transform, "tiled": True, "blockxsize": 256, "blockysize": 256, "compress": "deflate"}
    pixels = np.where(footprint, np.maximum(1, image * 65535), 0).astype(np.uint16)
    with rasterio.open(root / "scene.tif", "w", dtype="uint16", nodata=0, **profile) as sink:
        sink.write(pixels[None])
    with rasterio.open(root / "labels.tif", "w", dtype="uint8", **profile) as sink:
        sink.write(buildings.astype(np.uint8)[None])
    features = []
    for index, (top, left, bottom, right) in enumerate(boxes):
        ring = [list(transform @ (x, y)) for x, y in ((left, top), (right, top), (right, bottom), (left, bottom),
                                                       (left, top))]
        geometry = transform_geom("EPSG:32633", "EPSG:4326", {"type": "Polygon", "coordinates": [ring]})
        features.append({"type": "Feature", "id": index, "geometry": geometry, "properties": {"class": "building"}})
    (root / "buildings.geojson").write_text(json.dumps({"type": "FeatureCollection", "features": features}))
    return {"scene": root / "scene.tif", "labels": root / "labels.tif", "polygons": root / "buildings.geojson"}


def iou(predicted: np.ndarray, truth: np.ndarray) -> float:
    union = np.count_nonzero(predicted | truth)
    return float(np.count_nonzero(predicted & truth) / union) if union else 0.0


def threshold_baseline(seed: int = SEED, levels: int = 40) -> float:
    """Building IoU on the validation rows of the grey-level interval (whole bins of `levels` over 0..1) whose
    building IoU on the training rows is the best."""
    image, buildings, footprint, _ = build(seed)
    train, val = slice(0, SIZE - VAL_ROWS), slice(SIZE - VAL_ROWS, SIZE)
    bins = np.minimum((image * levels).astype(int), levels - 1)

    def counts(rows: slice, truth: bool) -> np.ndarray:  # pixels per bin, with 0 before the first
        chosen = footprint[rows] & (buildings[rows] == truth)
        return np.concatenate([[0], np.cumsum(np.bincount(bins[rows][chosen], minlength=levels))])

    hits, misses = counts(train, True), counts(train, False)
    first, last = np.triu_indices(levels + 1, 1)  # the interval of bins first..last-1
    scores = (hits[last] - hits[first]) / (hits[-1] + misses[last] - misses[first])
    best = int(np.argmax(scores))
    low, high = first[best], last[best]
    predicted = (bins[val] >= low) & (bins[val] < high) & footprint[val]
    return iou(predicted, buildings[val] & footprint[val])


def data_overrides(root: Path) -> list[str]:
    return ["data.dataset=raster", f"data.root={root}", "data.scenes=[scene.tif]", "data.labels=[labels.tif]",
            "data.num_classes=2", "data.class_names=[ground,building]"]


def verify_lines(root: Path) -> tuple[list[str], str]:
    """The config lines verify_dataset prints for the scene, and the base config it advises."""
    result = subprocess.run([sys.executable, "-m", "syncseg", "verify", "--config", "demo.yaml", *data_overrides(root)],
                            capture_output=True, text=True, cwd=REPO, timeout=600)
    if result.returncode:
        raise RuntimeError(result.stdout + result.stderr)
    lines = result.stdout.splitlines()
    start = lines.index("config lines that read these scenes (valid pixels only):")
    config = [line.strip() for line in lines[start + 1:] if line.startswith("  data.")]
    base = next(line for line in lines if line.startswith("base config:")).split("`base: ")[1].split("`")[0]
    return config, base


def train(root: Path, config: str, lines: list[str], extra: list[str], run: Path) -> float:
    """train.py with `config` on the scene; the best validation building IoU in its metrics.jsonl."""
    subprocess.run([sys.executable, str(REPO / "train.py"), "--config", config, f"output_dir={run}", "--overwrite",
                    *data_overrides(root), *lines, *extra], check=True, cwd=REPO, timeout=3600,
                   stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return max(record["iou"].get("building", 0.0) for record in records if record.get("type") == "val")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", required=True, help="folder for the scene")
    parser.add_argument("--train", nargs="*", default=[], metavar="CONFIG", help="configs to train on it")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="after the configs' and verify's lines (before --train)")
    args = parser.parse_intermixed_args(argv)
    root = Path(args.root)
    write_scene(root)
    lines, base = verify_lines(root)
    baseline = threshold_baseline()
    print(f"verify_dataset: {' '.join(lines)}; advises base: {base}")
    print(f"per-pixel baseline (best grey-level interval): building IoU {baseline:.3f}")
    for config in args.train:
        score = train(root, config, lines, args.overrides, root / f"run_{Path(config).stem}")
        print(f"{config:<20} best val building IoU {score:.3f}  (baseline {baseline:.3f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
