"""Images beyond 8-bit RGB (data/images.py): 1, 3 and N channels, 8 and 16 bits, PNG and TIFF, read as
stored and checked against data.in_channels / data.max_value; the 8-bit RGB reader unchanged."""
from __future__ import annotations

import cv2
import numpy as np
import pytest
import tifffile
import torch
from PIL import Image

from syncseg import data
from syncseg.data.images import ImageFormat, display_rgb, read_image, read_stored_image
from syncseg.data.masks import BadSampleError
from syncseg.engine.config import DataConfig
from tests.data.conftest import make_image_folder

TWELVE_BIT = ImageFormat(channels=1, max_value=4095)


def _twelve_bit(height: int = 20, width: int = 24, *, seed: int = 0) -> np.ndarray:
    """H x W uint16 values 0..4095 with both ends present and values that are no multiple of 16."""
    values = np.random.default_rng(seed).integers(0, 4096, (height, width)).astype(np.uint16)
    values[0, 0], values[0, 1], values[0, 2] = 0, 4095, 1
    return values


def test_16_bit_grey_png_and_tiff_keep_every_value(tmp_path):
    values = _twelve_bit()
    assert cv2.imwrite(str(tmp_path / "grey.png"), values)
    tifffile.imwrite(tmp_path / "grey.tif", values)
    for name in ("grey.png", "grey.tif"):
        image = read_image(tmp_path / name, TWELVE_BIT)
        assert image.dtype == np.uint16 and image.shape == (20, 24, 1)
        assert np.array_equal(image[..., 0], values)
    # what the 8-bit RGB reader did to it (and still does by default): three copies of the top 8 bits
    cut = read_image(tmp_path / "grey.png")
    assert cut.dtype == np.uint8 and cut.shape == (20, 24, 3) and cut.max() <= 4095 >> 4


def test_four_channel_png_comes_back_in_its_stored_order(tmp_path):
    rgbn = np.random.default_rng(1).integers(0, 256, (12, 10, 4), dtype=np.uint8)
    Image.fromarray(rgbn, mode="RGBA").save(tmp_path / "rgbn.png")  # R, G, B and NIR in the alpha slot
    image = read_image(tmp_path / "rgbn.png", ImageFormat(channels=4))
    assert image.dtype == np.uint8 and np.array_equal(image, rgbn)
    sixteen = (rgbn.astype(np.uint16) * 257)
    assert cv2.imwrite(str(tmp_path / "rgbn16.png"), sixteen[..., [2, 1, 0, 3]])  # cv2 writes BGRA
    assert np.array_equal(read_image(tmp_path / "rgbn16.png", ImageFormat(4, 65535)), sixteen)


@pytest.mark.parametrize("layout", ["samples", "planes", "pages"])
def test_multi_band_tiff_reads_as_height_width_bands_in_any_layout(tmp_path, layout):
    bands = np.random.default_rng(2).integers(0, 65536, (9, 11, 6)).astype(np.uint16)
    path = tmp_path / "bands.tif"
    if layout == "samples":
        tifffile.imwrite(path, bands, photometric="minisblack", planarconfig="contig")
    elif layout == "planes":
        tifffile.imwrite(path, np.moveaxis(bands, -1, 0), photometric="minisblack", planarconfig="separate")
    else:
        tifffile.imwrite(path, np.moveaxis(bands, -1, 0), photometric="minisblack")  # one page per band
    assert np.array_equal(read_image(path, ImageFormat(6, 65535)), bands)


def test_a_channel_count_or_bit_depth_other_than_the_configs_names_the_file_and_both(tmp_path):
    values = _twelve_bit()
    assert cv2.imwrite(str(tmp_path / "grey16.png"), values)
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "rgb.png")
    with pytest.raises(BadSampleError) as error:
        read_image(tmp_path / "grey16.png", ImageFormat(channels=4, max_value=4095))
    assert str(error.value) == (f"image '{tmp_path / 'grey16.png'}' has 1 channel(s) but data.in_channels=4 expects "
                                "4; set data.in_channels to the images' channel count, or convert the image")
    with pytest.raises(BadSampleError, match=r"grey16\.png' is 16-bit but data\.max_value=255 expects 8-bit images; "
                                             "set data.max_value to their full scale"):
        read_image(tmp_path / "grey16.png", ImageFormat(channels=1))
    with pytest.raises(BadSampleError, match=r"rgb\.png' is 8-bit but data\.max_value=4095 expects 16-bit images"):
        read_image(tmp_path / "rgb.png", ImageFormat(channels=3, max_value=4095))


def test_samples_that_are_not_8_or_16_bit_unsigned_are_refused_by_name(tmp_path):
    tifffile.imwrite(tmp_path / "float.tif", np.zeros((4, 5), np.float32))
    with pytest.raises(BadSampleError, match=r"float\.tif' holds float32 samples; expected 8- or 16-bit unsigned"):
        read_stored_image(tmp_path / "float.tif")
    (tmp_path / "broken.tif").write_bytes(b"II*\x00" + b"\x00" * 20)
    with pytest.raises(BadSampleError, match=r"cannot read TIFF image '.*broken\.tif'"):
        read_stored_image(tmp_path / "broken.tif")


