"""metrics.jsonl / TensorBoard bookkeeping and the helpers that format what a run reports."""
from __future__ import annotations

import json

import numpy as np

from engine.run_log import MetricsLog, flat_numbers, format_seconds, image_grid


def test_metrics_log_restarts_for_a_fresh_run_and_trims_for_a_resume(tmp_path):
    lines = [{"type": "train", "iteration": i, "loss": float(i)} for i in (1, 2, 3, 4)]
    path = tmp_path / "metrics.jsonl"

    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    log = MetricsLog(tmp_path, enabled=True, resume_iteration=2)  # resumed from a checkpoint at 2
    log.scalars({"loss": 9.0}, step=3, prefix="train")
    log.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["iteration"], r["loss"]) for r in records] == [(1, 1.0), (2, 2.0), (3, 9.0)]

    log = MetricsLog(tmp_path, enabled=True)  # a fresh run in the same directory
    log.scalars({"loss": 5.0, "lr": {"head": 0.1}}, step=1, prefix="train")
    log.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records == [{"type": "train", "iteration": 1, "loss": 5.0, "lr": {"head": 0.1}}]


def test_flat_numbers_keeps_numbers_only_with_nested_names():
    record = {"loss": 1.5, "lr": {"head": 0.1, "backbone": 0.01}, "note": "x", "flag": True, "none": None, "n": 3}
    assert dict(flat_numbers(record)) == {"loss": 1.5, "lr/head": 0.1, "lr/backbone": 0.01, "n": 3.0}


def test_format_seconds():
    assert format_seconds(59.9) == "0m59s" and format_seconds(61) == "1m01s" and format_seconds(3 * 3600 + 120) == "3h02m"
    assert format_seconds(-5) == "0m00s"


def test_image_grid_pads_short_rows_black():
    wide = [np.full((2, 3, 3), 7, np.uint8), np.full((2, 3, 3), 9, np.uint8)]
    short = [np.full((2, 4, 3), 5, np.uint8)]
    grid = image_grid([wide, short])
    assert grid.shape == (4, 6, 3)
    assert (grid[:2, :3] == 7).all() and (grid[:2, 3:] == 9).all()
    assert (grid[2:, :4] == 5).all() and (grid[2:, 4:] == 0).all()
