"""Torchrun (gloo, CPU) training over 2 processes equals one process on the same global batch. (Three
processes sharing a global batch of 8 unevenly, 3 + 3 + 2: test_elastic_resume's middle leg, which also
compares every step with one process in float64.)

This is what synchronized BatchNorm buys: with `model.norm=syncbn` the processes normalize with the
statistics of the whole global batch, so their losses match the single process's; with plain `bn`
(per-process statistics) they do not, which the negative control checks at step 1.

The comparisons run in float64 (tests/float64.py says why): the runs agree to ~1e-14 there, where float32
runs of this test differed by 2e-6 on one CPU and 6e-3 on another.

Run as a module (by the tests, under torchrun or alone), this file trains with dropout disabled (its
masks cannot match between 1 and 2 processes) and writes the per-step losses as JSON.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.common import ROOT, TINY_BASE

TINY = [*TINY_BASE, "data.scale_range=0.75,1.25", "data.synthetic_val_size=6", "model.channels_last=false",
        "train.warmup_iters=1", "train.amp=off", "train.iters=4", "train.optimizer=sgd", "train.lr=0.01",
        "train.head_lr_mult=10", "train.val_interval=4", "train.ckpt_interval=100", "eval.batch_size=2"]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


TOLERANCE = 1e-6  # float64 runs of different splits agree to ~1e-13; a float32 run would miss by ~1e-3


def _train(tmp_path: Path, name: str, *, processes: int, norm: str, extra: tuple[str, ...] = (),
           float64: bool = True) -> tuple[dict, str]:
    output = tmp_path / f"{name}.json"
    arguments = [*(["--float64"] if float64 else []), str(output), f"output_dir={tmp_path / name}",
                 f"model.norm={norm}", *TINY, *extra]
    if processes > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
                   "--module", "tests.e2e.test_train_ddp", *arguments]
    else:
        command = [sys.executable, "-m", "tests.e2e.test_train_ddp", *arguments]
    process = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert process.returncode == 0, process.stderr[-4000:]
    result = json.loads(output.read_text())
    return result, process.stderr


@pytest.mark.slow
def test_two_process_ddp_matches_single_process_with_sync_bn(tmp_path):
    single, _ = _train(tmp_path, "single", processes=1, norm="syncbn")
    ddp, log = _train(tmp_path, "ddp", processes=2, norm="syncbn")
    assert "DDP over 2 processes" in log and "per-device batch 2" in log
    assert "across the processes through torch.distributed" in log
    assert sorted(ddp["losses"]) == sorted(single["losses"]) == ["1", "2", "3", "4"]
    for step in single["losses"]:
        assert ddp["losses"][step] == pytest.approx(single["losses"][step], abs=TOLERANCE, rel=0), step
    assert len(set(single["losses"].values())) > 1
    # validation is sharded over the processes without padding and the confusion matrix all-reduced
    assert ddp["val"]["num_images"] == single["val"]["num_images"] == 6
    assert ddp["val"]["miou"] == pytest.approx(single["val"]["miou"], abs=1e-9)

    # negative control: per-process BN statistics normalize differently from the first forward on
    unsynced, log = _train(tmp_path, "ddp_bn", processes=2, norm="bn")
    assert "not synchronized" in log
    assert abs(unsynced["losses"]["1"] - single["losses"]["1"]) > 1000 * TOLERANCE


def main(argv: list[str]) -> int:
    """Run as `python -m tests.e2e.test_train_ddp [--float64] OUTPUT KEY=VALUE...` from the repository root."""
    import logging

    import torch
    from torch import nn

    from syncseg.engine.config import load_config
    from syncseg.engine.distributed import cleanup, setup_distributed
    from syncseg.engine.trainer import Trainer
    from tests.float64 import trainers_in_float64

    float64 = argv[0] == "--float64"
    output, overrides = Path(argv[1 if float64 else 0]), argv[2 if float64 else 1:]
    info = setup_distributed(None if "WORLD_SIZE" in os.environ else "cpu")
    logging.basicConfig(level=logging.INFO if info.is_main else logging.WARNING)
    config = load_config("demo.yaml", overrides)
    with trainers_in_float64() if float64 else contextlib.nullcontext():
        trainer = Trainer.from_config(config, info, progress=False)
    for module in trainer.model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    result = trainer.fit()
    expected = torch.float64 if float64 else torch.float32
    assert all(parameter.dtype == expected for parameter in trainer.model.parameters())
    if info.is_main:
        val = {k: result.last_val[k] for k in ("miou", "num_images")} if result.last_val else None
        output.write_text(json.dumps({"losses": {str(k): v for k, v in result.losses.items()}, "val": val}))
    cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
