"""Backbones: output strides, the atrous conversion, ImageNet / file weights."""
import logging
import os
from urllib.parse import urlparse

import pytest
import torch
import torchvision
from torch import nn

from syncseg.engine.config import choices
from syncseg.model.backbones import ResNetBackbone, build_backbone, imagenet_weights_file
from syncseg.model.registry import BACKBONES


def _randomize_batchnorm(module: nn.Module, seed: int = 0) -> None:
    """Non-trivial running statistics and affine parameters, so eval-mode BN is not an identity."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.BatchNorm2d):
                n = m.num_features
                m.running_mean.copy_(torch.rand(n, generator=generator) - 0.5)
                m.running_var.copy_(torch.rand(n, generator=generator) + 0.5)
                m.weight.copy_(torch.rand(n, generator=generator) + 0.5)
                m.bias.copy_(torch.rand(n, generator=generator) - 0.5)


@pytest.mark.parametrize("name", choices("model.backbone"))
@pytest.mark.parametrize("output_stride", [8, 16, 32])
def test_feature_strides_and_channels(name, output_stride):
    backbone = build_backbone(name, output_stride=output_stride, norm_layer=nn.BatchNorm2d).eval()
    with torch.no_grad():
        features = backbone(torch.randn(1, 3, 64, 96))
    # resnet: layer3, mobilenet_v2: block 13 (both at 16 when nothing is dilated), mobilenet_v3: block 4
    aux_stride = 8 if name == "mobilenet_v3_large" else min(output_stride, 16)
    expected = {"low_level": 4, "aux": aux_stride, "out": output_stride}
    channels = {"low_level": backbone.low_level_channels, "aux": backbone.aux_channels, "out": backbone.out_channels}
    for key, stride in expected.items():
        assert features[key].shape == (1, channels[key], 64 // stride, 96 // stride), key


@pytest.mark.parametrize("name", ["resnet18", pytest.param("resnet34", marks=pytest.mark.slow),
                                  pytest.param("resnet50", marks=pytest.mark.slow)])
@pytest.mark.parametrize("output_stride", [8, 16])
def test_dilation_is_the_exact_atrous_conversion(name, output_stride):
    """Eval mode: the dilated network's features, subsampled, equal the undilated (stride 32) network's.

    resnet50 uses torchvision's own replace_stride_with_dilation, so it shows the reference property
    that our BasicBlock conversion (resnet18/34) must share.
    """
    torch.manual_seed(0)
    reference = ResNetBackbone(getattr(torchvision.models, name)(weights=None)).eval()
    _randomize_batchnorm(reference)
    dilated = build_backbone(name, output_stride=output_stride, norm_layer=nn.BatchNorm2d).eval()
    dilated.load_state_dict(reference.state_dict())
    # float64: the property is exact, so float32 summation-order noise must not hide a wrong tap
    reference, dilated = reference.double(), dilated.double()
    x = torch.randn(1, 3, 67, 53, dtype=torch.float64)
    with torch.no_grad():
        expected, actual = reference(x), dilated(x)
    step = 32 // output_stride
    torch.testing.assert_close(actual["out"][..., ::step, ::step], expected["out"], atol=1e-9, rtol=1e-9)
    aux_step = 16 // (8 if output_stride == 8 else 16)
    torch.testing.assert_close(actual["aux"][..., ::aux_step, ::aux_step], expected["aux"], atol=1e-9, rtol=1e-9)
    # and the dilation really happened (a stride-32 copy would fail the shape check above only for OS 8/16)
    assert actual["out"].shape[-1] > expected["out"].shape[-1]


@pytest.mark.parametrize("output_stride", [8, 16])
def test_mobilenet_v2_dilation_is_the_exact_atrous_conversion(output_stride):
    """torchvision's MobileNetV2 (stride 32) is the reference: subsampling the dilated features gives its."""
    from syncseg.model.backbones import MobileNetBackbone

    torch.manual_seed(0)
    features = list(torchvision.models.mobilenet_v2(weights=None).features)[:-1]
    reference = MobileNetBackbone(features, low_level_index=3, aux_index=13).eval()
    _randomize_batchnorm(reference)
    dilated = build_backbone("mobilenet_v2", output_stride=output_stride, norm_layer=nn.BatchNorm2d).eval()
    dilated.load_state_dict(reference.state_dict())
    reference, dilated = reference.double(), dilated.double()
    x = torch.randn(1, 3, 45, 37, dtype=torch.float64)
    with torch.no_grad():
        expected, actual = reference(x), dilated(x)
    step = 32 // output_stride
    torch.testing.assert_close(actual["out"][..., ::step, ::step], expected["out"], atol=1e-9, rtol=1e-9)
    aux_step = 16 // output_stride
    torch.testing.assert_close(actual["aux"][..., ::aux_step, ::aux_step], expected["aux"], atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(actual["low_level"], expected["low_level"], atol=1e-9, rtol=1e-9)
    assert actual["out"].shape[-1] > expected["out"].shape[-1]
    # the formerly strided depthwise conv (block 14) keeps the previous dilation, the ones after it double it
    dilations = [conv.dilation[0] for name, conv in dilated.named_modules()
                 if isinstance(conv, nn.Conv2d) and conv.kernel_size[0] == 3 and int(name.split(".")[0]) >= 14]
    assert dilations == ([1, 2, 2, 2] if output_stride == 16 else [2, 4, 4, 4])


def _conv_geometry(module: nn.Module) -> list[tuple]:
    return [(name, m.stride, m.dilation, m.padding) for name, m in module.named_modules() if isinstance(m, nn.Conv2d)]


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "mobilenet_v2", "mobilenet_v3_large"])
def test_output_stride_32_is_torchvision_network_undilated(name):
    ours = build_backbone(name, output_stride=32, norm_layer=nn.BatchNorm2d)
    reference = getattr(torchvision.models, name)(weights=None)
    reference_convs = dict((module_name.removeprefix("features."), rest) for module_name, *rest
                           in _conv_geometry(reference))
    ours_convs = _conv_geometry(ours)
    assert len(ours_convs) >= 19
    for module_name, *geometry in ours_convs:
        assert geometry == reference_convs[module_name], module_name
        assert geometry[1] == (1, 1), module_name  # no dilation anywhere


