"""The data that trains wrong without failing (issue 34, item 5): each case warns once at the start of training
(build_training, before any step) and in verify_dataset's output, in the same words, naming the files and the
config key or file to change. Clean data gives no warning in either."""
from __future__ import annotations

import logging
import re

import numpy as np
from PIL import Image

from syncseg.commands import verify_dataset
from syncseg.data.images import read_image
from syncseg.data.masks import BadSampleError
from syncseg.engine.build import build_training
from syncseg.engine.config import load_config
from syncseg.engine.distributed import DistInfo
from tests.data.conftest import make_image_folder, synthetic_pair, write_image

TINY = ["data.dataset=folder", "data.train_split=all", "data.val_split=all", "data.num_classes=2",
        "data.crop_size=16", "data.num_workers=0", "model.head_channels=8", "model.aspp_rates=1",
        "train.batch_size=2", "train.num_vis_images=0", "eval.batch_size=1"]


def _warnings(tmp_path, root, caplog, capsys, *overrides: str) -> tuple[list[str], list[str]]:
    """(the data warnings build_training logs, the WARNING lines verify_dataset prints) for the folder `root`."""
    settings = [f"data.root={root}", *TINY, *overrides]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        build_training(load_config("demo.yaml", [f"output_dir={tmp_path / 'run'}", *settings]), DistInfo())
    training = [record.getMessage() for record in caplog.records if record.name.startswith("syncseg.data")]
    capsys.readouterr()
    status = verify_dataset.main(["--config", "demo.yaml", *settings])
    assert status == 0, capsys.readouterr()
    printed = [line.split("WARNING: ", 1)[1] for line in capsys.readouterr().out.splitlines() if "WARNING: " in line]
    return training, printed


def _once_in_both(training: list[str], printed: list[str], pattern: str) -> str:
    """The one warning matching `pattern`, the same in training's log and verify_dataset's output."""
    found = [message for message in training if re.search(pattern, message)]
    assert len(found) == 1, training
    assert [line for line in printed if re.search(pattern, line)] == found, printed
    return found[0]


def _pairs(root, count: int = 3, *, size: int = 16) -> None:
    """images/s<i>.png (8-bit RGB) and masks/s<i>.png (classes 0 and 1): clean data."""
    (root / "masks").mkdir(parents=True, exist_ok=True)
    for index in range(count):
        image, mask = synthetic_pair(index, size, num_classes=2)
        write_image(root / "images" / f"s{index}.png", image)
        Image.fromarray(mask.astype(np.uint8)).save(root / "masks" / f"s{index}.png")


def test_clean_data_and_a_grey_photo_among_colour_ones_give_no_warning(tmp_path, caplog, capsys):
    _pairs(tmp_path / "clean")
    write_image(tmp_path / "clean" / "images" / "s1.png", synthetic_pair(1, 16)[0][..., 0])  # tripled, as photos are
    assert _warnings(tmp_path, tmp_path / "clean", caplog, capsys) == ([], [])


def test_12_bit_images_read_as_8_bit(tmp_path, caplog, capsys):
    rng = np.random.default_rng(0)
    grey = [rng.integers(0, 4096, (16, 16)).astype(np.uint16) for _ in range(4)]
    grey[3][0, 0] = 4095  # 12-bit: in 8 bits they train on 0..15
    make_image_folder(tmp_path / "grey", grey, suffix=".tif")
    message = _once_in_both(*_warnings(tmp_path, tmp_path / "grey", caplog, capsys), "16-bit")
    images = tmp_path / "grey" / "images"
    assert (f"4 of the 4 images checked ('{images / '0.tif'}', '{images / '1.tif'}', '{images / '2.tif'}' and 1 "
            "more) are 16-bit (values up to 4095)") in message
    assert "cut to their top 8 bits; to read them as stored, set data.in_channels=1 and data.max_value=4095" in message


