"""`python -m syncseg predict`: masks and overlays for arbitrary images with a checkpoint it is given."""
from __future__ import annotations

import importlib
import re

import numpy as np
import pytest
import torch
from PIL import Image

from syncseg.engine.checkpoint_file import save_checkpoint
from tests.checkpoints import save_random_checkpoint

TINY = ["model.backbone=resnet18", "model.head_channels=8", "model.aspp_rates=1,2,3", "model.norm=bn"]


def _load_script():
    return importlib.import_module("syncseg.commands.predict")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from syncseg.data import bit_palette

    path = tmp_path_factory.mktemp("ckpt") / "best.pt"
    config, model = save_random_checkpoint(path, TINY, ["background", "a", "b", "c", "d", "e"], seed=0, iteration=5)
    return path, config, model, bit_palette(6)


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
    expected[labels == 0] = first[labels == 0]  # class 0 is named background: the photo as it is
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


def _brightness_classes(model, inputs, *, num_classes, **settings):
    """Stands in for syncseg.engine.inference.predict: background where the normalized image is dark, class 2
    where it is bright, so the mask follows the picture (and its orientation)."""
    brightness = inputs.mean(1, keepdim=True)
    logits = torch.full((inputs.shape[0], num_classes, *inputs.shape[-2:]), -10.0)
    logits[:, :1], logits[:, 2:3] = -brightness, brightness
    return logits


