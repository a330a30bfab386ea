"""benchmarks/bench_train.py runs to its record at tiny shapes. What it times is `make bench`'s business; that it
runs at all is this test's: its bare loop fed the training loader's uint8 masks to cross-entropy (they are widened
on the device, as Trainer.train_step does), and `make bench` stopped there, which no test noticed."""
from __future__ import annotations

import json
import math

from benchmarks import bench_train

TINY = ["data.synthetic_image_size=32", "data.crop_size=32", "data.synthetic_train_size=8", "data.synthetic_val_size=2",
        "data.num_workers=0", "model.backbone=resnet18", "model.head_channels=8", "model.aspp_rates=1",
        "model.channels_last=false", "train.batch_size=2", "train.amp=off"]
VARIANTS = ("full_s_per_iter", "bare_s_per_iter", "bare_copy_s_per_iter", "train_step_s_per_iter")


def test_every_variant_trains_in_every_round_and_the_record_holds_the_target(tmp_path):
    output = tmp_path / "bench_train.json"
    # --threads 0: this process's torch threads as they are (the benchmark sets 1 by default)
    assert bench_train.main(["--rounds", "4", "--iters", "1", "--warmup", "1", "--threads", "0",
                             "--output", str(output), *TINY]) == 0
    record = json.loads(output.read_text())
    assert [row["round"] for row in record["rounds"]] == [0, 1, 2, 3]
    for row in record["rounds"]:
        assert all(math.isfinite(row[key]) and row[key] > 0 for key in VARIANTS), row
    [target] = record["targets"]
    assert target["target"] == "train full/bare loop" and target["figure"]["pairs"] == 4
