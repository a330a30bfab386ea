"""timm encoders (model.backbone=timm:<name>): parameter counts and outputs against timm's own models,
output strides, the norm choices, local-only weights and the errors."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torchvision.models.segmentation.deeplabv3 import DeepLabHead
from torchvision.models.segmentation.fcn import FCNHead
from torchvision.ops import FrozenBatchNorm2d

from syncseg.engine.config import ModelConfig
from syncseg.model.backbones import build_backbone
from syncseg.model.builder import build_model
from syncseg.model.norm import FrozenBatchNormAct2d, SynchronizedBatchNormAct2d, norm_layers
from syncseg.model.sync_batchnorm import SynchronizedBatchNorm2d

timm = pytest.importorskip("timm")

ROOT = Path(__file__).resolve().parents[2]
# plain BatchNorm2d, timm's BatchNormAct2d, LayerNorm (no BatchNorm at all), and a 2-stage stem
NAMES = ["resnet18", "efficientnet_b0", "convnext_atto", "regnetx_002"]


def count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _randomize_batchnorm(module: nn.Module) -> None:
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.rand(m.num_features, generator=generator) - 0.5)
                m.running_var.copy_(torch.rand(m.num_features, generator=generator) + 0.5)


@pytest.mark.parametrize("name", NAMES)
def test_parameter_counts_equal_timms_feature_extractor(name):
    reference = timm.create_model(name, features_only=True)
    expected = count(reference)
    for norm in ("bn", "syncbn"):
        for stride in (8, 16):
            assert count(build_backbone(f"timm:{name}", output_stride=stride, norm_layer=norm_layers(norm)[0])) == expected
    batch_norm_affine = sum(2 * m.num_features for m in reference.modules() if isinstance(m, nn.BatchNorm2d))
    frozen = build_backbone(f"timm:{name}", output_stride=16, norm_layer=norm_layers("frozen_bn")[0])
    assert count(frozen) == expected - batch_norm_affine  # frozen BN keeps weight/bias as buffers
    # the whole DeepLabV3 network: timm's encoder + torchvision's DeepLabHead and FCNHead on its channels
    channels = reference.feature_info.channels()
    model = build_model(ModelConfig(arch="deeplabv3", backbone=f"timm:{name}", aux_loss=True, norm="bn"), 21)
    assert count(model) == expected + count(DeepLabHead(channels[-1], 21)) + count(FCNHead(channels[-2], 21))


@pytest.mark.parametrize("name", NAMES[:3])
@pytest.mark.parametrize("norm", ["bn", "syncbn", "frozen_bn"])
def test_outputs_equal_timms_model_for_every_norm(name, norm):
    """syncbn on one device is plain batch norm, BatchNormAct2d keeps its activation, frozen_bn uses the
    running statistics in training mode too (so it equals timm's model in eval mode)."""
    torch.manual_seed(0)
    reference = timm.create_model(name, features_only=True, output_stride=16)
    _randomize_batchnorm(reference)
    ours = build_backbone(f"timm:{name}", output_stride=16, norm_layer=norm_layers(norm)[0])
    ours.encoder.load_state_dict(reference.state_dict())  # the same keys whatever the norm
    norms = [m for m in ours.modules() if isinstance(m, (_BatchNorm, FrozenBatchNorm2d))]
    if norm == "bn":
        assert [type(m) for m in norms] == [type(m) for m in reference.modules() if isinstance(m, _BatchNorm)]
    elif norms:  # convnext has none
        wanted = SynchronizedBatchNorm2d if norm == "syncbn" else FrozenBatchNorm2d
        assert all(isinstance(m, wanted) for m in norms)
        with_act = SynchronizedBatchNormAct2d if norm == "syncbn" else FrozenBatchNormAct2d
        assert any(isinstance(m, with_act) for m in norms) == (name == "efficientnet_b0")  # timm's BatchNormAct2d
    x = torch.randn(2, 3, 48, 40)
    for training in (False, True):
        ours.train(training)
        reference.train(training and norm != "frozen_bn")
        with torch.no_grad():
            expected, actual = reference(x), ours(x)
        assert actual["out"].shape == expected[-1].shape
        torch.testing.assert_close(actual["out"], expected[-1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(actual["aux"], expected[-2], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("output_stride", [8, 16, 32])
def test_feature_maps_come_out_at_the_deeplab_strides(output_stride):
    for name in ("efficientnet_b0", "convnext_atto"):
        backbone = build_backbone(f"timm:{name}", output_stride=output_stride, norm_layer=nn.BatchNorm2d).eval()
        with torch.no_grad():
            features = backbone(torch.randn(1, 3, 64, 96))
        channels = {"low_level": backbone.low_level_channels, "aux": backbone.aux_channels,
                    "out": backbone.out_channels}
        aux_stride = min(output_stride, 16)  # the feature map before the last
        for key, stride in {"low_level": 4, "aux": aux_stride, "out": output_stride}.items():
            assert features[key].shape == (1, channels[key], 64 // stride, 96 // stride), (name, key)


@pytest.mark.parametrize("arch", ["deeplabv3", "deeplabv3plus"])
def test_a_timm_deeplab_trains_with_synchronized_batch_norm(arch):
    model = build_model(ModelConfig(arch=arch, backbone="timm:efficientnet_b0", output_stride=8, aux_loss=True,
                                    head_channels=16), 5).train()
    result = model(torch.randn(2, 3, 45, 39))
    assert {key: tuple(value.shape) for key, value in result.items()} == {"out": (2, 5, 45, 39), "aux": (2, 5, 45, 39)}
    (result["out"].mean() + result["aux"].mean()).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_unsupported_and_unknown_models_are_one_line_errors():
    with pytest.raises(ValueError, match="timm:vit_tiny_patch16_224: timm builds this model without output-stride "
                                         r"\(dilation\) support, so model.output_stride=16 cannot be honoured"):
        build_backbone("timm:vit_tiny_patch16_224", output_stride=16, norm_layer=nn.BatchNorm2d)
    with pytest.raises(ValueError, match="has no model 'resnet181'; did you mean resnet18"):
        build_backbone("timm:resnet181", output_stride=16, norm_layer=nn.BatchNorm2d)
    with pytest.raises(ValueError, match="Hugging Face Hub names fetch their config over the network"):
        build_backbone("timm:hf-hub:timm/resnet18.a1_in1k", output_stride=16, norm_layer=nn.BatchNorm2d)


def _classification_weights(tmp_path: Path, name: str = "resnet18") -> tuple[dict, Path]:
    torch.manual_seed(3)
    state = timm.create_model(name, pretrained=False).state_dict()
    path = tmp_path / f"{name}.pth"
    torch.save(state, path)
    return state, path


def test_a_local_timm_checkpoint_loads_through_timms_loader(tmp_path):
    state, path = _classification_weights(tmp_path)
    backbone = build_backbone("timm:resnet18", output_stride=8, norm_layer=norm_layers("syncbn")[0],
                              pretrained=str(path))
    loaded = backbone.encoder.state_dict()
    assert loaded.keys() == {k for k in state if not k.startswith("fc.")}
    assert all(torch.equal(loaded[key], state[key]) for key in loaded)
    other, other_path = _classification_weights(tmp_path, "resnet34")
    with pytest.raises(ValueError, match="resnet34.pth' does not fit model.backbone=timm:resnet18") as error:
        build_backbone("timm:resnet18", output_stride=8, norm_layer=nn.BatchNorm2d, pretrained=str(other_path))
    assert "\n" not in str(error.value)
    # timm loads a features_only EfficientNet non-strictly (a missing tensor is only a log line): checked first
    state, path = _classification_weights(tmp_path, "efficientnet_b0")
    backbone = build_backbone("timm:efficientnet_b0", output_stride=16, norm_layer=norm_layers("frozen_bn")[0],
                              pretrained=str(path))
    assert all(torch.equal(value, state[key]) for key, value in backbone.encoder.state_dict().items())
    torch.save({k: v for k, v in state.items() if k != "blocks.1.0.bn1.weight"}, path)
    with pytest.raises(ValueError, match=r"does not fit model.backbone=timm:efficientnet_b0.*Missing key.*"
                                         r"blocks.1.0.bn1.weight"):
        build_backbone("timm:efficientnet_b0", output_stride=16, norm_layer=nn.BatchNorm2d, pretrained=str(path))
    with pytest.raises(FileNotFoundError, match="nowhere.pth' for model.backbone=timm:resnet18 not found"):
        build_backbone("timm:resnet18", output_stride=8, norm_layer=nn.BatchNorm2d, pretrained=str(tmp_path / "nowhere.pth"))


def _no_network(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_imagenet_weights_come_from_the_local_hugging_face_cache_only(tmp_path, monkeypatch):
    import huggingface_hub
    from safetensors.torch import save_file

    hub = tmp_path / "huggingface" / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    _no_network(monkeypatch)
    with pytest.raises(FileNotFoundError) as error:
        build_backbone("timm:resnet18", output_stride=16, norm_layer=nn.BatchNorm2d, pretrained="imagenet")
    message = str(error.value)
    assert "'model.safetensors' of the Hugging Face repository 'timm/resnet18.a1_in1k'" in message
    assert str(hub) in message and "Nothing is downloaded" in message and "resnet18_a1_0-d63eafa0.pth" in message

    # the layout huggingface_hub writes: refs/main names the snapshot holding the file
    state, _ = _classification_weights(tmp_path)
    repo = hub / "models--timm--resnet18.a1_in1k"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    (repo / "snapshots" / "0123abcd").mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(repo / "snapshots" / "0123abcd" / "model.safetensors"))
    backbone = build_backbone("timm:resnet18", output_stride=16, norm_layer=nn.BatchNorm2d, pretrained="imagenet")
    assert all(torch.equal(value, state[key]) for key, value in backbone.encoder.state_dict().items())


def test_timm_is_imported_only_when_a_timm_backbone_is_built():
    code = ("import sys, syncseg.engine.config, syncseg.model.builder; from syncseg.engine.config import load_config; "
            "load_config(None, ['model.backbone=timm:resnet18']); assert 'timm' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
