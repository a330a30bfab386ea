"""A shared base file completed on the command line, and folders smaller than one batch, train end to end
through train.py (issue 29 items 5 and 6: the issue's two config examples, a 3-image folder with batch 4,
and a single image)."""
from __future__ import annotations

import importlib
import logging

import pytest

from tests.e2e.common import TINY_BASE, read_metrics
from tests.e2e.test_own_data import _binary_folder

RUN = ["data.scale_range=1,1", "train.iters=2", "train.val_interval=2", "train.ckpt_interval=2",
       "train.num_vis_images=0", "train.amp=off", "eval.amp=off", "model.aux_loss=false"]


def _train(*args: str) -> int:
    return importlib.import_module("syncseg.commands.train").main([*args])


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "data"
    _binary_folder(root, 5, seed=4)
    (root / "train.txt").write_text("000\n001\n002\n")
    (root / "val.txt").write_text("003\n004\n")
    return root


@pytest.mark.slow
@pytest.mark.parametrize("file_text,command_line", [
    ("base: demo.yaml\ndata:\n  dataset: folder\n  label_map: {255: 1}\n", ["data.num_classes=2"]),
    ("base: demo.yaml\ndata:\n  label_map: {255: 1}\n", ["data.dataset=folder", "data.num_classes=2"]),
], ids=["folder-in-the-file", "folder-on-the-command-line"])
def test_the_issues_config_examples_train_on_three_images_with_batch_four(folder, tmp_path, file_text, command_line,
                                                                          caplog):
    caplog.set_level(logging.INFO, logger="syncseg.engine.samplers")
    config = tmp_path / "my.yaml"
    config.write_text(file_text)
    code = _train("--config", str(config), *TINY_BASE, *RUN, f"data.root={folder}", *command_line,
                  f"output_dir={tmp_path / 'run'}")  # TINY_BASE's train.batch_size=4 > the 3 training images
    assert code == 0, caplog.text[-3000:]
    records = read_metrics(tmp_path / "run")
    assert [r["iteration"] for r in records if r["type"] == "train"] == [1, 2]
    assert [r["num_images"] for r in records if r["type"] == "val"] == [2]  # every validation image, once
    assert "3 sample(s), fewer than one global batch (train.batch_size=4): each epoch repeats it 2 times" \
        in caplog.text


@pytest.mark.slow
def test_one_image_trains(folder, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="syncseg.engine.samplers")
    (folder / "train.txt").write_text("000\n")
    code = _train("--config", "demo.yaml", *TINY_BASE, *RUN, "data.dataset=folder", f"data.root={folder}",
                  "data.num_classes=2", "data.label_map=255:1", f"output_dir={tmp_path / 'run'}")
    assert code == 0, caplog.text[-3000:]
    assert (tmp_path / "run" / "best.pt").is_file()
    assert "1 sample(s), fewer than one global batch (train.batch_size=4): each epoch repeats it 4 times" \
        in caplog.text
