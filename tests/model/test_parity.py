"""Our deeplabv3 is torchvision's DeepLabV3: its state dict loads unchanged and outputs agree."""
import pytest
import torch
from torch import nn
from torchvision.models import segmentation

from syncseg.engine.config import ModelConfig
from syncseg.model.builder import build_model
from syncseg.model.sync_batchnorm import SynchronizedBatchNorm2d
from syncseg.model.weights import load_segmentation_weights


def _randomize_batchnorm(module: nn.Module) -> None:
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.BatchNorm2d):
                n = m.num_features
                m.running_mean.copy_(torch.rand(n, generator=generator) * 0.2 - 0.1)
                m.running_var.copy_(torch.rand(n, generator=generator) * 0.5 + 0.75)
                m.weight.copy_(torch.rand(n, generator=generator) * 0.5 + 0.5)
                m.bias.copy_(torch.rand(n, generator=generator) * 0.2 - 0.1)


CASES = {
    "resnet50": (segmentation.deeplabv3_resnet50, dict(backbone="resnet50", output_stride=8)),
    "resnet101": (segmentation.deeplabv3_resnet101, dict(backbone="resnet101", output_stride=8)),
    # torchvision's MobileNetV3 DeepLab runs at output stride 16 with the rates 12/24/36
    "mobilenet_v3_large": (
        segmentation.deeplabv3_mobilenet_v3_large,
        dict(backbone="mobilenet_v3_large", output_stride=16, aspp_rates=(12, 24, 36)),
    ),
}


def _pair(name):
    constructor, settings = CASES[name]
    torch.manual_seed(0)
    reference = constructor(weights=None, weights_backbone=None, num_classes=21, aux_loss=True)
    _randomize_batchnorm(reference)
    ours = build_model(ModelConfig(arch="deeplabv3", aux_loss=True, **settings), 21)
    report = load_segmentation_weights(ours, reference.state_dict())
    assert report.skipped == {} and report.missing == [] and len(report.loaded) == len(reference.state_dict())
    assert sum(isinstance(m, SynchronizedBatchNorm2d) for m in ours.modules()) == sum(
        isinstance(m, nn.BatchNorm2d) for m in reference.modules()
    )
    return ours, reference


@pytest.mark.parametrize("name", [pytest.param("resnet50", marks=pytest.mark.slow), pytest.param("resnet101", marks=pytest.mark.slow),
                                  "mobilenet_v3_large"])
def test_eval_outputs_equal_torchvision(name):
    ours, reference = _pair(name)
    assert list(ours.state_dict()) == list(reference.state_dict())
    x = torch.randn(2, 3, 65, 65)
    with torch.no_grad():
        expected = reference.eval()(x)
        actual = ours.eval()(x)
    assert set(actual) == {"out", "aux"}
    for key in ("out", "aux"):
        torch.testing.assert_close(actual[key], expected[key], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_training_step_equals_torchvision():
    """Train-mode BatchNorm (ours synchronized, on one device) with dropout off: same outputs, same
    running statistics, same gradients."""
    ours, reference = _pair("resnet50")
    for model in (ours, reference):
        model.train()
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.eval()
    x = torch.randn(2, 3, 49, 57)
    expected, actual = reference(x), ours(x)
    for key in ("out", "aux"):
        torch.testing.assert_close(actual[key], expected[key], atol=1e-5, rtol=1e-5)
    (expected["out"].square().mean() + expected["aux"].mean()).backward()
    (actual["out"].square().mean() + actual["aux"].mean()).backward()
    ours_state, reference_state = ours.state_dict(), reference.state_dict()
    for key in reference_state:
        torch.testing.assert_close(ours_state[key], reference_state[key], atol=1e-5, rtol=1e-5)
    reference_params = dict(reference.named_parameters())
    for name, parameter in ours.named_parameters():
        torch.testing.assert_close(parameter.grad, reference_params[name].grad, atol=1e-5, rtol=1e-4)
