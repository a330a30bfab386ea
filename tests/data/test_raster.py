"""data.dataset=raster: chips read as windows of generated GeoTIFFs, labels as rasters and as polygons in
another CRS, nodata as the ignore label, the validation region, and one line for each kind of bad input."""
from __future__ import annotations

import logging

import numpy as np
import pytest

rasterio = pytest.importorskip("rasterio")
pytest.importorskip("fiona")

from syncseg.data.raster.dataset import RasterSegmentation  # noqa: E402
from syncseg.data.raster.scenes import RasterError  # noqa: E402
from syncseg.data.registry import build_dataset  # noqa: E402
from syncseg.engine.config import load_config  # noqa: E402
from tests.rasters import raster_overrides, write_polygons, write_scene  # noqa: E402

IGNORE = 255


def dataset(written, split="train", **options):
    settings = {"num_classes": 2, "class_names": ("ground", "building"), "crop_size": 48, "chips_per_epoch": 40,
                "channels": 1, "max_value": 65535}
    settings.update(options)
    labels = settings.pop("labels", [written.labels])
    return RasterSegmentation([written.image], labels, split, **settings)


@pytest.mark.parametrize("bands, dtype", [(1, "uint16"), (6, "uint16"), (13, "float32")])
def test_chips_are_the_raster_windows_with_nodata_ignored(tmp_path, bands, dtype):
    written = write_scene(tmp_path, bands=bands, dtype=dtype)
    scale = 1000.0 if dtype == "float32" else 0.0
    data = dataset(written, channels=bands, raster_scale=scale)
    with rasterio.open(written.image) as source:
        for index in range(8):
            image, labels = data.load(index)
            scene_index, chip = data.window(index)
            stored = source.read(window=chip.rasterio())
            expected = np.clip(np.rint(stored * scale), 0, 65535) if scale else stored
            valid = source.dataset_mask(window=chip.rasterio()) > 0
            assert image.dtype == np.uint16 and image.shape == (chip.height, chip.width, bands)
            np.testing.assert_array_equal(image.transpose(2, 0, 1)[:, valid], expected[:, valid].astype(np.uint16))
            truth = written.truth[chip.top:chip.bottom, chip.left:chip.right]
            np.testing.assert_array_equal(labels, np.where(valid, truth, IGNORE))
    assert any((data.load(i)[1] == IGNORE).any() for i in range(len(data)))  # the frame is met, as ignore


def test_training_chips_stay_outside_the_validation_region_and_repeat_by_index(tmp_path):
    written = write_scene(tmp_path)
    box = "500020,4199920,500060,4199960"  # x 40..120 px, y 80..160 px (0.5 m pixels from the origin)
    train, again = dataset(written, val_region=box), dataset(written, val_region=box)
    region = train.val[0]
    assert [(w.top, w.left, w.height, w.width) for w in region] == [(80, 40, 80, 80)]
    chips = [train.window(i)[1] for i in range(len(train))]
    assert chips == [again.window(i)[1] for i in range(len(again))]  # the chip is the index's (resumable)
    assert len(set(chips)) > 30 and not any(chip.intersects(region[0]) for chip in chips)
    val = dataset(written, "val", val_region=box)
    covered = np.zeros(written.truth.shape, bool)
    for _, chip in val.chips:
        covered[chip.top:chip.bottom, chip.left:chip.right] = True
        assert (chip.height, chip.width) == (48, 48)
    assert covered[80:160, 40:120].all()
    assert len(val) == 4 and val[0][0].shape == (1, 48, 48)


def test_without_a_region_the_bottom_fifth_validates_and_nodata_chips_are_skipped(tmp_path, caplog):
    written = write_scene(tmp_path, size=(200, 240), frame=40)
    assert [(w.top, w.left, w.height, w.width) for w in dataset(written).val[0]] == [(160, 0, 40, 240)]
    caplog.set_level(logging.INFO)
    corner = "500000,4199960,500040,4200000"  # pixels 0..80 a side: three of its chips are all frame
    val = dataset(written, "val", crop_size=40, val_region=corner)
    assert [(chip.top, chip.left) for _, chip in val.chips] == [(40, 40)]
    assert "(3 of 4 chips skipped: all nodata)" in val.description
    train = dataset(written, crop_size=40, scale_low=1.0, chips_per_epoch=200)
    assert all(train.readers[0].valid(train.window(i)[1]).any() for i in range(len(train)))
    assert train.num_skipped > 0  # the frame is a third of the scene: some draws met only nodata


def test_polygons_in_another_crs_are_reprojected_onto_the_grid(tmp_path, caplog):
    written = write_scene(tmp_path)
    polygons = write_polygons(tmp_path / "buildings.geojson", written, crs="EPSG:4326")
    caplog.set_level(logging.WARNING)
    data = dataset(written, labels=[polygons])
    agree = []
    for index in range(10):
        _, labels = data.load(index)
        _, chip = data.window(index)
        truth = written.truth[chip.top:chip.bottom, chip.left:chip.right]
        valid = labels != IGNORE
        agree.append((labels[valid] == truth[valid]).mean())
    assert min(agree) > 0.97  # the squares' edges move by a pixel at most through WGS84 and back
    assert sum("reprojected to the scene's CRS" in r.message for r in caplog.records) == 1