def test_overlay_colours_objects_only_exif_turns_photos_upright_and_a_legend(checkpoint, tmp_path, monkeypatch):
    import syncseg.engine.inference

    path, config, model, palette = checkpoint
    monkeypatch.setattr(syncseg.engine.inference, "predict", _brightness_classes)
    stored = np.zeros((30, 50, 3), dtype=np.uint8)  # as the camera wrote it: bright on the left
    stored[:, :20] = 230
    stored[:, 20:] = 20 + np.random.default_rng(2).integers(0, 40, (30, 30, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to view"
    Image.fromarray(stored).save(tmp_path / "phone.png", exif=exif)
    out = tmp_path / "out"
    assert _load_script().main(["--checkpoint", str(path), "--input", str(tmp_path / "phone.png"), "--output",
                                str(out), "--device", "cpu", "--legend", "--alpha", "0.6"]) == 0
    upright = np.rot90(stored, k=-1)  # what a viewer shows: 30 wide, 50 high, bright at the top
    labels = np.array(Image.open(out / "phone_mask.png"))
    assert labels.shape == (50, 30)
    assert (labels[:20] == 2).all() and (labels[20:] == 0).all()
    overlay = np.array(Image.open(out / "phone_overlay.png"))
    assert np.array_equal(overlay[20:], upright[20:])  # background: the untouched photo, not darkened
    expected = 0.4 * upright[:20].astype(float) + 0.6 * palette[2].astype(float)
    assert np.abs(overlay[:20] - expected).max() <= 0.5
    legend = np.array(Image.open(out / "legend.png").convert("RGB"))
    assert all((legend == color).all(axis=-1).any() for color in palette[1:])


def test_a_warning_for_images_far_larger_than_the_training_crop(checkpoint, tmp_path, caplog):
    path = checkpoint[0]
    for name in ("a", "b"):
        Image.fromarray(np.zeros((40, 90, 3), dtype=np.uint8)).save(tmp_path / f"{name}.png")
    common = ["--checkpoint", str(path), "--input", str(tmp_path), "--output", str(tmp_path / "o"), "--device", "cpu",
              "data.crop_size=40"]
    with caplog.at_level("WARNING"):
        assert _load_script().main(common) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2, warnings  # one explanation, then a count
    assert "a.png is 90x40, more than 2 times the training crop (data.crop_size=40)" in warnings[0]
    assert "data.base_size=40" in warnings[0] and "--mode slide" in warnings[0]
    assert warnings[1].startswith("2 of 2 images")
    caplog.clear()
    with caplog.at_level("WARNING"):  # predicted at a long side of 60 px: at the training scale
        assert _load_script().main([*common, "data.base_size=60"]) == 0
        assert _load_script().main([*common, "--mode", "slide", "eval.window_size=40", "eval.stride=40"]) == 0
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_amp_follows_the_checkpoints_eval_amp_unless_given(checkpoint, tmp_path, monkeypatch):
    import contextlib

    import syncseg.engine.inference

    path = checkpoint[0]
    payload = torch.load(path, map_location="cpu", weights_only=True)
    payload["config"]["eval"]["amp"] = "bf16"
    bf16 = tmp_path / "bf16.pt"
    save_checkpoint(bf16, payload)
    Image.fromarray(np.zeros((16, 16, 3), dtype=np.uint8)).save(tmp_path / "z.png")
    used = []

    def recording(device, precision):
        used.append(precision)
        return contextlib.nullcontext()

    monkeypatch.setattr(syncseg.engine.inference, "autocast_for", recording)  # predict_batch's autocast
    common = ["--input", str(tmp_path / "z.png"), "--output", str(tmp_path / "o"), "--device", "cpu"]
    assert _load_script().main(["--checkpoint", str(bf16), *common]) == 0
    assert _load_script().main(["--checkpoint", str(bf16), *common, "--amp", "off"]) == 0
    assert _load_script().main(["--checkpoint", str(path), *common]) == 0
    assert used == ["bf16", "off", "off"]


def test_a_full_disk_is_one_line_naming_the_image_and_leaves_no_partial_file(checkpoint, tmp_path, small_disk,
                                                                            capsys):
    path, *_ = checkpoint
    inputs = tmp_path / "in"
    inputs.mkdir()
    rng = np.random.default_rng(1)
    for index in range(3):  # noise compresses badly: three 800x800 overlays (~1.9 MB each) do not fit in 4 MiB
        Image.fromarray(rng.integers(0, 256, (800, 800, 3), dtype=np.uint8)).save(inputs / f"{index}.png")
    code = _load_script().main(["--checkpoint", str(path), "--input", str(inputs), "--output", str(small_disk),
                                "--device", "cpu", "data.base_size=64"])
    assert code == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and re.match(rf"\d\d:\d\d:\d\d syncseg-predict: error: could not write image '{small_disk}/",
                                        error[0]), error
    assert error[0].endswith(": No space left on device; the previous file there (if any) is unchanged")
    written = sorted(p.name for p in small_disk.iterdir())
    assert written and not [name for name in written if name.startswith(".")]  # no temporary file left
    for name in written:  # every file there is a whole PNG
        with Image.open(small_disk / name) as image:
            image.load()


def _error_lines(capsys) -> list[str]:
    """stderr's error lines without their HH:MM:SS stamp (which each must have)."""
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if ": error: " in line]
    assert all(re.match(r"\d\d:\d\d:\d\d syncseg-predict: error: ", line) for line in lines), lines
    return [line.split(" ", 1)[1] for line in lines]


def test_an_unreadable_image_in_a_folder_is_skipped_and_counted(checkpoint, tmp_path, capsys, caplog):
    path = checkpoint[0]
    inputs = tmp_path / "in"
    (inputs / "sub").mkdir(parents=True)
    for name in ("a.png", "sub/c.png"):
        Image.fromarray(np.full((16, 16, 3), 90, dtype=np.uint8)).save(inputs / name)
    (inputs / "b.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")  # sorted between the two good ones
    (inputs / "d.jpg").write_bytes(b"")
    out = tmp_path / "out"
    with caplog.at_level("WARNING"):
        code = _load_script().main(["--checkpoint", str(path), "--input", str(inputs), "--output", str(out),
                                    "--device", "cpu"])
    assert code == 1
    assert (out / "a_mask.png").is_file() and (out / "sub" / "c_overlay.png").is_file()  # before and after it
    assert not list(out.glob("b_*")) and not list(out.glob("d_*"))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2 and all("skipping" in w for w in warnings), warnings
    assert str(inputs / "b.png") in warnings[0] and "not an image" in warnings[0]
    (error,) = _error_lines(capsys)
    assert error.startswith(f"syncseg-predict: error: 2 of 4 image(s) could not be read and were skipped "
                            f"({inputs / 'b.png'}, {inputs / 'd.jpg'}; ")
    assert error.endswith(f"wrote masks and overlays for the other 2 to {out}")


def test_the_summary_names_a_few_failures_and_counts_the_rest(checkpoint, tmp_path, capsys):
    inputs = tmp_path / "in"
    inputs.mkdir()
    for index in range(5):
        (inputs / f"{index}.png").write_bytes(b"")
    assert _load_script().main(["--checkpoint", str(checkpoint[0]), "--input", str(inputs), "--output",
                                str(tmp_path / "out"), "--device", "cpu"]) == 1
    (error,) = _error_lines(capsys)
    assert f"5 of 5 image(s) could not be read and were skipped ({inputs / '0.png'}, {inputs / '1.png'}, " \
           f"{inputs / '2.png'} and 2 more;" in error


def test_a_single_unreadable_input_file_is_a_bad_input(checkpoint, tmp_path, capsys):
    (tmp_path / "broken.png").write_bytes(b"not a png")
    assert _load_script().main(["--checkpoint", str(checkpoint[0]), "--input", str(tmp_path / "broken.png"),
                                "--output", str(tmp_path / "out"), "--device", "cpu"]) == 2
    (error,) = _error_lines(capsys)
    assert error.startswith(f"syncseg-predict: error: cannot read image '{tmp_path / 'broken.png'}'")


def test_an_unwritable_output_names_the_path_before_loading_the_model(checkpoint, tmp_path, capsys, monkeypatch):
    import syncseg.engine.model_from_checkpoint

    def never(*args, **kwargs):
        raise AssertionError("loaded the model although the output cannot be written")

    monkeypatch.setattr(syncseg.engine.model_from_checkpoint, "load_inference_model", never)
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(tmp_path / "y.png")
    blocker = tmp_path / "file.txt"  # writing under a regular file fails, also as root (unlike chmod)
    blocker.write_text("not a folder")
    out = blocker / "sub"
    assert _load_script().main(["--checkpoint", str(checkpoint[0]), "--input", str(tmp_path / "y.png"),
                                "--output", str(out), "--device", "cpu"]) == 1
    assert _error_lines(capsys) == [f"syncseg-predict: error: could not write masks and overlays under '{out}': "
                                    "Not a directory"]


@pytest.mark.parametrize("dataset,module,palette_name", [
    ("ade20k", "syncseg.data.ade20k", "ADE20K_PALETTE"),
    ("cityscapes", "syncseg.data.cityscapes", "CITYSCAPES_PALETTE"),
])
def test_masks_and_the_legend_take_the_checkpoints_dataset_palette(dataset, module, palette_name, tmp_path):
    """The colours are the data set kind's (syncseg.data.registry), as eval.py and the training grid use;
    ADE20K predictions were once drawn in VOC's colours."""
    expected = getattr(importlib.import_module(module), palette_name)
    path = tmp_path / "best.pt"
    save_random_checkpoint(path, [*TINY, f"data.dataset={dataset}"], [f"class {i}" for i in range(len(expected))],
                           seed=0, iteration=1)
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    out = tmp_path / "out"
    assert _load_script().main(["--checkpoint", str(path), "--input", str(tmp_path / "a.png"), "--output", str(out),
                                "--legend"]) == 0
    with Image.open(out / "a_mask.png") as mask:
        colours = np.array(mask.getpalette(), dtype=np.uint8).reshape(-1, 3)
        labels = np.array(mask)
    assert np.array_equal(colours[: len(expected)], expected)
    overlay = np.array(Image.open(out / "a_overlay.png").convert("RGB"), dtype=np.int64)
    photo = np.array(Image.open(tmp_path / "a.png").convert("RGB"), dtype=np.int64)
    label = labels[20, 20]
    assert np.abs(overlay[20, 20] - (photo[20, 20] + expected[label]) / 2).max() <= 1  # --alpha 0.5 of its colour
