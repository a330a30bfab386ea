"""eval.py end to end on tiny checkpoints it builds itself (synthetic shapes, fake Cityscapes)."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from syncseg.engine.checkpoint_file import FORMAT_VERSION, save_checkpoint
from syncseg.engine.config import load_config, to_dict
from tests.e2e.common import read_metrics
from tests.gloo import free_port, plain_environment, run_module_ranks, torchrun_environment

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.backbone=resnet18", "model.head_channels=8", "model.aspp_rates=1,2,3", "model.norm=bn",
        "data.synthetic_image_size=48", "data.synthetic_val_size=3", "data.num_workers=0"]


def _load_cli():
    return importlib.import_module("syncseg.commands.eval")


def _make_checkpoint(path: Path, overrides: list[str], *, seed: int = 0):
    """A randomly initialized model with non-trivial BN statistics, saved in the DESIGN format."""
    from syncseg.data import build_dataset
    from syncseg.model.builder import build_model

    config = load_config(None, overrides)
    dataset = build_dataset(config.data, config.data.val_split, train=False)
    torch.manual_seed(seed)
    model = build_model(config.model, dataset.num_classes)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.1, 0.1)
                module.running_var.uniform_(0.5, 1.5)
    save_checkpoint(path, {"format_version": FORMAT_VERSION, "model": model.state_dict(), "config": to_dict(config),
                           "classes": list(dataset.classes), "iteration": 11, "epoch": 0, "best_miou": 0.0})
    return config, dataset, model.eval()


def _reference_predictions(model, dataset, mean, std):
    """argmax of the model on each image, normalized in float64 independently of syncseg.data.transforms."""
    predictions, masks = [], []
    mean = torch.tensor(mean, dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(std, dtype=torch.float64).view(1, 3, 1, 1)
    with torch.no_grad():
        for index in range(len(dataset)):
            image, mask = dataset[index]
            inputs = ((image[None].double() / 255 - mean) / std).float()
            predictions.append(model(inputs)["out"].argmax(1)[0])
            masks.append(mask)
    return torch.stack(predictions), torch.stack(masks)


@pytest.fixture(scope="module")
def synthetic_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "best.pt"
    config, dataset, model = _make_checkpoint(path, TINY)
    return path, config, dataset, model


@pytest.mark.slow
def test_cli_end_to_end_matches_torchmetrics_and_saves_predictions(synthetic_checkpoint, tmp_path):
    from torchmetrics.classification import MulticlassJaccardIndex

    path, config, dataset, model = synthetic_checkpoint
    output, predictions_dir = tmp_path / "metrics.json", tmp_path / "pred"
    result = subprocess.run(
        [sys.executable, str(ROOT / "eval.py"), "--checkpoint", str(path), "--device", "cpu", "--no-progress",
         "--output", str(output), "--save-predictions", str(predictions_dir)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    record = json.loads(output.read_text())
    reference_pred, masks = _reference_predictions(model, dataset, config.data.mean, config.data.std)
    jaccard = MulticlassJaccardIndex(dataset.num_classes, average="macro", ignore_index=255)
    assert record["miou"] == pytest.approx(jaccard(reference_pred, masks).item(), abs=1e-6)
    assert record["num_images"] == 3 and record["split"] == "val" and record["iteration"] == 11
    assert record["protocol"] == {"mode": "whole", "window_size": None, "stride": None, "scales": [1.0],
                                  "flip": False, "base_size": 0, "amp": "off", "runtime": "torch",
                                  "exported": None, "ignore_index": 255}
    assert record["classes"] == list(dataset.classes)
    assert set(record["per_class"]) == set(dataset.classes)
    for name in dataset.classes:  # the printed table names every class
        assert name in result.stdout
    assert "mIoU" in result.stdout
    for index in range(len(dataset)):
        name = dataset.name_of(index)
        labels = np.array(Image.open(predictions_dir / "labels" / f"{name}.png"))
        assert np.array_equal(labels, reference_pred[index].numpy())
        color = Image.open(predictions_dir / "color" / f"{name}.png")
        assert color.mode == "P" and np.array_equal(np.array(color), labels)
        rgb = np.array(color.convert("RGB"))
        assert np.array_equal(rgb, np.asarray(dataset.palette)[labels])


@pytest.mark.slow
def test_flags_and_overrides_reach_the_protocol(synthetic_checkpoint, tmp_path, capsys):
    cli = _load_cli()
    path = synthetic_checkpoint[0]
    runs = {}
    for label, flags in {
        "plain": [],
        "scale1": ["--scales", "1.0"],
        "bigslide": ["--mode", "slide", "eval.window_size=64", "eval.stride=32"],
        "tta": ["--mode", "slide", "eval.window_size=40", "eval.stride=24", "--scales", "0.75,1.0", "--flip"],
    }.items():
        output = tmp_path / f"{label}.json"
        assert cli.main(["--checkpoint", str(path), "--device", "cpu", "--no-progress", "--output", str(output),
                         "data.synthetic_val_size=2", *flags]) == 0
        runs[label] = json.loads(output.read_text())
    capsys.readouterr()
    assert runs["scale1"]["iou"] == runs["plain"]["iou"]
    assert runs["bigslide"]["iou"] == runs["plain"]["iou"]  # window larger than the 48 px images
    assert runs["tta"]["protocol"] == {"mode": "slide", "window_size": [40, 40], "stride": [24, 24], "scales": [0.75, 1.0],
                                       "flip": True, "base_size": 0, "amp": "off", "runtime": "torch",
                                       "exported": None, "ignore_index": 255}
    assert runs["tta"]["num_images"] == 2


@pytest.mark.parametrize("overrides,message", [
    (["model.backbone=resnet34"], "does not fit the model"),
    (["model.arch=deeplabv3"], "does not fit the model"),
    (["model.head_channels=16"], "shape mismatch"),
    (["data.num_classes=4"], "predicts 6 classes"),
    (["no.such_key=1"], "unknown config key"),
    (["--mode", "slide", "eval.window_size=32", "eval.stride=40"], "eval.stride=40,40 > eval.window_size=32,32"),
    (["--mode", "tiles"], "eval.mode='tiles' is not one of whole, slide"),
    (["--amp", "fp8"], "eval.amp='fp8' is not one of auto, off, tf32, fp16, bf16"),
    (["--device", "tpu"], "--device 'tpu'"),
    (["--split", "nonexistent", "data.dataset=voc", "data.root=/nonexistent/voc"], "/nonexistent/voc"),
])
def test_mismatches_are_one_line_errors(synthetic_checkpoint, capsys, overrides, message):
    cli = _load_cli()
    code = cli.main(["--checkpoint", str(synthetic_checkpoint[0]), "--device", "cpu", "--no-progress", *overrides])
    error = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(error) == 1 and message in error[0] and re.match(r"\d\d:\d\d:\d\d eval\.py: error: ", error[0])


def test_missing_checkpoint_is_a_one_line_error(tmp_path, capsys):
    cli = _load_cli()
    assert cli.main(["--checkpoint", str(tmp_path / "missing.pt"), "--device", "cpu"]) == 2
    assert "missing.pt" in capsys.readouterr().err


@pytest.mark.parametrize("flag,what", [("--output", "report"), ("--save-predictions", "predictions under")])
def test_an_unwritable_output_names_the_path_and_fails_before_evaluating(synthetic_checkpoint, tmp_path, capsys,
                                                                         monkeypatch, flag, what):
    import syncseg.engine.evaluate

    def never(*args, **kwargs):
        raise AssertionError("evaluated although the output cannot be written")

    monkeypatch.setattr(syncseg.engine.evaluate, "evaluate", never)
    blocker = tmp_path / "file.txt"  # a regular file: writing under it fails, also as root (unlike chmod)
    blocker.write_text("not a folder")
    target = blocker / "sub" / ("metrics.json" if flag == "--output" else "predictions")
    cli = _load_cli()
    assert cli.main(["--checkpoint", str(synthetic_checkpoint[0]), "--device", "cpu", "--no-progress",
                     flag, str(target)]) == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1, error
    time, rest = error[0].split(" ", 1)
    assert re.fullmatch(r"\d\d:\d\d:\d\d", time)
    refused = blocker / "sub" if flag == "--output" else target / "color"  # the folder the OS could not make
    assert rest == f"eval.py: error: could not write {what} '{target}': Not a directory: '{refused}'"


def _fake_cityscapes(root: Path, count: int = 2) -> list[str]:
    from cityscapesscripts.helpers.labels import labels

    rng = np.random.default_rng(0)
    label_ids = [l.id for l in labels if l.id >= 0]
    gt_files = []
    for index in range(count):
        stem = f"aachen_{index:06d}_000019"
        (root / "leftImg8bit" / "val" / "aachen").mkdir(parents=True, exist_ok=True)
        (root / "gtFine" / "val" / "aachen").mkdir(parents=True, exist_ok=True)
        image = rng.integers(0, 256, (40, 56, 3), dtype=np.uint8)
        Image.fromarray(image).save(root / "leftImg8bit" / "val" / "aachen" / f"{stem}_leftImg8bit.png")
        gt = rng.choice(label_ids, size=(40, 56)).astype(np.uint8)
        gt_file = root / "gtFine" / "val" / "aachen" / f"{stem}_gtFine_labelIds.png"
        Image.fromarray(gt).save(gt_file)
        gt_files.append(str(gt_file))
    return gt_files


@pytest.mark.slow
def _evaluate_saving_predictions(checkpoint: Path, folder: Path, capsys) -> tuple[dict, Path]:
    """eval.py --save-predictions on the CPU: (its JSON report, the predictions folder)."""
    output, predictions = folder / "report.json", folder / "results"
    assert _load_cli().main(["--checkpoint", str(checkpoint), "--device", "cpu", "--no-progress", "--output",
                             str(output), "--save-predictions", str(predictions)]) == 0
    capsys.readouterr()
    return json.loads(output.read_text()), predictions


def test_cityscapes_label_ids_score_the_same_with_the_official_script(tmp_path, capsys):
    """eval.py's mIoU equals cityscapesscripts' on the labelId PNGs that eval.py saved."""
    pytest.importorskip("cityscapesscripts")
    from cityscapesscripts.evaluation import evalPixelLevelSemanticLabeling as official

    root = tmp_path / "cityscapes"
    gt_files = _fake_cityscapes(root)
    checkpoint = tmp_path / "cs.pt"
    _make_checkpoint(checkpoint, ["data.dataset=cityscapes", f"data.root={root}", "model.backbone=resnet18",
                                  "model.head_channels=8", "model.aspp_rates=1,2,3", "model.norm=bn",
                                  "data.num_workers=0"], seed=1)
    record, predictions = _evaluate_saving_predictions(checkpoint, tmp_path / "cs", capsys)
    args = official.args
    args.predictionPath, args.predictionWalk = str(predictions / "labels"), None
    args.evalInstLevelScore, args.evalPixelAccuracy, args.JSONOutput, args.quiet = False, False, False, True
    pred_files = [official.getPrediction(args, gt) for gt in gt_files]
    result = official.evaluateImgLists(pred_files, gt_files, args)
    assert record["miou"] == pytest.approx(result["averageScoreClasses"], abs=1e-12)
    for name, scores in record["per_class"].items():
        official_iou = result["classScores"][name]
        if math.isnan(official_iou):
            assert scores["iou"] is None
        else:
            assert scores["iou"] == pytest.approx(official_iou, abs=1e-12)


def test_ade20k_predictions_are_saved_as_raw_labels_1_to_150_and_score_like_numpy(tmp_path, capsys):
    """The saved labels/ PNGs are the benchmark's raw values (class + 1); mIoU recomputed in numpy on the
    raw annotations (0 = "other", left out) equals eval.py's."""
    from tests.data.conftest import make_ade20k_tree

    root = tmp_path / "ADEChallengeData2016"
    raw_masks = make_ade20k_tree(root, counts={"validation": 2})
    checkpoint = tmp_path / "ade.pt"
    _make_checkpoint(checkpoint, ["data.dataset=ade20k", f"data.root={root}", "data.val_split=validation",
                                  *TINY[:4], "data.num_workers=0"], seed=2)
    record, predictions = _evaluate_saving_predictions(checkpoint, tmp_path / "ade", capsys)
    confusion = np.zeros((150, 150), dtype=np.int64)
    for stem, raw in raw_masks.items():
        saved = np.asarray(Image.open(predictions / "labels" / f"{stem}.png"))
        assert saved.min() >= 1 and saved.max() <= 150  # raw values, never 0 ("other")
        keep = raw > 0
        np.add.at(confusion, (raw[keep].astype(int) - 1, saved[keep].astype(int) - 1), 1)
    union = confusion.sum(0) + confusion.sum(1) - np.diag(confusion)
    iou = np.diag(confusion)[union > 0] / union[union > 0]
    assert record["num_images"] == 2 and record["miou"] == pytest.approx(iou.mean(), abs=1e-12)


