"""Parameter counts of every arch / backbone / output stride, against torchvision's equivalents."""
import torch
import torchvision
from torch import nn
from torchvision.models import segmentation
from torchvision.models.segmentation.deeplabv3 import ASPP as TorchvisionASPP
from torchvision.models.segmentation.deeplabv3 import DeepLabHead
from torchvision.models.segmentation.fcn import FCNHead

from syncseg.engine.config import ModelConfig, choices
from syncseg.model.builder import build_model

NUM_CLASSES = 21
TORCHVISION_DEEPLABV3 = {
    "resnet50": segmentation.deeplabv3_resnet50,
    "resnet101": segmentation.deeplabv3_resnet101,
    "mobilenet_v3_large": segmentation.deeplabv3_mobilenet_v3_large,
}
# output stride 8 / 16 -> (low-level, aux, out) channels of torchvision's classification networks
FEATURE_CHANNELS = {
    "resnet18": (64, 256, 512),
    "resnet34": (64, 256, 512),
    "resnet50": (256, 1024, 2048),
    "resnet101": (256, 1024, 2048),
    "mobilenet_v2": (24, 96, 320),
    "mobilenet_v3_large": (24, 40, 960),
}


def count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def torchvision_backbone_count(name: str) -> int:
    network = getattr(torchvision.models, name)(weights=None)
    head = network.fc if name.startswith("resnet") else network.classifier
    unused = count(network.features[-1]) if name == "mobilenet_v2" else 0  # its 1x1 conv to 1280 channels
    return count(network) - count(head) - unused


def decoder_count(low_level_channels: int, num_classes: int, channels: int = 256, projection: int = 48) -> int:
    """DeepLabV3+ decoder beyond ASPP, from the paper's layout: 1x1 projection + BN, two 3x3 convs + BN,
    1x1 classifier with bias."""
    return (low_level_channels * projection + 2 * projection
            + (channels + projection) * channels * 9 + 2 * channels
            + channels * channels * 9 + 2 * channels
            + channels * num_classes + num_classes)


def expected_count(arch: str, backbone: str, aux: bool) -> int:
    low, aux_channels, out = FEATURE_CHANNELS[backbone]
    if arch == "deeplabv3" and backbone in TORCHVISION_DEEPLABV3:
        return count(TORCHVISION_DEEPLABV3[backbone](weights=None, weights_backbone=None,
                                                     num_classes=NUM_CLASSES, aux_loss=aux))
    total = torchvision_backbone_count(backbone)
    if arch == "deeplabv3":
        total += count(DeepLabHead(out, NUM_CLASSES))
    else:
        total += count(TorchvisionASPP(out, (6, 12, 18))) + decoder_count(low, NUM_CLASSES)
    if aux:
        total += count(FCNHead(aux_channels, NUM_CLASSES))
    return total


def test_parameter_counts_match_torchvision_equivalents():
    with torch.device("meta"):  # shapes only: no memory, no initialization cost
        rows = _count_rows()
    print(f"\n{'arch':<14} {'backbone':<19} {'aux':<5} {'OS8':>11} {'OS16':>11} {'reference':>11}")
    for arch, backbone, aux, os8, os16, expected in rows:
        print(f"{arch:<14} {backbone:<19} {str(aux):<5} {os8:>11,} {os16:>11,} {expected:>11,}")
    for arch, backbone, aux, os8, os16, expected in rows:
        assert os8 == os16 == expected, (arch, backbone, aux)
    # torchvision's published count for deeplabv3_resnet50 (its weights' metadata) agrees too
    published = segmentation.DeepLabV3_ResNet50_Weights.COCO_WITH_VOC_LABELS_V1.meta["num_params"]
    assert ("deeplabv3", "resnet50", True, published, published, published) in rows


def _count_rows() -> list[tuple]:
    rows = []
    for arch in ("deeplabv3", "deeplabv3plus"):
        for backbone in choices("model.backbone"):
            for aux in (False, True):
                expected = expected_count(arch, backbone, aux)
                counts = {
                    stride: count(build_model(ModelConfig(arch=arch, backbone=backbone, output_stride=stride,
                                                          aux_loss=aux, norm="bn"), NUM_CLASSES))
                    for stride in (8, 16)
                }
                rows.append((arch, backbone, aux, counts[8], counts[16], expected))
    return rows


def test_norm_choice_does_not_change_trainable_parameters_of_the_head():
    counts = {norm: count(build_model(ModelConfig(arch="deeplabv3plus", backbone="resnet18", norm=norm,
                                                  head_channels=32), 5))
              for norm in ("syncbn", "bn", "frozen_bn")}
    assert counts["syncbn"] == counts["bn"]
    # frozen BN keeps weight/bias as buffers: exactly the backbone's BN affine parameters disappear
    backbone_bn = sum(m.weight.numel() * 2 for m in torchvision.models.resnet18().modules()
                      if isinstance(m, nn.BatchNorm2d))
    assert counts["frozen_bn"] == counts["bn"] - backbone_bn