def test_mobilenet_output_stride_16_matches_torchvision_dilated():
    ours = build_backbone("mobilenet_v3_large", output_stride=16, norm_layer=nn.BatchNorm2d)
    reference = torchvision.models.mobilenet_v3_large(weights=None, dilated=True).features
    assert _conv_geometry(ours) == _conv_geometry(reference)


def test_mobilenet_output_stride_8_dilates_two_stages():
    ours = build_backbone("mobilenet_v3_large", output_stride=8, norm_layer=nn.BatchNorm2d)
    plain = dict((name, rest) for name, *rest in _conv_geometry(torchvision.models.mobilenet_v3_large(weights=None).features))
    for name, module in ours.named_modules():
        if not isinstance(module, nn.Conv2d):
            continue
        block = int(name.split(".")[0])
        geometry = [module.stride, module.dilation, module.padding]
        kernel = module.kernel_size[0]
        if module.kernel_size[0] > 1 and 7 <= block <= 12:  # output stride 16 stage
            assert geometry == [(1, 1), (2, 2), ((kernel - 1), (kernel - 1))], name
        elif module.kernel_size[0] > 1 and 13 <= block <= 15:  # output stride 32 stage
            assert geometry == [(1, 1), (4, 4), (2 * (kernel - 1), 2 * (kernel - 1))], name
        else:
            assert geometry == plain[name], name