@pytest.mark.slow
def test_eval_reproduces_training_validation(tmp_path, capsys):
    """train.py's validation at the last iteration and eval.py on that checkpoint report the same numbers
    (channels_last on; eval.amp=bf16: both evaluate under the checkpoint's eval.amp)."""
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--config", "demo", "--gpus", "cpu", f"output_dir={run_dir}",
         "train.iters=2", "train.val_interval=2", "train.ckpt_interval=2", "train.batch_size=2",
         "train.num_vis_images=0", "data.synthetic_image_size=48", "data.crop_size=48",
         "data.synthetic_train_size=4", "data.synthetic_val_size=3", "data.num_workers=0", "model.head_channels=8",
         "model.channels_last=true", "eval.amp=bf16"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    records = read_metrics(run_dir)
    validation = [r for r in records if r.get("type") == "val" and r["iteration"] == 2][-1]
    cli = _load_cli()
    output = tmp_path / "eval.json"
    assert cli.main(["--checkpoint", str(run_dir / "last.pt"), "--device", "cpu", "--no-progress",
                     "--output", str(output)]) == 0
    capsys.readouterr()
    record = json.loads(output.read_text())
    assert record["iteration"] == 2 and record["protocol"]["amp"] == "bf16"
    assert record["num_images"] == validation["num_images"] == 3
    for key in ("miou", "pixel_acc", "mean_acc", "fwiou"):
        assert record[key] == pytest.approx(validation[key], abs=1e-12), key
    assert {name: s["iou"] for name, s in record["per_class"].items() if s["iou"] is not None} == \
        pytest.approx(validation["iou"], abs=1e-12)


