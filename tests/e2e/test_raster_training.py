"""train.py on a georeferenced scene: the chips of a resumed run are the uninterrupted run's, whatever the worker
count, and a corrupt scene is refused with one line before the run dir is touched."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("rasterio")
pytest.importorskip("fiona")

from tests.e2e.common import ROOT  # noqa: E402
from tests.e2e.test_train_e2e import straight_and_resumed  # noqa: E402
from tests.rasters import raster_overrides, write_polygons, write_scene  # noqa: E402

TINY = ["model.backbone=resnet18", "model.head_channels=16", "model.aspp_rates=1", "model.aux_loss=false",
        "train.batch_size=4", "train.log_interval=1", "train.lr=0.001", "train.warmup_iters=2", "train.iters=6",
        "train.val_interval=100", "train.ckpt_interval=100", "data.num_workers=0", "data.chips_per_epoch=12"]


@pytest.mark.slow
def test_a_resumed_scene_run_reproduces_the_uninterrupted_losses(tmp_path):
    written = write_scene(tmp_path / "data", size=(160, 200))
    polygons = write_polygons(tmp_path / "data" / "buildings.geojson", written, crs="EPSG:4326")
    common = ["--config", "demo.yaml", *TINY,
              *raster_overrides(tmp_path / "data", [written.image.name], [polygons.name], crop=32)]
    expected, resumed, _ = straight_and_resumed(tmp_path, common, stop_at=2)
    assert sorted(expected) == sorted(resumed) == list(range(1, 7))
    for iteration in range(1, 7):
        assert resumed[iteration] == pytest.approx(expected[iteration], abs=1e-6, rel=0), iteration
    assert len(set(expected.values())) > 1


def test_a_corrupt_scene_is_one_line_and_exit_2(tmp_path):
    written = write_scene(tmp_path / "data", size=(96, 96))
    written.image.write_bytes(written.image.read_bytes()[:200])
    run = tmp_path / "run"
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", "demo.yaml", f"output_dir={run}",
                             *TINY, *raster_overrides(tmp_path / "data", [written.image.name],
                                                      [written.labels.name], crop=32)],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"cannot read raster '{written.image}'" in errors[0]
    assert not (run / "last.pt").exists()