def test_sparse_polygons_leave_the_rest_ignored(tmp_path):
    written = write_scene(tmp_path)
    polygons = write_polygons(tmp_path / "some.geojson", written, only=3, value="building")
    data = dataset(written, labels=[polygons], uncovered="ignore", split="all")
    labels = np.concatenate([data.load(i)[1].ravel() for i in range(len(data))])
    assert set(np.unique(labels)) == {1, IGNORE}


def test_a_label_raster_in_another_crs_is_warped(tmp_path, caplog):
    written = write_scene(tmp_path)
    from rasterio.warp import calculate_default_transform, reproject

    with rasterio.open(written.labels) as source:
        transform, width, height = calculate_default_transform(source.crs, "EPSG:3857", source.width, source.height,
                                                               *source.bounds)
        target = np.full((height, width), IGNORE, np.uint8)
        reproject(source.read(1), target, src_transform=source.transform, src_crs=source.crs,
                  dst_transform=transform, dst_crs="EPSG:3857", resampling=rasterio.enums.Resampling.nearest)
    warped = tmp_path / "labels_3857.tif"
    with rasterio.open(warped, "w", driver="GTiff", width=width, height=height, count=1, dtype="uint8",
                       crs="EPSG:3857", transform=transform, nodata=IGNORE) as sink:
        sink.write(target[None])
    caplog.set_level(logging.WARNING)
    data = dataset(written, labels=[warped], split="all")
    labels = np.zeros_like(written.truth)
    for index in range(len(data)):
        _, chip = data.window(index)
        labels[chip.top:chip.bottom, chip.left:chip.right] = data.load(index)[1]
    inner = slice(written.frame, -written.frame)
    assert (labels[inner, inner] == written.truth[inner, inner]).mean() > 0.97
    assert any("resampled onto it" in r.message for r in caplog.records)


def test_through_the_config(tmp_path):
    written = write_scene(tmp_path, bands=6)
    config = load_config("demo.yaml", raster_overrides(tmp_path, [written.image.name], [written.labels.name], bands=6,
                                                       extra=("data.chips_per_epoch=16",)))
    train = build_dataset(config.data, "train", train=True, compact_masks=True)
    image, mask = train[3]
    assert tuple(image.shape) == (6, 48, 48) and mask.dtype.is_floating_point is False and len(train) == 16
    with pytest.raises(ValueError, match="data.scenes is set but it is read by dataset 'raster'"):
        load_config("demo.yaml", ["data.scenes=[a.tif]"])
    with pytest.raises(ValueError, match="needs data.labels"):
        load_config("demo.yaml", raster_overrides(tmp_path, ["a.tif"], [])[:3] + raster_overrides(
            tmp_path, ["a.tif"], [])[4:])


def test_a_raster_without_crs_is_said_once(tmp_path, caplog):
    written = write_scene(tmp_path, crs=None)
    caplog.set_level(logging.WARNING)
    dataset(written), dataset(written, "val")
    assert sum("has no CRS" in r.message for r in caplog.records) <= 1
    assert len(dataset(written, "val")) > 0


def bad_inputs(tmp_path):
    written = write_scene(tmp_path)
    six = write_scene(tmp_path, "six", bands=6)
    corrupt = tmp_path / "corrupt.tif"
    corrupt.write_bytes(written.image.read_bytes()[:300])
    far = write_polygons(tmp_path / "far.geojson", written)
    far.write_text(far.read_text().replace("4199", "3199"))  # 1000 km south
    unnamed = write_polygons(tmp_path / "unnamed.geojson", written, attribute="kind")
    wrong = write_polygons(tmp_path / "wrong.geojson", written, value="roof")
    return {
        "bands": (lambda: RasterSegmentation([written.image, six.image], [written.labels, six.labels], "train",
                                             num_classes=2, channels=1, max_value=65535, crop_size=48),
                  "six.tif' has 6 bands but"),
        "corrupt": (lambda: dataset(written, labels=[written.labels]).__class__([corrupt], [written.labels], "train",
                                                                                num_classes=2, channels=1,
                                                                                max_value=65535), "corrupt.tif"),
        "small": (lambda: dataset(written, crop_size=512), "smaller than one chip of data.crop_size=512x512"),
        "far": (lambda: dataset(written, labels=[far]), "far.geojson': none of its 24 features overlaps"),
        "attribute": (lambda: dataset(written, labels=[unnamed]), "unnamed.geojson': feature 0 has no 'class'"),
        "value": (lambda: dataset(written, labels=[wrong]), "wrong.geojson': feature 0 has class='roof'"),
        "region": (lambda: dataset(written, "val", val_region="0,0,10,10"), "does not overlap any scene"),
        "8bit": (lambda: dataset(written, max_value=255), "is 16-bit (uint16) but data.max_value=255"),
        "channels": (lambda: dataset(written, channels=3), "has 1 band(s) but data.in_channels=3"),
        "float": (lambda: dataset(write_scene(tmp_path, "f", dtype="float32")), "set data.raster_scale"),
    }


@pytest.mark.parametrize("case", ["bands", "corrupt", "small", "far", "attribute", "value", "region", "8bit",
                                  "channels", "float"])
def test_bad_input_is_one_line_naming_the_file_or_value(tmp_path, case):
    build, expected = bad_inputs(tmp_path)[case]
    with pytest.raises(RasterError) as caught:
        build()
    assert expected in str(caught.value) and "\n" not in str(caught.value)
