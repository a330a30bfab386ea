"""syncseg.model.norm: the one factory from `model.norm` to normalization layers."""
import pytest
import torch
from torch import nn
from torchvision.ops import FrozenBatchNorm2d

from syncseg.model.norm import norm_layers, synchronizes_statistics
from syncseg.model.sync_batchnorm import SynchronizedBatchNorm2d


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


class _NormThenAct(nn.BatchNorm2d):
    """timm's BatchNormAct2d layout without timm: BatchNorm2d, then its `drop` and `act` children."""

    def __init__(self, channels):
        super().__init__(channels, eps=1e-3, momentum=0.05)
        self.drop, self.act = nn.Identity(), nn.Hardswish()

    def forward(self, x):
        return self.act(self.drop(super().forward(x)))


@pytest.mark.parametrize("kind", ["bn", "syncbn", "frozen_bn"])
def test_adopt_batch_norms_swaps_every_batch_norm_keeping_settings_tensors_and_activation(kind):
    import torch

    from syncseg.model.norm import FrozenBatchNormAct2d, SynchronizedBatchNormAct2d, adopt_batch_norms

    torch.manual_seed(0)
    network = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Sequential(nn.Conv2d(4, 4, 1), _NormThenAct(4)))
    with torch.no_grad():
        for m in network.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-1, 1), m.running_var.uniform_(0.5, 2), m.weight.uniform_(0.5, 2)
    x = torch.randn(2, 3, 9, 9)
    with torch.no_grad():
        expected_train, expected_eval = network.train()(x), network.eval()(x)
    state = {k: v.clone() for k, v in network.state_dict().items()}
    weight = network[1].weight
    adopted = adopt_batch_norms(network, norm_layers(kind)[0])
    plain, with_act = adopted[1], adopted[2][1]
    expected_types = {"bn": (nn.BatchNorm2d, _NormThenAct), "syncbn": (SynchronizedBatchNorm2d, SynchronizedBatchNormAct2d),
                      "frozen_bn": (FrozenBatchNorm2d, FrozenBatchNormAct2d)}[kind]
    assert (type(plain), type(with_act)) == expected_types
    assert with_act.eps == 1e-3 and (kind == "frozen_bn" or with_act.momentum == 0.05)
    assert all(torch.equal(adopted.state_dict()[key], value) for key, value in state.items()
               if key in adopted.state_dict())
    if kind == "syncbn":
        assert plain.weight is weight  # the same tensors, as convert_model shares them
    with torch.no_grad():
        torch.testing.assert_close(adopted.eval()(x), expected_eval)
        # frozen statistics in training mode are the eval-mode result; the others train as plain BN did
        torch.testing.assert_close(adopted.train()(x), expected_eval if kind == "frozen_bn" else expected_train)


@pytest.mark.parametrize("kind", ["syncbn", "frozen_bn"])
def test_adopted_norms_keep_tensors_mode_and_hooks(kind):
    """adopt_batch_norms swaps layers as convert_model does (one swap, syncseg.model.sync_batchnorm.adopt_norm_state):
    values, train/eval mode and forward hooks survive, for a frozen layer too."""
    from syncseg.model.norm import adopt_batch_norms, norm_layers

    torch.manual_seed(0)
    old = nn.BatchNorm2d(4)
    with torch.no_grad():
        old.weight.uniform_(0.5, 2.0), old.bias.uniform_(-1, 1)
        old.running_mean.uniform_(-1, 1), old.running_var.uniform_(0.5, 2.0)
    old.eval()
    calls = []
    old.register_forward_hook(lambda module, args, output: calls.append(type(module).__name__))
    holder = nn.Sequential(old)
    inputs = torch.randn(2, 4, 3, 3)
    expected = old(inputs)
    adopt_batch_norms(holder, norm_layers(kind)[0])
    new = holder[0]
    assert type(new) is not nn.BatchNorm2d and not new.training
    torch.testing.assert_close(new(inputs), expected)
    assert len(calls) == 2  # the hook came along
