"""scripts/predict.py: masks and overlays for arbitrary images with a checkpoint it is given."""
from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from PIL import Image

from engine.checkpoint import FORMAT_VERSION, save_checkpoint
from engine.config_io import load_config, to_dict

TINY = ["model.backbone=resnet18", "model.head_channels=8", "model.aspp_rates=1,2,3", "model.norm=bn"]


def _load_script():
    return importlib.import_module("scripts.predict")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from data import bit_palette
    from model.builder import build_model

    config = load_config(None, TINY)
    torch.manual_seed(0)
    model = build_model(config.model, 6)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.1, 0.1)
    path = tmp_path_factory.mktemp("ckpt") / "best.pt"
    classes = ["background", "a", "b", "c", "d", "e"]
    save_checkpoint(path, {"format_version": FORMAT_VERSION, "model": model.state_dict(), "config": to_dict(config),
                           "classes": classes, "iteration": 5})
    return path, config, model.eval(), bit_palette(6)


def _reference(model, image: np.ndarray, config) -> np.ndarray:
    mean = torch.tensor(config.data.mean, dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(config.data.std, dtype=torch.float64).view(1, 3, 1, 1)
    inputs = ((torch.from_numpy(image).permute(2, 0, 1)[None].double() / 255 - mean) / std).float()
    with torch.no_grad():
        return model(inputs)["out"].argmax(1)[0].numpy()


def test_masks_and_overlays_for_a_folder_of_odd_sizes(checkpoint, tmp_path, capsys):
    path, config, model, palette = checkpoint
    rng = np.random.default_rng(0)
    inputs = tmp_path / "in"
    (inputs / "sub").mkdir(parents=True)
    first = rng.integers(0, 256, (37, 53, 3), dtype=np.uint8)
    second = rng.integers(0, 256, (61, 40, 3), dtype=np.uint8)
    Image.fromarray(first).save(inputs / "first.png")
    Image.fromarray(second).save(inputs / "sub" / "second.jpg", quality=95)
    (inputs / "notes.txt").write_text("not an image")
    out = tmp_path / "out"
    assert _load_script().main(["--checkpoint", str(path), "--input", str(inputs), "--output", str(out),
                                "--device", "cpu"]) == 0
    mask = Image.open(out / "first_mask.png")
    assert mask.mode == "P" and mask.size == (53, 37)
    labels = np.array(mask)
    assert np.array_equal(labels, _reference(model, first, config))
    assert np.array_equal(np.array(mask.convert("RGB")), palette[labels])
    overlay = np.array(Image.open(out / "first_overlay.png")).astype(np.float64)
    expected = 0.5 * first.astype(np.float64) + 0.5 * palette[labels]
    assert overlay.shape == first.shape and np.abs(overlay - expected).max() <= 0.5
    second_mask = Image.open(out / "sub" / "second_mask.png")
    assert second_mask.size == (40, 61) and (out / "sub" / "second_overlay.png").is_file()
    assert not list(out.glob("notes*"))


@pytest.mark.slow
def test_base_size_and_slide_keep_the_original_resolution(checkpoint, tmp_path):
    path, config, model, _ = checkpoint
    image = np.random.default_rng(1).integers(0, 256, (50, 70, 3), dtype=np.uint8)
    Image.fromarray(image).save(tmp_path / "x.png")
    script = _load_script()
    assert script.main(["--checkpoint", str(path), "--input", str(tmp_path / "x.png"), "--output",
                        str(tmp_path / "a"), "--device", "cpu", "data.base_size=35", "--mode", "slide",
                        "eval.window_size=24", "eval.stride=16", "--flip"]) == 0
    assert Image.open(tmp_path / "a" / "x_mask.png").size == (70, 50)
    # a window larger than the image and scale 1.0 are plain whole-image inference
    assert script.main(["--checkpoint", str(path), "--input", str(tmp_path / "x.png"), "--output",
                        str(tmp_path / "b"), "--device", "cpu", "--mode", "slide", "eval.window_size=128", "eval.stride=64",
                        "--scales", "1.0"]) == 0
    assert np.array_equal(np.array(Image.open(tmp_path / "b" / "x_mask.png")), _reference(model, image, config))


def test_errors_are_one_line(checkpoint, tmp_path, capsys):
    script = _load_script()
    path = checkpoint[0]
    assert script.main(["--checkpoint", str(path), "--input", str(tmp_path / "none"), "--output",
                        str(tmp_path / "o")]) == 2
    assert "none" in capsys.readouterr().err
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(tmp_path / "y.png")
    assert script.main(["--checkpoint", str(path), "--input", str(tmp_path / "y.png"), "--output",
                        str(tmp_path / "o"), "--device", "cpu", "model.backbone=resnet34"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "does not fit the model" in error[0]
