"""Images beyond 8-bit RGB end to end (issue 21, item 2): a 12-bit single-channel TIFF dataset and a
4-channel PNG dataset train, evaluate, predict and export through the real commands, and 12-bit values
reach the model with their full range, in training and in evaluation."""
from __future__ import annotations

import importlib
import json
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from syncseg.data.images import ImageFormat, read_image
from syncseg.engine.checkpoint_file import load_checkpoint
from syncseg.engine.config import load_config
from syncseg.engine.distributed import DistInfo
from syncseg.engine.trainer import Trainer
from tests.data.conftest import make_image_folder
from tests.e2e.common import TINY_BASE

SIZE, COUNT = 32, 8
TIFF_KEYS = ["data.in_channels=1", "data.max_value=4095", "data.mean=0.5", "data.std=0.29"]
PNG_KEYS = ["data.in_channels=4", "data.mean=0.5,0.5,0.5,0.5", "data.std=0.29,0.29,0.29,0.29"]


def _twelve_bit_images(seed: int) -> list[np.ndarray]:
    """COUNT grey 12-bit images with 0 and 4095 present and values that 8 bits cannot hold."""
    rng = np.random.default_rng(seed)
    images = [rng.integers(0, 4096, (SIZE, SIZE)).astype(np.uint16) for _ in range(COUNT)]
    images[0][0, 0], images[0][0, 1] = 0, 4095
    return images


def _folder_keys(root) -> list[str]:
    return [*TINY_BASE, "data.dataset=folder", f"data.root={root}", "data.num_classes=2", "data.train_split=all",
            "data.val_split=all", "data.scale_range=1,1", "data.hflip=false", "train.amp=off", "eval.amp=off"]


def test_12_bit_values_reach_the_model_with_their_full_range(tmp_path):
    images = _twelve_bit_images(seed=0)
    make_image_folder(tmp_path / "data", images, suffix=".tif")
    config = load_config("demo.yaml", [*_folder_keys(tmp_path / "data"), *TIFF_KEYS, f"output_dir={tmp_path / 'run'}",
                                       "train.iters=1", "train.batch_size=8", "train.num_vis_images=0",
                                       "model.channels_last=false"])
    trainer = Trainer.from_config(config, DistInfo(), progress=False)
    seen: list[torch.Tensor] = []
    trainer.model.register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0].detach().clone()))
    try:
        trainer.fit()  # one step on the 8 images (crops = whole images), then a validation of all 8
    finally:
        trainer.close()
    trained, validated = torch.cat(seen[:1]), torch.cat(seen[1:])
    assert trained.shape == (8, 1, SIZE, SIZE) and validated.shape == (8, 1, SIZE, SIZE)
    expected = torch.from_numpy(np.stack(images).astype(np.float64))[:, None]
    for inputs in (trained, validated):
        raw = (inputs.double() * 0.29 + 0.5) * 4095  # undo (x / max_value - mean) / std
        assert torch.equal(raw.round().sort(0).values, expected.sort(0).values)  # the same images, any order
        assert (raw - raw.round()).abs().max() < 2e-3  # float32's rounding, far below one step of 4095
        assert inputs.min().item() == pytest.approx(-0.5 / 0.29, abs=1e-6)  # 0 -> -mean / std
        assert inputs.max().item() == pytest.approx(0.5 / 0.29, abs=1e-6)  # 4095 -> (1 - mean) / std: full scale
        assert raw.round().unique().numel() > 256  # not cut to 8 bits


def _run_commands(tmp_path, data_keys: list[str], image_path, export_format: str, capsys) -> dict:
    """train.py, eval.py, predict.py and export.py on the folder dataset; returns eval.py's metrics."""
    run = tmp_path / "run"
    train = importlib.import_module("syncseg.commands.train")
    assert train.main(["--config", "demo.yaml", *data_keys, f"output_dir={run}", "train.iters=3",
                       "train.val_interval=3", "train.ckpt_interval=3", "train.num_vis_images=2"]) == 0
    best = load_checkpoint(run / "best.pt")
    saved, expected = best["config"]["data"], load_config("demo.yaml", data_keys).data
    assert (saved["in_channels"], saved["max_value"]) == (expected.in_channels, expected.max_value)  # eval, predict
    evaluate = importlib.import_module("syncseg.commands.eval")
    assert evaluate.main(["--checkpoint", str(run / "best.pt"), "--device", "cpu", "--no-progress", "--output",
                          str(tmp_path / "metrics.json")]) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["num_images"] == COUNT and metrics["miou"] == pytest.approx(best["best_miou"], abs=1e-12)
    predict = importlib.import_module("syncseg.commands.predict")
    assert predict.main(["--checkpoint", str(run / "best.pt"), "--input", str(image_path.parent), "--output",
                         str(tmp_path / "predicted"), "--device", "cpu"]) == 0
    for index in range(COUNT):
        assert Image.open(tmp_path / "predicted" / f"{index}_mask.png").size == (SIZE, SIZE)
        assert Image.open(tmp_path / "predicted" / f"{index}_overlay.png").mode == "RGB"
    export = importlib.import_module("syncseg.commands.export")
    # 0: written, and equal to PyTorch on the checkpoint's channel count (1: it does not match)
    suffix = {"exported": "pt2"}.get(export_format, export_format)  # torch.export files end in .pt2
    assert export.main(["--checkpoint", str(run / "best.pt"), "--format", export_format, "--output",
                        str(tmp_path / f"model.{suffix}")]) == 0
    assert " error: " not in capsys.readouterr().err
    return metrics


