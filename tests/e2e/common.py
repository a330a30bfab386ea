"""What the end-to-end tests share: the repository root and the base of their tiny demo-config runs."""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# a 32 px synthetic set of 16 images and a ResNet-18 DeepLab small enough for a few CPU steps; each test
# module adds the settings it is about
TINY_BASE = [
    "data.synthetic_image_size=32", "data.crop_size=32", "data.synthetic_train_size=16", "data.num_workers=0",
    "model.backbone=resnet18", "model.head_channels=16", "model.aspp_rates=1",
    "train.batch_size=4", "train.log_interval=1",
]


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of a run dir's metrics.jsonl, in order."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
