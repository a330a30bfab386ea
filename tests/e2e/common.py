"""What the end-to-end tests share: the repository root, the base of their tiny demo-config runs, and train.py's
main in forked ranks."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

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


def train_forked(run_dir: Path, argv: Sequence[str], environments: list[dict[str, str]]) -> None:
    """`python train.py ARGV` as train's main in len(environments) processes forked from the forkserver
    (tests.gloo.run_module_ranks: torch and the trainer imported once, not ~4.5 CPU-s a process), rank r's
    output in <run_dir>.rank<r>.log beside `run_dir`; fails with a rank's log on a non-zero exit."""
    from syncseg.commands.train import main
    from tests.gloo import run_module_ranks

    run_module_ranks(main, list(argv), environments,
                     [run_dir.parent / f"{run_dir.name}.rank{rank}.log" for rank in range(len(environments))])
