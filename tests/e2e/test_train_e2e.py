"""End-to-end training on CPU with tiny synthetic data: artifacts, eval.py agreement, exact resume,
non-finite losses and command-line errors (signals: tests/e2e/test_cluster.py)."""
from __future__ import annotations

import importlib
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.e2e.common import ROOT, TINY_BASE, read_metrics
from tests.gloo import plain_environment, run_module_ranks

TINY = [*TINY_BASE, "data.scale_range=0.9,1.1", "data.synthetic_val_size=4", "model.aux_loss=false", "train.lr=0.001",
        "train.warmup_iters=2", "eval.batch_size=4"]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def run_train(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python train.py ARGS` as a command."""
    process = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=_env(),
                             capture_output=True, text=True, timeout=timeout)
    if check and process.returncode != 0:
        raise AssertionError(f"train.py exited {process.returncode}:\n{process.stderr[-3000:]}")
    return process


def train_forked(log: Path, *args: str) -> None:
    """What `python train.py ARGS` does, but in a process forked from the forkserver, where torch, torchvision
    and the trainer are imported already (tests.gloo.run_module_ranks; ~4.5 CPU-s a run less); fails with
    the end of its output (in `log`) on a non-zero exit status. The command itself: trained_run."""
    from syncseg.commands.train import main

    run_module_ranks(main, list(args), [plain_environment()], [log])


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["iteration"]: r["loss"] for r in read_metrics(run_dir) if r["type"] == "train"}


def straight_and_resumed(tmp_path: Path, common: list[str], *, stop_at: int) -> tuple[dict, dict, Path]:
    """`train.py COMMON` straight through, and again stopped at `stop_at` (its last.pt checked) then resumed with
    --resume auto and another worker count (augmentation is seeded per sample, not per worker): the train losses
    of each, and the resumed run's dir."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    train_forked(tmp_path / "straight.log", *common, f"output_dir={straight}")
    train_forked(tmp_path / "split.log", *common, f"output_dir={split}", "--stop-at", str(stop_at))
    assert torch.load(split / "last.pt", map_location="cpu", weights_only=True)["iteration"] == stop_at
    train_forked(tmp_path / "resumed.log", *common, f"output_dir={split}", "--resume", "auto", "data.num_workers=1")
    return train_losses(straight), train_losses(split), split


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """One 4-iteration run (validation and checkpoints every 2 iterations) that the tests below inspect."""
    run_dir = tmp_path_factory.mktemp("e2e") / "run"
    run_train("--config", "demo.yaml", f"output_dir={run_dir}", *TINY, "train.iters=4", "train.val_interval=2",
              "train.ckpt_interval=2", "train.num_vis_images=2")
    return run_dir


def _validations(run_dir: Path) -> dict[int, dict]:
    return {r["iteration"]: r for r in read_metrics(run_dir) if r["type"] == "val"}


@pytest.mark.slow
def test_run_dir_holds_the_checkpoints_config_and_metrics_log(trained_run):
    from syncseg.engine.checkpoint_file import load_checkpoint

    for name in ("last.pt", "best.pt", "config.yaml", "metrics.jsonl"):
        assert (trained_run / name).is_file(), name
    last = load_checkpoint(trained_run / "last.pt")  # weights_only=True inside
    best = load_checkpoint(trained_run / "best.pt")
    assert last["iteration"] == 4 and best["iteration"] in (2, 4)
    assert not any(key.startswith("module.") for key in last["model"])
    assert last["classes"] == best["classes"] and len(last["classes"]) == 6


@pytest.mark.slow
def test_best_checkpoint_holds_the_best_validation(trained_run):
    from syncseg.engine.checkpoint_file import load_checkpoint

    best = load_checkpoint(trained_run / "best.pt")
    val = _validations(trained_run)
    assert sorted(val) == [2, 4]
    assert best["best_miou"] == pytest.approx(max(v["miou"] for v in val.values()))
    assert best["metrics"]["miou"] == pytest.approx(val[best["iteration"]]["miou"], abs=1e-12)
    assert "optimizer" not in best and "rng" not in best  # the file to share holds weights, not training state


@pytest.mark.slow
def test_metrics_log_has_every_step_and_the_rate_each_step_used(trained_run):
    from syncseg.engine.optim import poly_warmup_factor

    records = [r for r in read_metrics(trained_run) if r["type"] == "train"]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    for record in records:
        factor = poly_warmup_factor(record["iteration"] - 1, total_iters=4, power=0.9, warmup_iters=2)
        assert record["lr"]["backbone"] == pytest.approx(1e-3 * factor, rel=1e-9)
        assert record["lr"]["head"] == pytest.approx(1e-3 * factor, rel=1e-9)  # demo: head_lr_mult 1
    assert all(v["num_images"] == 4 for v in _validations(trained_run).values())


@pytest.mark.slow
def test_tensorboard_events_sit_in_the_run_dir_with_scalars_summary_and_grid(trained_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # the events are in the run dir: `tensorboard --logdir <parent>` names the run after its folder
    assert list(trained_run.glob("events.out.tfevents.*")) and not (trained_run / "tensorboard").exists()
    events = EventAccumulator(str(trained_run), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    for tag in ("train/loss", "train/lr/backbone", "train/lr/head", "train/images_per_s",
                "train/data_wait_fraction", "train/peak_memory_mb", "val/miou", "val/pixel_acc"):
        assert tag in scalars, (tag, sorted(scalars))
    assert any(tag.startswith("val/iou/") for tag in scalars)
    assert "val/num_images" not in scalars  # constant over a run: metrics.jsonl only
    assert "val/summary/text_summary" in events.Tags()["tensors"]
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
    logged = {e.step: e.value for e in events.Scalars("val/miou")}
    assert logged[2] == pytest.approx(_validations(trained_run)[2]["miou"], rel=1e-6)
    image = events.Images("val/image_truth_prediction")[-1]
    # image | truth | prediction, 2 rows of 32 px panels enlarged 4x, under titles and above a legend
    assert image.width == 3 * 128 + 2 * 2 and image.height > 2 * 128 + 2 + 40


@pytest.mark.slow
def test_eval_cli_on_best_checkpoint_reproduces_the_validation_miou(trained_run, tmp_path):
    from syncseg.engine.checkpoint_file import load_checkpoint

    output = tmp_path / "eval.json"
    process = subprocess.run(
        [sys.executable, str(ROOT / "eval.py"), "--checkpoint", str(trained_run / "best.pt"), "--device", "cpu",
         "--no-progress", "--output", str(output)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, process.stderr[-3000:]
    best_iteration = load_checkpoint(trained_run / "best.pt")["iteration"]
    assert json.loads(output.read_text())["miou"] == pytest.approx(_validations(trained_run)[best_iteration]["miou"],
                                                                   abs=1e-9)


@pytest.mark.slow
def test_resumed_run_reproduces_uninterrupted_losses(tmp_path):
    common = ["--config", "demo.yaml", *TINY, "train.iters=8", "train.val_interval=100", "train.ckpt_interval=100"]
    expected, resumed, split = straight_and_resumed(tmp_path, common, stop_at=3)
    assert sorted(expected) == list(range(1, 9)) and sorted(resumed) == list(range(1, 9))
    for iteration in range(1, 9):
        assert resumed[iteration] == pytest.approx(expected[iteration], abs=1e-6, rel=0), iteration
    assert len(set(expected.values())) > 1  # losses move: the comparison is not vacuous

    # a larger train.iters extends the finished run
    train_forked(tmp_path / "extended.log", "--config", "demo.yaml", f"output_dir={split}", "--resume", "auto",
                 "train.iters=10")
    assert torch.load(split / "last.pt", map_location="cpu", weights_only=True)["iteration"] == 10
    assert sorted(train_losses(split)) == list(range(1, 11))


@pytest.mark.slow
def test_non_finite_loss_stops_with_iteration_and_keeps_last_checkpoint(tmp_path, monkeypatch):
    from syncseg.engine.config import load_config
    from syncseg.engine.distributed import DistInfo
    from syncseg.engine.trainer import Trainer

    run_dir = tmp_path / "run"
    config = load_config("demo.yaml", [f"output_dir={run_dir}", *TINY, "train.iters=6", "train.ckpt_interval=1",
                                       "train.log_interval=5", "train.val_interval=100", "train.amp=off"])
    trainer = Trainer.from_config(config, DistInfo(), progress=False)
    original = trainer.parts.criterion.head_terms

    def poisoned(logits, target):
        return {name: (loss_sum * float("nan") if trainer.iteration == 3 else loss_sum, weight)
                for name, (loss_sum, weight) in original(logits, target).items()}

    monkeypatch.setattr(trainer.parts.criterion, "head_terms", poisoned)
    with pytest.raises(FloatingPointError, match="iteration 4"):
        trainer.fit()
    checkpoint = torch.load(run_dir / "last.pt", map_location="cpu", weights_only=True)
    assert checkpoint["iteration"] == 3
    assert all(torch.isfinite(v).all() for v in checkpoint["model"].values() if v.is_floating_point())


@pytest.mark.parametrize("args,fragment", [
    (["--config", "demo.yaml", "train.iter=5"], "train.iters"),
    (["--config", "voc.yaml", "data.root=/nonexistent/VOCdevkit/VOC2012"], "/nonexistent/VOCdevkit/VOC2012"),
    (["--config", "demo.yaml", "--gpus", "zero"], "'zero' is not a GPU id"),
    (["--config", "demo.yaml", "--gpus", "99"], "99"),
    (["--config", "no_such_config.yaml"], "no_such_config.yaml"),
])
def test_bad_command_lines_exit_nonzero_with_one_line_reason(args, fragment, tmp_path, capsys):
    train = importlib.import_module("syncseg.commands.train")
    code = train.main([*args, f"output_dir={tmp_path / 'run'}"])
    stderr = capsys.readouterr().err
    assert code == 2, stderr[-2000:]
    error_lines = [line for line in stderr.splitlines() if "error" in line.lower()]
    assert len(error_lines) == 1, stderr[-2000:]
    assert re.match(r"\d\d:\d\d:\d\d train\.py: error: ", error_lines[0]) and fragment in error_lines[0]
    assert not (tmp_path / "run" / "last.pt").exists()


@pytest.mark.slow
def test_init_checkpoint_fine_tunes_with_a_new_class_count(tmp_path, caplog):
    from syncseg.engine.config import load_config
    from syncseg.engine.distributed import DistInfo
    from syncseg.engine.trainer import Trainer

    source = tmp_path / "source"
    config = load_config("demo.yaml", [f"output_dir={source}", *TINY, "train.iters=1", "train.val_interval=100"])
    Trainer.from_config(config, DistInfo(), progress=False).fit()
    saved = torch.load(source / "last.pt", map_location="cpu", weights_only=True)["model"]

    config = load_config("demo.yaml", [f"output_dir={tmp_path / 'tuned'}", *TINY, "train.iters=1",
                                       f"model.init_checkpoint={source / 'last.pt'}", "data.num_classes=4"])
    with caplog.at_level("INFO"):
        trainer = Trainer.from_config(config, DistInfo(), progress=False)
    state = trainer.model.state_dict()
    differing = [k for k in saved if saved[k].shape != state[k].shape]
    assert differing and all(k.startswith("classifier") for k in differing)
    assert all(torch.equal(saved[k], state[k]) for k in saved if k not in differing)
    assert any("skipped" in record.getMessage() for record in caplog.records)


@pytest.mark.slow
def test_fine_tuning_from_torchvision_deeplabv3_weights_loads_all_but_the_classifier(tmp_path, caplog, capsys):
    """The issue's acceptance check: a torchvision-style state dict (21 VOC classes) fine-tunes on the
    6-class synthetic set; only the classifier's last conv stays fresh, and another backbone is one line."""
    import torchvision

    from syncseg.engine.config import load_config
    from syncseg.engine.distributed import DistInfo
    from syncseg.engine.trainer import Trainer

    torch.manual_seed(0)
    reference = torchvision.models.segmentation.deeplabv3_resnet50(weights=None, weights_backbone=None, num_classes=21)
    state = reference.state_dict()
    path = tmp_path / "deeplabv3_resnet50_coco-cd0a2569.pth"  # torchvision's file name
    torch.save({f"module.{key}": value for key, value in state.items()}, path)  # as a DDP run would save it
    overrides = [f"output_dir={tmp_path / 'tuned'}", *TINY, "model.arch=deeplabv3", "model.backbone=resnet50",
                 "model.head_channels=256", "model.aspp_rates=12,24,36", "train.iters=2", "train.val_interval=2",
                 "train.batch_size=2",
                 f"model.init_checkpoint={path}"]
    with caplog.at_level("INFO", logger="syncseg.engine.build"):
        trainer = Trainer.from_config(load_config("demo.yaml", overrides), DistInfo(), progress=False)
    tuned = trainer.model.state_dict()
    assert len(trainer.parts.classes) == 6
    differing = {key for key in state if not torch.equal(state[key], tuned[key])}
    assert differing == {"classifier.4.weight", "classifier.4.bias"} and tuned["classifier.4.weight"].shape[0] == 6
    (record,) = [r.getMessage() for r in caplog.records if path.name in r.getMessage()]
    assert f"loaded {len(state) - 2} of the model's {len(state)} tensors" in record
    assert "skipped 2 of the file's" in record and "classifier.4.* (21 classes in the file, 6 in the model)" in record
    result = trainer.fit()
    trainer.close()
    assert sorted(result.losses) == [1, 2] and all(math.isfinite(v) for v in result.losses.values())

    train = importlib.import_module("syncseg.commands.train")
    code = train.main(["--config", "demo.yaml", f"output_dir={tmp_path / 'wrong'}", *TINY,
                       f"model.init_checkpoint={path}", "model.arch=deeplabv3"])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert code == 2 and len(errors) == 1, errors
    assert re.match(r"\d\d:\d\d:\d\d train\.py: error: model\.init_checkpoint", errors[0])
    assert "does not fit the model" in errors[0]
