"""What users keep and share: best.pt of the demo model is the weights (about a third of last.pt, which
adds AdamW's two moments and the RNG state), and best.pt and last.pt both load in eval.py, predict.py,
`python -m syncseg export` and model.init_checkpoint."""
from __future__ import annotations

import importlib
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from syncseg.engine.checkpoint_file import WEIGHTS_KEYS, load_checkpoint
from syncseg.engine.config import load_config
from syncseg.engine.distributed import DistInfo
from syncseg.engine.trainer import Trainer

# the demo model (configs/demo.yaml: DeepLabV3+ / ResNet-18, head 96, AdamW) on tiny data
TINY_DATA = ["data.synthetic_image_size=32", "data.crop_size=32", "data.synthetic_train_size=8",
             "data.synthetic_val_size=4", "data.num_workers=0", "train.batch_size=4", "eval.batch_size=4",
             "train.iters=2", "train.val_interval=2", "train.ckpt_interval=2", "train.log_interval=1",
             "train.num_vis_images=1"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("demo")
    config = load_config("demo.yaml", [f"output_dir={run_dir}", *TINY_DATA])
    trainer = Trainer.from_config(config, DistInfo(), progress=False, run_id="run-1")
    try:
        result = trainer.fit()
    finally:
        trainer.close()
    return run_dir, result


def _tensor_bytes(state) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in state.values())


@pytest.mark.slow
def test_best_pt_holds_the_weights_and_metrics_only(demo_run):
    run_dir, result = demo_run
    best, last = load_checkpoint(run_dir / "best.pt"), load_checkpoint(run_dir / "last.pt")
    # label_ids: only a run on an export with numeric label ids (COCO, YOLO) has them
    assert set(best) == (set(WEIGHTS_KEYS) - {"label_ids"}) | {"metrics"}
    assert {"optimizer", "scheduler", "scaler", "rng", "overrides"} <= set(last)  # resume state stays in last.pt
    assert best["run_id"] == "run-1" and best["iteration"] == 2 and best["best_miou"] == result.best_miou
    assert best["metrics"]["miou"] == result.best_miou and best["metrics"]["num_images"] == 4
    assert all(torch.equal(best["model"][k], v) for k, v in last["model"].items())  # same weights
    best_size, last_size = (run_dir / "best.pt").stat().st_size, (run_dir / "last.pt").stat().st_size
    weights = _tensor_bytes(best["model"])
    # last.pt = weights + AdamW's exp_avg and exp_avg_sq (each as large) + RNG: best.pt is a third of it,
    # plus the BatchNorm buffers (which have no optimizer state) and the archive's per-tensor records
    assert best_size <= weights * 1.005 + 64 * 1024
    assert best_size < 0.34 * last_size, (best_size, last_size)
    buffer = io.BytesIO()
    torch.save(best["metrics"], buffer)
    assert buffer.tell() < 4096  # the metrics cost nothing


@pytest.mark.slow
@pytest.mark.parametrize("name", ["best.pt", "last.pt"])
def test_both_checkpoints_load_in_eval_predict_export_and_init_checkpoint(demo_run, name, tmp_path, capsys):
    run_dir, result = demo_run
    checkpoint = run_dir / name
    evaluate = importlib.import_module("syncseg.commands.eval")
    output = tmp_path / "metrics.json"
    assert evaluate.main(["--checkpoint", str(checkpoint), "--device", "cpu", "--no-progress", "--output",
                          str(output)]) == 0
    assert json.loads(output.read_text())["miou"] == pytest.approx(result.last_val["miou"], abs=1e-12)

    Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 40, 3), dtype=np.uint8)).save(tmp_path / "x.png")
    predict = importlib.import_module("syncseg.commands.predict")
    assert predict.main(["--checkpoint", str(checkpoint), "--input", str(tmp_path / "x.png"), "--output",
                         str(tmp_path / "pred"), "--device", "cpu"]) == 0
    assert Image.open(tmp_path / "pred" / "x_mask.png").size == (40, 32)

    export = importlib.import_module("syncseg.commands.export")
    assert export.main(["--checkpoint", str(checkpoint), "--format", "torchscript", "--output",
                        str(tmp_path / "model.torchscript.pt")]) == 0

    config = load_config("demo.yaml", [f"output_dir={tmp_path / 'tuned'}", *TINY_DATA, f"model.init_checkpoint={checkpoint}"])
    tuned = Trainer.from_config(config, DistInfo(), progress=False)
    try:
        saved = load_checkpoint(checkpoint)["model"]
        assert all(torch.equal(tuned.model.state_dict()[k], v) for k, v in saved.items())
    finally:
        tuned.close()
    capsys.readouterr()


@pytest.mark.slow
def test_resuming_from_best_pt_points_at_last_pt(demo_run, capsys):
    run_dir, _ = demo_run
    train = importlib.import_module("syncseg.commands.train")
    assert train.main(["--resume", str(run_dir / "best.pt"), "train.iters=3"]) == 2
    error = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(error) == 1 and "weights only" in error[0] and "last.pt" in error[0]
