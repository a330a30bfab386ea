"""A backbone's first convolution for data.in_channels other than 3 (model/input_channels.py): the sum of
the RGB filters for 1 channel, the RGB filters repeated cyclically and scaled by 3/N otherwise, checked
against float64 recomputations, through whole pretrained backbones, torchvision's and timm's."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from syncseg.engine.config import ModelConfig
from syncseg.model.backbones import build_backbone
from syncseg.model.builder import build_model
from syncseg.model.input_channels import adapt_input_channels, first_convolution, rgb_filters_for
from syncseg.model.weights import load_segmentation_weights
from tests.model.test_backbones import _randomize_batchnorm


def test_adapted_filters_equal_their_float64_recomputation():
    rgb = torch.randn(8, 3, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    image = torch.randn(2, 1, 12, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grey = rgb_filters_for(rgb.float(), 1).double()
    # a grey image through the summed filters is the RGB convolution of that image repeated 3 times
    torch.testing.assert_close(F.conv2d(image, grey), F.conv2d(image.repeat(1, 3, 1, 1), rgb), rtol=0, atol=1e-5)
    for channels in (2, 4, 6, 7):
        adapted = rgb_filters_for(rgb.float(), channels).double()
        bands = torch.randn(2, channels, 12, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(channels))
        expected = sum(F.conv2d(bands[:, k:k + 1], rgb[:, k % 3:k % 3 + 1]) for k in range(channels)) * 3 / channels
        torch.testing.assert_close(F.conv2d(bands, adapted), expected, rtol=0, atol=1e-5)
    # six channels R, G, B, R, G, B see exactly what RGB saw
    rgb_image = image.repeat(1, 3, 1, 1) + torch.arange(3, dtype=torch.float64).view(1, 3, 1, 1)
    torch.testing.assert_close(F.conv2d(rgb_image.repeat(1, 2, 1, 1), rgb_filters_for(rgb, 6)),
                               F.conv2d(rgb_image, rgb), rtol=0, atol=1e-12)


def _weights_file(tmp_path, name: str) -> str:
    """A 'pretrained' RGB weights file for backbone `name`: random filters, non-trivial BatchNorm."""
    if name.startswith("timm:"):
        import timm

        network = timm.create_model(name[len("timm:"):], num_classes=10)
    else:
        network = build_backbone(name, output_stride=16, norm_layer=nn.BatchNorm2d)
    _randomize_batchnorm(network)
    path = tmp_path / "weights.pt"
    torch.save(network.state_dict(), path)
    return str(path)


@pytest.mark.parametrize("name", ["resnet18", "timm:resnet18", pytest.param("mobilenet_v2", marks=pytest.mark.slow),
                                  pytest.param("mobilenet_v3_large", marks=pytest.mark.slow)])
def test_a_pretrained_backbone_sees_a_grey_or_repeated_image_as_its_rgb_original(name, tmp_path, caplog):
    if name.startswith("timm:"):
        pytest.importorskip("timm")
    weights = _weights_file(tmp_path, name)
    rgb_backbone = build_backbone(name, output_stride=16, norm_layer=nn.BatchNorm2d, pretrained=weights)
    with caplog.at_level(logging.INFO, logger="syncseg.model.input_channels"):
        grey_backbone = build_backbone(name, output_stride=16, norm_layer=nn.BatchNorm2d, pretrained=weights,
                                       in_channels=1)
    six_backbone = build_backbone(name, output_stride=16, norm_layer=nn.BatchNorm2d, pretrained=weights,
                                  in_channels=6)
    path, conv = first_convolution(grey_backbone)
    (line,) = [record.getMessage() for record in caplog.records if record.name == "syncseg.model.input_channels"]
    assert line == (f"model.backbone={name}: first convolution '{path}' adapted from 3 to 1 input channel(s) "
                    f"(data.in_channels): the sum of its RGB filters (pretrained: {weights} weights)")
    assert conv.in_channels == 1 and conv.weight.shape[1] == 1
    generator = torch.Generator().manual_seed(2)
    grey, rgb = torch.rand(1, 1, 32, 32, generator=generator), torch.rand(1, 3, 32, 32, generator=generator)
    networks = [network.eval() for network in (rgb_backbone, grey_backbone, six_backbone)]
    with torch.no_grad():  # float32 (depthwise convolutions are slow in float64): equal to its rounding
        rgb_of_grey, rgb_of_rgb = networks[0](grey.repeat(1, 3, 1, 1))["out"], networks[0](rgb)["out"]
        for output, expected in ((networks[1](grey)["out"], rgb_of_grey),
                                 (networks[2](rgb.repeat(1, 2, 1, 1))["out"], rgb_of_rgb)):
            assert (output - expected).abs().max() <= 1e-5 * expected.abs().max()
    # every other tensor is the file's, untouched
    adapted = f"{path}.weight"
    assert all(torch.equal(value, grey_backbone.state_dict()[key]) for key, value in rgb_backbone.state_dict().items()
               if key != adapted)


def test_a_model_of_4_channels_takes_4_channel_images_and_rgb_models_are_unchanged():
    config = ModelConfig(arch="deeplabv3plus", backbone="resnet18", head_channels=16, aspp_rates=(1,))
    torch.manual_seed(0)
    rgb = build_model(config, 3)
    torch.manual_seed(0)
    assert all(torch.equal(a, b) for a, b in zip(rgb.state_dict().values(),
                                                  build_model(config, 3, in_channels=3).state_dict().values()))
    four = build_model(config, 3, in_channels=4).eval()
    assert four(torch.randn(1, 4, 32, 32))["out"].shape == (1, 3, 32, 32)
    assert four.backbone.conv1.weight.shape == (64, 4, 7, 7)


def test_a_first_convolution_that_does_not_read_rgb_cannot_be_adapted():
    stem = nn.Sequential(nn.Conv2d(4, 8, 3), nn.ReLU())
    with pytest.raises(ValueError, match=r"model.backbone=toy: its first convolution '0' takes 4 channel\(s\) in 1 "
                                         r"group\(s\), not RGB, so it cannot be adapted to data.in_channels=1"):
        adapt_input_channels(stem, 1, name="toy", weights="random")
    adapt_input_channels(stem, 3, name="toy", weights="random")  # 3 channels: nothing to adapt
    assert stem[0].in_channels == 4


def test_fine_tuning_from_an_rgb_segmentation_checkpoint_adapts_its_first_convolution():
    config = ModelConfig(arch="deeplabv3plus", backbone="resnet18", head_channels=16, aspp_rates=(1,))
    source = build_model(config, 3).state_dict()
    grey = build_model(config, 3, in_channels=1)
    report = load_segmentation_weights(grey, source)
    assert report.adapted == "backbone.conv1.weight from the file's RGB filters: the sum of its RGB filters"
    assert "(backbone.conv1.weight from the file's RGB filters" in report.summary() and not report.missing
    torch.testing.assert_close(grey.state_dict()["backbone.conv1.weight"],
                               source["backbone.conv1.weight"].sum(1, keepdim=True), rtol=0, atol=0)
    assert all(torch.equal(value, source[key]) for key, value in grey.state_dict().items()
               if key != "backbone.conv1.weight")
    # any other mis-shaped tensor is still an error
    source["backbone.layer1.0.conv1.weight"] = source["backbone.layer1.0.conv1.weight"][:, :32]
    with pytest.raises(ValueError, match="1 shape mismatch"):
        load_segmentation_weights(build_model(config, 3, in_channels=4), source)
