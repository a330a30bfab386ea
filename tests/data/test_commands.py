import importlib
import re
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from syncseg.data.voc import VOCSegmentation
from tests.data.conftest import make_voc_tree

ROOT = Path(__file__).resolve().parents[2]


def _load_script(name):
    return importlib.import_module(f"syncseg.commands.{name}")


def _write_sbd(sbd_root, ids):
    from scipy.io import savemat

    masks = {}
    (sbd_root / "dataset" / "cls").mkdir(parents=True)
    for number, image_id in enumerate(ids):
        mask = ((np.arange(40 * 44).reshape(40, 44) // 97 + number) % 21).astype(np.uint8)
        savemat(sbd_root / "dataset" / "cls" / f"{image_id}.mat",
                {"GTcls": {"Segmentation": mask, "Boundaries": np.zeros(1), "CategoriesPresent": np.arange(3)}})
        masks[image_id] = mask
    return masks


def test_prepare_voc_builds_train_aug(tmp_path):
    prepare_voc = _load_script("prepare_voc")
    voc = tmp_path / "VOC2012"
    voc_masks = make_voc_tree(voc, train=("2007_000001", "2007_000002"), val=("2007_000010",),
                              aug=("2008_000100", "2008_000200"))
    # SBD covers one VOC train image, one VOC val image (must be excluded) and two SBD-only images
    sbd_ids = ["2007_000001", "2007_000010", "2008_000100", "2008_000200"]
    sbd_masks = _write_sbd(tmp_path / "benchmark_RELEASE", sbd_ids)
    (tmp_path / "benchmark_RELEASE" / "dataset" / "train.txt").write_text("\n".join(sbd_ids[:2]) + "\n")
    (tmp_path / "benchmark_RELEASE" / "dataset" / "val.txt").write_text("\n".join(sbd_ids[2:]) + "\n")
    (voc / "ImageSets" / "Segmentation" / "train_aug.txt").unlink()
    for stale in (voc / "SegmentationClassAug").iterdir():
        stale.unlink()
    # SBD images without a VOC annotation: make their sizes match the SBD masks
    for image_id in ("2008_000100", "2008_000200"):
        (voc / "SegmentationClass" / f"{image_id}.png").unlink()
        Image.new("RGB", (44, 40), (10, 20, 30)).save(voc / "JPEGImages" / f"{image_id}.jpg")

    assert prepare_voc.main(["--voc-root", str(voc), "--sbd-root", str(tmp_path / "benchmark_RELEASE"),
                             "--workers", "1"]) == 0
    ids = (voc / "ImageSets" / "Segmentation" / "train_aug.txt").read_text().split()
    assert ids == ["2007_000001", "2007_000002", "2008_000100", "2008_000200"]  # VOC val excluded
    dataset = VOCSegmentation(voc, "train_aug")
    assert len(dataset) == 4
    # a VOC-annotated image keeps the VOC mask (with its 255 boundary), SBD-only ones get SBD's
    assert np.array_equal(dataset[0][1].numpy(), voc_masks["2007_000001"])
    assert np.array_equal(dataset[2][1].numpy(), sbd_masks["2008_000100"])


def test_prepare_voc_errors_name_the_folder(tmp_path, capsys):
    prepare_voc = _load_script("prepare_voc")
    make_voc_tree(tmp_path / "VOC2012")
    assert prepare_voc.main(["--voc-root", str(tmp_path / "VOC2012"), "--sbd-root", str(tmp_path / "nope")]) == 2
    error = capsys.readouterr().err  # one line of syncseg/engine/cli.py's contract: bad input, exit 2
    assert re.fullmatch(r"\d\d:\d\d:\d\d syncseg-prepare-voc: error: .*nope.*\n", error), error


def _config(tmp_path, root):
    path = tmp_path / "voc_test.yaml"
    path.write_text(f"data:\n  dataset: voc\n  root: {root}\n  train_split: train\n  val_split: val\n")
    return str(path)


def test_verify_dataset_reports_counts_frequencies_and_bad_samples(tmp_path, voc_root, capsys):
    verify = _load_script("verify_dataset")
    root, masks = voc_root
    output = tmp_path / "stats.json"
    assert verify.main(["--config", _config(tmp_path, root), "--output", str(output)]) == 0
    text = capsys.readouterr().out
    assert "[voc train] 3 samples (INCOMPLETE: the full split has 1464)" in text
    report = json.loads(output.read_text())
    expected = np.zeros(21, dtype=np.int64)
    for name in ("2007_000010", "2007_000011"):
        expected += np.bincount(masks[name].ravel(), minlength=256)[:21]
    assert report["splits"]["val"]["class_pixels"] == expected.tolist()
    assert report["splits"]["val"]["ignore_pixels"] == sum(int((masks[n] == 255).sum())
                                                           for n in ("2007_000010", "2007_000011"))

    Image.fromarray(np.full((3, 3), 30, dtype=np.uint8), mode="L").save(root / "SegmentationClass" / "2007_000011.png")
    truncated = root / "JPEGImages" / "2007_000010.jpg"
    truncated.write_bytes(truncated.read_bytes()[:-300])
    assert verify.main(["--config", _config(tmp_path, root), "--splits", "val"]) == 1
    bad = [line for line in capsys.readouterr().out.splitlines() if "BAD:" in line]
    assert len(bad) == 2 and any("2007_000010.jpg' is a truncated JPEG" in line for line in bad), bad


def test_verify_dataset_missing_root_exits_2(tmp_path, capsys):
    verify = _load_script("verify_dataset")
    assert verify.main(["--config", _config(tmp_path, tmp_path / "missing"), "--splits", "val"]) == 2
    assert "missing" in capsys.readouterr().err


def test_verify_dataset_flags_binary_and_grey_level_masks_with_the_config_that_reads_them(tmp_path, capsys):
    from tests.data.test_masks import _folder

    verify = _load_script("verify_dataset")
    binary = np.zeros((12, 12), dtype=np.uint8)
    binary[3:8, 3:8] = 255
    _folder(tmp_path / "binary", {"a": binary, "b": binary.T.copy()})
    folder = ["data.dataset=folder", "data.train_split=all", "data.val_split=all"]
    assert verify.main(["--config", "demo.yaml", *folder, f"data.root={tmp_path / 'binary'}",
                        "data.num_classes=2"]) == 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if "WARNING:" in line]
    assert len(warnings) == 1 and "hold only the values 0 and 255" in warnings[0]
    assert warnings[0].endswith("(command line: data.label_map=255:1)")

    grey = np.repeat(np.array([0, 85, 170, 255], dtype=np.uint8), 3)[None].repeat(6, axis=0)
    _folder(tmp_path / "grey", {"g": grey})
    assert verify.main(["--config", "demo.yaml", *folder, f"data.root={tmp_path / 'grey'}", "data.num_classes=4"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert any("BAD: mask" in line and "g.png' has values [85, 170]" in line for line in out)
    assert any(line.startswith("  WARNING:") and line.endswith("(command line: data.label_map=85:1,170:2,255:3)")
               for line in out)


def _printed_command_line(out: str) -> list[str]:
    (line,) = [line for line in out.splitlines() if line.startswith("  command line: ")]
    return line[len("  command line: "):].split()


def test_verify_dataset_describes_16_bit_and_multi_band_images_and_prints_their_config(tmp_path, capsys):
    """A 12-bit grey TIFF set read as 8-bit RGB is flagged, with the lines that read it: its channels,
    full scale, and per-channel mean and std (numpy's, in units of the full scale); with them, no warning."""
    from tests.data.conftest import make_image_folder

    verify = _load_script("verify_dataset")
    rng = np.random.default_rng(0)
    grey = [rng.integers(100, 4000, (16, 20)).astype(np.uint16) for _ in range(3)]
    grey[1][0, 0], grey[2][0, 0] = 4095, 100
    make_image_folder(tmp_path / "grey", grey, suffix=".tif")
    folder = ["data.dataset=folder", "data.train_split=all", "data.val_split=all", "data.num_classes=2"]
    assert verify.main(["--config", "demo.yaml", *folder, f"data.root={tmp_path / 'grey'}"]) == 0
    out = capsys.readouterr().out
    assert "images as stored: 3 image(s) of 1 channel(s), 16-bit, values per channel 100..4095" in out
    assert ("images checked ('{0}/0.tif', '{0}/1.tif', '{0}/2.tif') are 16-bit (values up to 4095) but "
            "data.in_channels=3 with data.max_value=255 reads images as 8-bit RGB: they are cut to their top 8 bits; "
            "to read them as stored, set data.in_channels=1 and data.max_value=4095").format(
                tmp_path / "grey" / "images") in out
    values = np.stack(grey).astype(np.float64)
    expected = ["data.in_channels=1", "data.max_value=4095", f"data.mean={round(values.mean() / 4095, 4):g}",
                f"data.std={round(values.std() / 4095, 4):g}"]
    printed = _printed_command_line(out)
    assert printed == expected
    assert verify.main(["--config", "demo.yaml", *folder, f"data.root={tmp_path / 'grey'}", *printed,
                        "--output", str(tmp_path / "stats.json")]) == 0
    assert "WARNING" not in capsys.readouterr().out
    (described,) = json.loads((tmp_path / "stats.json").read_text())["splits"]["all"]["image_formats"]
    assert described["bits"] == 16 and described["value_range"] == [[100.0], [4095.0]]
    assert described["mean_in_image_units"] == [round(values.mean(), 1)]

    bands = [rng.integers(0, 256, (16, 20, 4), dtype=np.uint8) for _ in range(2)]
    make_image_folder(tmp_path / "rgbn", bands, suffix=".png")
    assert verify.main(["--config", "demo.yaml", *folder, f"data.root={tmp_path / 'rgbn'}"]) == 0
    out = capsys.readouterr().out
    assert "data.in_channels=3 with data.max_value=255 reads them as RGB (the 4th channel dropped)" in out
    pixels = np.stack(bands).reshape(-1, 4).astype(np.float64)
    assert _printed_command_line(out) == [
        "data.in_channels=4", "data.max_value=255",
        "data.mean=" + ",".join(f"{round(v / 255, 4):g}" for v in pixels.mean(0)),
        "data.std=" + ",".join(f"{round(v / 255, 4):g}" for v in pixels.std(0))]
    # read with 4 channels, a 3-channel image among them is a bad sample naming both counts
    cv2_rgb = np.zeros((16, 20, 3), np.uint8)
    Image.fromarray(cv2_rgb).save(tmp_path / "rgbn" / "images" / "1.png")
    assert verify.main(["--config", "demo.yaml", *folder, f"data.root={tmp_path / 'rgbn'}",
                        *_printed_command_line(out)]) == 1
    assert "1.png' has 3 channel(s) but data.in_channels=4 expects 4" in capsys.readouterr().out


def _multi_band_folder(root, bands: int, *, planar: bool, seed: int = 0) -> dict[str, list[np.ndarray]]:
    """A folder dataset of 8-bit TIFFs of `bands` bands, each band on its own range so that every channel's mean
    and std differ, stored as planes (planar) or as samples (interleaved); sparse masks (classes 0-2 on a few
    pixels, 255 elsewhere); train.txt (4 names) and val.txt (2). Returns the H x W x bands images per split."""
    import tifffile

    rng = np.random.default_rng([seed, bands])
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    images: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    for index in range(6):
        split = "train" if index < 4 else "val"
        low = np.arange(bands) * 7
        image = (low + rng.integers(0, 256 - low, (24, 20, bands))).astype(np.uint8)
        stored = np.moveaxis(image, -1, 0) if planar else image
        tifffile.imwrite(root / "images" / f"{index}.tif", stored, photometric="minisblack",
                         planarconfig="separate" if planar else "contig")
        mask = np.full((24, 20), 255, np.uint8)
        mask[2:5, 3:6], mask[10:12, 4:9], mask[18:20, 12:18] = 0, 1, 2
        Image.fromarray(mask).save(root / "masks" / f"{index}.png")
        images[split].append(image)
    (root / "train.txt").write_text("0\n1\n2\n3\n")
    (root / "val.txt").write_text("4\n5\n")
    return images


def _channel_figures(images: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std of 8-bit images in units of 255, from numpy in float64 over all their pixels."""
    pixels = np.concatenate([image.reshape(-1, image.shape[2]) for image in images]).astype(np.float64)
    return pixels.mean(0) / 255, pixels.std(0) / 255


def _numbers(text: str) -> np.ndarray:
    return np.array([float(value) for value in text.strip("[]").split(",")])


def _check_printed_lines(printed: list[str], images: list[np.ndarray]) -> None:
    """The printed command line reads these images: their channel count, 255, and numpy's mean and std to
    the 4 printed decimals (half a unit of the last one, and a hair for the rounding of the sums)."""
    mean, std = _channel_figures(images)
    assert printed[:2] == [f"data.in_channels={images[0].shape[2]}", "data.max_value=255"], printed
    assert [item.split("=")[0] for item in printed[2:]] == ["data.mean", "data.std"], printed
    np.testing.assert_allclose(_numbers(printed[2].split("=")[1]), mean, rtol=0, atol=0.5e-4 + 1e-9)
    np.testing.assert_allclose(_numbers(printed[3].split("=")[1]), std, rtol=0, atol=0.5e-4 + 1e-9)


@pytest.mark.parametrize("bands,planar", [(6, True), (6, False), (13, True), (13, False)],
                         ids=["6-planar", "6-interleaved", "13-planar", "13-interleaved"])
def test_verify_dataset_reads_multi_band_tiffs_as_stored_whatever_the_config_says(tmp_path, capfd, bands, planar):
    """Issue 32 item 1. With the default config (8-bit RGB, which no reader takes from a file of more than 4
    bands) each image is one BAD line naming the file and the keys that read it, and the one set of config
    lines comes from the training split; no decoder's own text reaches stderr. With data.in_channels=N and no
    mean or std (the tool measures them) it runs too, clean, and prints the same lines."""
    verify = _load_script("verify_dataset")
    root = tmp_path / "data"
    images = _multi_band_folder(root, bands, planar=planar)
    folder = ["data.dataset=folder", f"data.root={root}", "data.num_classes=3"]
    assert verify.main(["--config", "demo.yaml", *folder]) == 1
    out, err = capfd.readouterr()
    assert err == ""  # no OpenCV, libtiff, Pillow or tifffile lines
    bad = [line for line in out.splitlines() if "BAD:" in line]
    assert len(bad) == 6, out
    for index, line in enumerate(bad):
        assert line.startswith(f"  BAD: image '{root / 'images' / f'{index}.tif'}' is a TIFF of {bands} bands (8-bit), "
                               "but data.in_channels=3 with data.max_value=255 reads images as 8-bit RGB"), line
        assert f"set data.in_channels={bands} and data.max_value to 255" in line
    printed = _printed_command_line(out)  # exactly one such line: one set, from the training split
    _check_printed_lines(printed, images["train"])
    assert out.count("config lines from split") == 1 and "config lines from split 'train'" in out
    (mean_line,) = [line for line in out.splitlines() if line.startswith("    mean: ")]
    assert "val: [" in mean_line  # the validation split's figures beside them, as a comment
    np.testing.assert_allclose(_numbers(mean_line.split("val: ")[1]), _channel_figures(images["val"])[0],
                               rtol=0, atol=0.5e-4 + 1e-9)

    assert verify.main(["--config", "demo.yaml", *folder, f"data.in_channels={bands}"]) == 0
    out, err = capfd.readouterr()
    assert err == "" and "BAD" not in out and "WARNING" not in out, out
    assert _printed_command_line(out) == printed