def test_binary_0_255_masks_with_three_classes(tmp_path, caplog, capsys):
    _pairs(tmp_path / "binary")
    for mask in (tmp_path / "binary" / "masks").iterdir():
        Image.fromarray((np.asarray(Image.open(mask)) * 255).astype(np.uint8)).save(mask)
    message = _once_in_both(*_warnings(tmp_path, tmp_path / "binary", caplog, capsys, "data.num_classes=3"),
                            "only the values 0 and 255")
    assert "with data.num_classes=3 the value 255 is data.ignore_index: those pixels are ignored" in message
    assert message.endswith("(command line: data.label_map=255:1)")


def test_a_multi_page_mask(tmp_path, caplog, capsys):
    _pairs(tmp_path / "pages")
    path = tmp_path / "pages" / "masks" / "s1.png"
    first = Image.open(path).copy()
    first.save(path, format="TIFF", save_all=True, append_images=[first.point(lambda value: 1 - value)])
    message = _once_in_both(*_warnings(tmp_path, tmp_path / "pages", caplog, capsys), "more than one page")
    assert f"1 of the 3 masks checked hold more than one page or frame ('{path}' (2 pages)); only the first" in message


def test_a_2_channel_image_among_rgb_ones(tmp_path, caplog, capsys):
    _pairs(tmp_path / "two")
    (tmp_path / "two" / "images" / "s2.png").unlink()
    write_image(tmp_path / "two" / "images" / "s2.tif", synthetic_pair(2, 16)[0][..., :2].copy())
    message = _once_in_both(*_warnings(tmp_path, tmp_path / "two", caplog, capsys), "2-channel")
    assert (f"1 of the 3 images checked ('{tmp_path / 'two' / 'images' / 's2.tif'}') is 2-channel, fewer than "
            "data.in_channels=3: read as RGB, the first channel is tripled and the second dropped; to read them as "
            "stored, set data.in_channels=2") in message


def test_two_images_of_one_name(tmp_path, caplog, capsys):
    _pairs(tmp_path / "stems")
    write_image(tmp_path / "stems" / "images" / "s0.jpg", synthetic_pair(9, 16)[0])
    message = _once_in_both(*_warnings(tmp_path, tmp_path / "stems", caplog, capsys), "more than one image file")
    assert ("1 name(s) have more than one image file in "
            f"'{tmp_path / 'stems' / 'images'}' ('s0': s0.jpg, s0.png (reads s0.png)); one name, one image") in message


def test_a_name_listed_twice_in_a_split(tmp_path, caplog, capsys):
    _pairs(tmp_path / "lists")
    (tmp_path / "lists" / "train.txt").write_text("s0\ns1\ns0\n")
    (tmp_path / "lists" / "val.txt").write_text("s2\n")
    training, printed = _warnings(tmp_path, tmp_path / "lists", caplog, capsys, "data.train_split=train",
                                  "data.val_split=val")
    message = _once_in_both(training, printed, "more than once")
    assert message == (f"folder train ({tmp_path / 'lists'}): '{tmp_path / 'lists' / 'train.txt'}' lists 1 name(s) "
                       "more than once ('s0' (2 times)); each is used as often as it is listed: unless that "
                       f"oversampling is meant, remove the repeated lines from '{tmp_path / 'lists' / 'train.txt'}'")


def test_a_damaged_image_is_one_line_without_the_decoders_chatter(tmp_path, capfd):
    good = tmp_path / "good.png"
    write_image(good, synthetic_pair(0, 16)[0])
    damaged = tmp_path / "damaged.png"
    damaged.write_bytes(good.read_bytes()[:30])  # a header cut short: cv2 logged [ WARN] and [ERROR] lines
    try:
        read_image(damaged)
    except BadSampleError as error:
        message = str(error)
    assert capfd.readouterr().err == ""
    assert message == f"cannot read image '{damaged}' (not an image, or damaged at its start)"
