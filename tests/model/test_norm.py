"""model.norm: the one factory from `model.norm` to normalization layers."""
import pytest
from torch import nn
from torchvision.ops import FrozenBatchNorm2d

from model.norm import norm_layers, synchronizes_statistics
from model.sync_batchnorm import SynchronizedBatchNorm2d


@pytest.mark.parametrize("kind,backbone_type,head_type", [
    ("syncbn", SynchronizedBatchNorm2d, SynchronizedBatchNorm2d),
    ("bn", nn.BatchNorm2d, nn.BatchNorm2d),
    ("frozen_bn", FrozenBatchNorm2d, SynchronizedBatchNorm2d),
])
def test_each_kind_builds_its_layers_with_the_requested_settings(kind, backbone_type, head_type):
    backbone_norm, head_norm = norm_layers(kind)
    default, tuned = backbone_norm(8), backbone_norm(8, eps=1e-3, momentum=0.01)  # MobileNetV3's recipe
    head = head_norm(4)
    assert type(default) is backbone_type and type(head) is head_type
    assert default.eps == 1e-5 and tuned.eps == 1e-3
    if backbone_type is not FrozenBatchNorm2d:  # frozen statistics never move: no momentum
        assert default.momentum == 0.1 and tuned.momentum == 0.01
    assert head.num_features == 4 and head.momentum == 0.1


def test_which_kinds_synchronize():
    assert synchronizes_statistics("syncbn") and synchronizes_statistics("frozen_bn")  # the head does
    assert not synchronizes_statistics("bn")