def _fake_imagenet_file(name, torch_home, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(torch_home))
    weights = torchvision.models.get_weight(BACKBONES.get(name).imagenet_weights)
    folder = torch_home / "hub" / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(1)
    classifier = getattr(torchvision.models, name)(weights=None)
    _randomize_batchnorm(classifier, seed=3)
    path = folder / os.path.basename(urlparse(weights.url).path)
    torch.save(classifier.state_dict(), path)
    return classifier.state_dict(), path


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_large", "mobilenet_v2"])
def test_imagenet_weights_load_strictly_from_the_hub_cache(name, tmp_path, monkeypatch):
    state, path = _fake_imagenet_file(name, tmp_path, monkeypatch)
    assert imagenet_weights_file(name) == path
    backbone = build_backbone(name, output_stride=16, norm_layer=nn.BatchNorm2d, pretrained="imagenet")
    loaded = backbone.state_dict()
    prefix = "features." if name.startswith("mobilenet") else ""
    # the ImageNet classifier; MobileNetV2's 1x1 conv to 1280 channels (features.18) belongs to it too
    expected = {k: v for k, v in state.items() if not k.startswith(("fc.", "classifier.", "features.18."))}
    assert len(loaded) == len(expected)
    for key, value in expected.items():
        assert torch.equal(loaded[key[len(prefix):]], value), key


@pytest.mark.parametrize("name", ["resnet50", "resnet101"])
def test_torchvision_resnet_state_dict_loads_strictly(name):
    classifier = getattr(torchvision.models, name)(weights=None)
    backbone = build_backbone(name, output_stride=8, norm_layer=nn.BatchNorm2d)
    state = {k: v for k, v in classifier.state_dict().items() if not k.startswith("fc.")}
    backbone.load_state_dict(state, strict=True)


def test_missing_imagenet_file_names_file_and_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError) as error:
        build_backbone("resnet50", output_stride=16, norm_layer=nn.BatchNorm2d, pretrained="imagenet")
    message = str(error.value)
    expected_name = os.path.basename(urlparse(torchvision.models.ResNet50_Weights.IMAGENET1K_V1.url).path)
    assert expected_name in message
    assert str(tmp_path / "hub" / "checkpoints") in message


def test_path_weights_report_missing_and_unexpected_keys(tmp_path, caplog):
    state = torchvision.models.resnet18(weights=None).state_dict()
    kept = dict(state)
    removed = kept.pop("layer4.1.bn2.weight")
    kept["extra.weight"] = torch.zeros(3)
    path = tmp_path / "backbone.pth"
    torch.save(kept, path)
    with caplog.at_level(logging.WARNING, logger="syncseg.model.backbones"):
        backbone = build_backbone("resnet18", output_stride=16, norm_layer=nn.BatchNorm2d, pretrained=str(path))
    assert "layer4.1.bn2.weight" in caplog.text and "extra.weight" in caplog.text
    assert torch.equal(backbone.state_dict()["layer1.0.conv1.weight"], state["layer1.0.conv1.weight"])
    assert removed.shape == backbone.layer4[1].bn2.weight.shape


def test_path_weights_with_wrong_shapes_fail(tmp_path):
    path = tmp_path / "resnet50.pth"
    torch.save(torchvision.models.resnet50(weights=None).state_dict(), path)
    with pytest.raises(ValueError, match="shape mismatch"):
        build_backbone("resnet18", output_stride=16, norm_layer=nn.BatchNorm2d, pretrained=str(path))


def test_missing_or_corrupt_path_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.pth"):
        build_backbone("resnet18", output_stride=16, norm_layer=nn.BatchNorm2d, pretrained=str(tmp_path / "nowhere.pth"))
    corrupt = tmp_path / "corrupt.pth"
    corrupt.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="corrupt.pth"):
        build_backbone("resnet18", output_stride=16, norm_layer=nn.BatchNorm2d, pretrained=str(corrupt))


def test_unwrap_state_dict_is_the_one_rule_for_wrapped_weight_files():
    """Backbone weight files and model.init_checkpoint (syncseg.engine.checkpoint_file.load_weights_file) unwrap alike."""
    from syncseg.model.backbones import unwrap_state_dict

    tensors = {"conv.weight": torch.zeros(1)}
    assert unwrap_state_dict(tensors) == (tensors, "")
    assert unwrap_state_dict({"state_dict": tensors, "epoch": 3}) == (tensors, "state_dict")
    assert unwrap_state_dict({"model": tensors, "format_version": 1}) == (tensors, "model")
    for bad in ({}, {"model": {}}, {"a": 1}, [torch.zeros(1)], {1: torch.zeros(1)}):
        assert unwrap_state_dict(bad) == (None, "")
