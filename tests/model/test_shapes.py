"""Output shapes for every arch / backbone / output stride, odd sizes, batch 1 and 2, train and eval."""
import pytest
import torch

from syncseg.engine.config import ModelConfig, choices
from syncseg.model.builder import build_model

NUM_CLASSES = 5
COMBINATIONS = [(arch, backbone, stride) for arch in ("deeplabv3", "deeplabv3plus") for backbone in choices("model.backbone")
                for stride in (8, 16)]
HEAVY = {"resnet50", "resnet101"}


def _check(model, batch, height, width, *, train):
    model.train(train)
    x = torch.randn(batch, 3, height, width)
    with torch.set_grad_enabled(train):
        result = model(x)
    assert set(result) == {"out", "aux"}
    for key, logits in result.items():
        assert logits.shape == (batch, NUM_CLASSES, height, width), key
        assert logits.dtype == torch.float32 and torch.isfinite(logits).all(), key
    return result


@pytest.mark.parametrize(
    "arch,backbone,output_stride",
    [pytest.param(*c, marks=pytest.mark.slow) if c[1] in HEAVY else c for c in COMBINATIONS],
)
def test_every_combination_odd_sizes_batch_1_and_2_train_and_eval(arch, backbone, output_stride):
    torch.manual_seed(0)
    model = build_model(ModelConfig(arch=arch, backbone=backbone, output_stride=output_stride, aux_loss=True), NUM_CLASSES)
    _check(model, 1, 35, 29, train=True)  # one image: the ASPP pooling branch must not crash
    _check(model, 2, 37, 45, train=True)
    _check(model, 1, 33, 51, train=False)
    _check(model, 2, 41, 35, train=False)


@pytest.mark.slow
@pytest.mark.parametrize("arch,backbone,output_stride,train", [
    ("deeplabv3plus", "resnet18", 8, True),
    ("deeplabv3", "mobilenet_v3_large", 16, False),
    ("deeplabv3", "resnet34", 16, True),
])
def test_321x257(arch, backbone, output_stride, train):
    model = build_model(ModelConfig(arch=arch, backbone=backbone, output_stride=output_stride, aux_loss=True), NUM_CLASSES)
    _check(model, 2, 321, 257, train=train)


@pytest.mark.slow
def test_513x513_eval():
    model = build_model(ModelConfig(arch="deeplabv3plus", backbone="resnet18", output_stride=16, aux_loss=True),
                        NUM_CLASSES)
    _check(model, 1, 513, 513, train=False)


@pytest.mark.parametrize("arch", ["deeplabv3", "deeplabv3plus"])
def test_every_parameter_gets_a_gradient(arch):
    """No dead branch: one training step reaches every parameter (aux head included)."""
    model = build_model(ModelConfig(arch=arch, backbone="resnet18", output_stride=16, aux_loss=True,
                                    head_channels=32), NUM_CLASSES)
    result = _check(model, 2, 33, 31, train=True)
    (result["out"].logsumexp(1).mean() + result["aux"].logsumexp(1).mean()).backward()
    without_gradient = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert without_gradient == []


def test_no_aux_output_without_aux_loss():
    model = build_model(ModelConfig(arch="deeplabv3plus", backbone="resnet18", head_channels=16), 3).eval()
    with torch.no_grad():
        result = model(torch.randn(1, 3, 31, 33))
    assert set(result) == {"out"} and result["out"].shape == (1, 3, 31, 33)


def test_small_head_demo_settings():
    """The CPU demo's shape: 96 px crops, a narrow head and explicit ASPP rates."""
    model = build_model(ModelConfig(arch="deeplabv3plus", backbone="resnet18", output_stride=16, head_channels=64,
                                    aspp_rates=(2, 4, 6)), 6)
    rates = [branch[0].dilation[0] for branch in list(model.classifier.aspp.convs)[1:-1]]
    assert rates == [2, 4, 6]
    result = model.train()(torch.randn(4, 3, 96, 96))
    assert result["out"].shape == (4, 6, 96, 96)
