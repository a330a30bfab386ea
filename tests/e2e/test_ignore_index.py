"""One ignore label, from data.ignore_index to the dataset, the crop padding, the loss, evaluation and
eval.py's saved predictions, with masks whose unlabeled pixels are 254 instead of the usual 255."""
from __future__ import annotations

import importlib
import json

import numpy as np
import pytest
import torch
from PIL import Image

from syncseg.engine.config import load_config
from syncseg.engine.distributed import DistInfo
from syncseg.engine.samplers import train_batches
from syncseg.engine.trainer import Trainer

IGNORE = 254
NUM_CLASSES = 3


def _folder_tree(root, count=4, size=(20, 24)):
    rng = np.random.default_rng(0)
    masks = {}
    for index in range(count):
        name = f"sample{index}"
        image = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
        mask = rng.integers(0, NUM_CLASSES, size, dtype=np.uint8)
        mask[:, :3] = IGNORE  # an unlabeled band on the left
        mask[index * 2:index * 2 + 3, 10:14] = IGNORE
        (root / "images").mkdir(parents=True, exist_ok=True)
        (root / "masks").mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(root / "images" / f"{name}.png")
        Image.fromarray(mask, mode="L").save(root / "masks" / f"{name}.png")
        masks[name] = mask
    return masks


@pytest.mark.slow
def test_training_evaluation_and_saved_predictions_ignore_the_configured_label(tmp_path, capsys):
    masks = _folder_tree(tmp_path / "data")
    run_dir = tmp_path / "run"
    overrides = [f"output_dir={run_dir}", "data.dataset=folder", f"data.root={tmp_path / 'data'}",
                 f"data.num_classes={NUM_CLASSES}", f"data.ignore_index={IGNORE}", "data.train_split=all",
                 "data.val_split=all", "data.crop_size=32", "data.scale_range=1,1", "data.hflip=false",
                 "data.num_workers=0", "model.backbone=resnet18", "model.head_channels=8", "model.aspp_rates=1",
                 "model.channels_last=false", "train.batch_size=2", "train.iters=2", "train.val_interval=2",
                 "train.num_vis_images=0", "train.amp=off", "eval.amp=off", "train.loss=ce:1"]
    config = load_config("demo.yaml", overrides)  # cross-entropy alone: its weight is the labelled pixel count
    trainer = Trainer.from_config(config, DistInfo(), progress=False)

    # training: the 24 px images are padded to 32 px crops with the ignore label, and the loss counts
    # exactly the other pixels
    images, batch_masks = next(train_batches(trainer.parts.train_loader, 0))
    labelled = sum(int((mask != IGNORE).sum()) for mask in masks.values()) // len(masks)
    assert batch_masks.shape[-2:] == (32, 32)
    assert int((batch_masks != IGNORE).sum()) == 2 * labelled  # every labelled pixel kept, padding ignored
    assert set(batch_masks.unique().tolist()) <= {0, 1, 2, IGNORE}
    from syncseg.data.transforms import normalize_batch

    with torch.no_grad():
        outputs = trainer.model(normalize_batch(images, config.data.mean, config.data.std))
    (_, weight), = trainer.parts.criterion.terms({"out": outputs["out"]}, batch_masks).values()
    assert int(weight) == 2 * labelled

    # evaluation (training's validation): the confusion matrix holds exactly the labelled pixels
    result = trainer.fit()
    trainer.close()
    assert result.last_val["num_pixels"] == sum(int((mask != IGNORE).sum()) for mask in masks.values())

    # eval.py: its metrics and the predictions it saves agree on the same pixels
    evaluation = importlib.import_module("syncseg.commands.eval")
    output = tmp_path / "eval.json"
    assert evaluation.main(["--checkpoint", str(run_dir / "last.pt"), "--device", "cpu", "--no-progress",
                            "--output", str(output), "--save-predictions", str(tmp_path / "pred")]) == 0
    capsys.readouterr()
    record = json.loads(output.read_text())
    assert record["protocol"]["ignore_index"] == IGNORE and record["num_pixels"] == result.last_val["num_pixels"]
    confusion = np.zeros((NUM_CLASSES, NUM_CLASSES), dtype=np.int64)
    for name, mask in masks.items():
        predicted = np.array(Image.open(tmp_path / "pred" / "labels" / f"{name}.png"))
        keep = mask != IGNORE
        np.add.at(confusion, (mask[keep], predicted[keep]), 1)
    assert confusion.sum() == record["num_pixels"]
    union = confusion.sum(0) + confusion.sum(1) - np.diag(confusion)
    iou = [float(tp / u) if u else None for tp, u in zip(np.diag(confusion), union)]
    assert record["iou"] == pytest.approx(iou, abs=1e-12)
    assert record["iou"] == pytest.approx(result.last_val["iou"], abs=1e-12)