@pytest.mark.slow
def test_a_16_bit_grey_tiff_dataset_trains_evaluates_predicts_and_exports(tmp_path, capsys):
    make_image_folder(tmp_path / "data", _twelve_bit_images(seed=1), suffix=".tif")
    keys = [*_folder_keys(tmp_path / "data"), "data.num_workers=1", *TIFF_KEYS]  # uint16 batches from a worker
    _run_commands(tmp_path, keys, tmp_path / "data" / "images" / "0.tif", "torchscript", capsys)
    # the export takes 1-channel images and says how to normalize them
    extra = {"syncseg.json": ""}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit's deprecation notice
        loaded = torch.jit.load(str(tmp_path / "model.torchscript"), map_location="cpu", _extra_files=extra)
    metadata = json.loads(extra["syncseg.json"])
    assert (metadata["in_channels"], metadata["max_value"], metadata["mean"]) == (1, 4095, [0.5])
    assert loaded(torch.zeros(1, 1, SIZE, SIZE)).shape == (1, 2, SIZE, SIZE)
    # an 8-bit image given to the 16-bit model is skipped by name, not predicted in the wrong units
    Image.fromarray(np.zeros((SIZE, SIZE), np.uint8), mode="L").save(tmp_path / "eight.png")
    predict = importlib.import_module("syncseg.commands.predict")
    assert predict.main(["--checkpoint", str(tmp_path / "run" / "best.pt"), "--input", str(tmp_path / "eight.png"),
                         "--output", str(tmp_path / "eight"), "--device", "cpu"]) == 2
    assert "eight.png' is 8-bit but data.max_value=4095 expects 16-bit images" in capsys.readouterr().err


@pytest.mark.slow
def test_a_4_channel_png_dataset_trains_evaluates_predicts_and_exports(tmp_path, capsys):
    rng = np.random.default_rng(2)
    bands = [rng.integers(0, 256, (SIZE, SIZE, 4), dtype=np.uint8) for _ in range(COUNT)]
    make_image_folder(tmp_path / "data", bands, suffix=".png")
    assert np.array_equal(read_image(tmp_path / "data" / "images" / "3.png", ImageFormat(channels=4)), bands[3])
    keys = [*_folder_keys(tmp_path / "data"), *PNG_KEYS]
    _run_commands(tmp_path, keys, tmp_path / "data" / "images" / "0.png", "exported", capsys)
    program = torch.export.load(str(tmp_path / "model.pt2")).module()
    assert program(torch.zeros(1, 4, SIZE, SIZE)).shape == (1, 2, SIZE, SIZE)


@pytest.mark.slow
def test_a_6_band_tiff_dataset_trains_with_the_lines_verify_dataset_prints(tmp_path, capfd):
    """Issue 32 item 1, end to end: verify_dataset under the default config prints the lines for 6-band planar
    TIFFs; training stops at start without them (data.mean names verify_dataset) and trains with them."""
    from tests.data.test_commands import _multi_band_folder, _printed_command_line

    _multi_band_folder(tmp_path / "data", 6, planar=True)
    folder = ["data.dataset=folder", f"data.root={tmp_path / 'data'}", "data.num_classes=3"]
    verify = importlib.import_module("syncseg.commands.verify_dataset")
    assert verify.main(["--config", "demo.yaml", *folder]) == 1  # the default config cannot read the files
    printed = _printed_command_line(capfd.readouterr().out)
    train = importlib.import_module("syncseg.commands.train")
    run = [*TINY_BASE, *folder, "data.scale_range=1,1", "data.crop_size=24", "train.iters=1", "train.amp=off",
           "eval.amp=off", "train.num_vis_images=0"]
    assert train.main(["--config", "demo.yaml", *run, "data.in_channels=6", f"output_dir={tmp_path / 'none'}"]) == 2
    assert "data.mean has 3 value(s) (ImageNet's RGB values, the default) but data.in_channels=6" in \
        capfd.readouterr().err
    assert train.main(["--config", "demo.yaml", *run, *printed, f"output_dir={tmp_path / 'run'}"]) == 0
    assert (tmp_path / "run" / "best.pt").is_file()