def test_the_8_bit_rgb_reader_is_cv2s_colour_reader(tmp_path):
    grey = np.random.default_rng(3).integers(0, 256, (6, 7), dtype=np.uint8)
    Image.fromarray(grey, mode="L").save(tmp_path / "grey.png")
    expected = cv2.imread(str(tmp_path / "grey.png"), cv2.IMREAD_COLOR_RGB)
    assert np.array_equal(read_image(tmp_path / "grey.png"), expected) and expected.shape == (6, 7, 3)


@pytest.mark.parametrize("bands,bits", [(6, 8), (13, 16)])
def test_the_8_bit_rgb_reader_names_a_tiff_of_more_bands_than_it_reads_without_the_decoders_chatter(
        tmp_path, capfd, bands, bits):
    """Issue 32 item 1: cv2 cannot decode a TIFF of more than 4 bands (and Pillow logs about it): its header is
    read first, and the error names the band count and the keys that read the file as stored."""
    image = np.zeros((bands, 5, 6), np.uint8 if bits == 8 else np.uint16)
    tifffile.imwrite(tmp_path / "many.tif", image, photometric="minisblack", planarconfig="separate")
    scale = "255" if bits == 8 else "its full scale (4095 for 12-bit values, 65535 for 16-bit)"
    with pytest.raises(BadSampleError) as error:
        read_image(tmp_path / "many.tif")
    assert str(error.value) == (
        f"image '{tmp_path / 'many.tif'}' is a TIFF of {bands} bands ({bits}-bit), but data.in_channels=3 with "
        "data.max_value=255 reads images as 8-bit RGB, from files of 1 to 4 channels; to read it as stored, set "
        f"data.in_channels={bands} and data.max_value to {scale} (`python -m syncseg verify` prints these with their "
        "data.mean and data.std)")
    make_image_folder(tmp_path / "folder", [np.moveaxis(image, 0, -1)], suffix=".tif")
    dataset = data.FolderSegmentation(tmp_path / "folder", "all", num_classes=2)
    assert dataset.image_size(0) == (5, 6)  # the eval loader's size lookup reads the header, not Pillow
    assert capfd.readouterr().err == ""
    rgb = np.random.default_rng(4).integers(0, 256, (5, 6, 3), dtype=np.uint8)
    tifffile.imwrite(tmp_path / "rgb.tif", rgb, photometric="rgb")
    assert np.array_equal(read_image(tmp_path / "rgb.tif"), rgb)  # 3 bands still go to cv2's colour reader


def test_display_rgb_scales_to_8_bits_and_leaves_8_bit_rgb_alone():
    rgb = np.random.default_rng(4).integers(0, 256, (3, 4, 3), dtype=np.uint8)
    assert display_rgb(rgb, 255) is rgb
    grey = np.array([[[0], [4095], [2048]]], dtype=np.uint16)
    shown = display_rgb(grey, 4095)
    assert shown.dtype == np.uint8 and np.array_equal(shown[..., 0], [[0, 255, 128]])
    assert np.array_equal(shown[..., 0], shown[..., 2])
    five = np.arange(5, dtype=np.uint8).reshape(1, 1, 5) * 50
    assert display_rgb(five, 255).tolist() == [[[0, 50, 100]]]


def test_a_folder_dataset_of_16_bit_tiffs_yields_uint16_tensors_of_the_configured_channels(tmp_path):
    images = [_twelve_bit(seed=seed) for seed in range(3)]
    make_image_folder(tmp_path, images, suffix=".tif")
    cfg = DataConfig(dataset="folder", root=str(tmp_path), num_classes=2, in_channels=1, max_value=4095,
                     mean=(0.5,), std=(0.25,), crop_size=(16, 16))
    evaluation = data.build_dataset(cfg, "all", train=False)
    image, mask = evaluation[1]
    assert image.dtype == torch.uint16 and image.shape == (1, 20, 24) and mask.shape == (20, 24)
    assert torch.equal(image[0].to(torch.int32), torch.from_numpy(images[1].astype(np.int32)))
    crop, _ = data.build_dataset(cfg, "all", train=True)[0]
    assert crop.dtype == torch.uint16 and crop.shape == (1, 16, 16)
    wrong = data.build_dataset(DataConfig(dataset="folder", root=str(tmp_path), num_classes=2, in_channels=2,
                                          max_value=4095, mean=(0.5, 0.5), std=(0.2, 0.2)), "all", train=False)
    with pytest.raises(BadSampleError, match=r"0\.tif' has 1 channel\(s\) but data\.in_channels=2 expects 2"):
        wrong[0]