@pytest.mark.slow
def test_two_processes_shard_and_equal_single_process(synthetic_checkpoint, tmp_path):
    """2 gloo processes on 5 images (3 + 2): the same metrics as one process, each image counted and
    saved once. The ranks get torchrun's variables and run eval's main forked from the forkserver
    (tests.gloo.run_module_ranks: not ~4.5 CPU-s of imports a process); eval.py as a command: the tests above."""
    from syncseg.commands.eval import main

    path = synthetic_checkpoint[0]
    common = ["--checkpoint", str(path), "--no-progress", "data.synthetic_val_size=5"]
    sharded_argv = [*common, "--output", str(tmp_path / "ddp.json"), "--save-predictions", str(tmp_path / "pred")]
    run_module_ranks(main, sharded_argv, torchrun_environment(2, free_port()),
                     [tmp_path / "ddp.rank0.log", tmp_path / "ddp.rank1.log"], cwd=tmp_path)
    run_module_ranks(main, [*common, "--device", "cpu", "--output", str(tmp_path / "single.json")],
                     [plain_environment()], [tmp_path / "single.log"], cwd=tmp_path)
    sharded = json.loads((tmp_path / "ddp.json").read_text())
    single = json.loads((tmp_path / "single.json").read_text())
    assert sharded["world_size"] == 2 and sharded["num_images"] == single["num_images"] == 5
    assert sharded["num_pixels"] == single["num_pixels"]
    assert sharded["iou"] == single["iou"] and sharded["miou"] == single["miou"]
    assert sorted(p.name for p in (tmp_path / "pred" / "labels").iterdir()) == \
        [f"synthetic_{index:05d}.png" for index in range(5)]
