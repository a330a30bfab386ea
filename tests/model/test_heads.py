"""ASPP (image pooling with one image per batch), rates, heads against torchvision's modules."""
import copy

import pytest
import torch
from torch import nn
from torchvision.models.segmentation import deeplabv3 as tv_deeplabv3

from syncseg.model.heads import ASPP, ASPPPooling, DeepLabV3Head, aspp_rates_for
from syncseg.model.sync_batchnorm import SynchronizedBatchNorm2d
from syncseg.model.sync_batchnorm.unittest import run_replicas


def test_aspp_rates_follow_output_stride_unless_given():
    assert aspp_rates_for(16) == (6, 12, 18)
    assert aspp_rates_for(8) == (12, 24, 36)
    assert aspp_rates_for(32) == (3, 6, 9)
    assert aspp_rates_for(8, (1, 2, 3)) == (1, 2, 3)


def _pooling_pair(norm_layer, seed=0):
    torch.manual_seed(seed)
    reference = tv_deeplabv3.ASPPPooling(6, 4)
    with torch.no_grad():
        reference[2].running_mean.uniform_(-1, 1)
        reference[2].running_var.uniform_(0.5, 2)
        reference[2].weight.uniform_(0.5, 2)
        reference[2].bias.uniform_(-1, 1)
    ours = ASPPPooling(6, 4, norm_layer=norm_layer)
    ours.load_state_dict(reference.state_dict())
    return ours, reference


@pytest.mark.parametrize("norm_layer", [nn.BatchNorm2d, SynchronizedBatchNorm2d])
def test_pooling_with_batch_2_equals_torchvision_in_training(norm_layer):
    ours, reference = _pooling_pair(norm_layer)
    x = torch.randn(2, 6, 5, 7)
    torch.testing.assert_close(ours.train()(x), reference.train()(x))
    torch.testing.assert_close(ours[2].running_mean, reference[2].running_mean)
    torch.testing.assert_close(ours[2].running_var, reference[2].running_var)
    x = torch.randn(1, 6, 5, 7)
    torch.testing.assert_close(ours.eval()(x), reference.eval()(x))


@pytest.mark.parametrize("norm_layer", [nn.BatchNorm2d, SynchronizedBatchNorm2d])
def test_pooling_with_batch_1_in_training_uses_running_statistics(norm_layer):
    ours, reference = _pooling_pair(norm_layer)
    x = torch.randn(1, 6, 5, 7)
    with pytest.raises(ValueError):  # torchvision's branch cannot train on one image
        reference.train()(x)
    mean_before, var_before = ours[2].running_mean.clone(), ours[2].running_var.clone()
    output = ours.train()(x)
    torch.testing.assert_close(output, reference.eval()(x))  # = eval-mode normalization
    assert torch.equal(ours[2].running_mean, mean_before) and torch.equal(ours[2].running_var, var_before)
    output.sum().backward()
    assert ours[2].weight.grad is not None and ours[2].weight.grad.abs().sum() > 0
    assert ours[2].bias.grad is not None and ours[2].bias.grad.abs().sum() > 0


def test_pooling_replica_with_one_image_still_synchronizes():
    """DataParallel split 2 + 1 images: every replica joins the synchronization (no hang), and the
    result equals one module on the 3-image batch."""
    ours, _ = _pooling_pair(SynchronizedBatchNorm2d)
    single = copy.deepcopy(ours).train()
    replicas = [copy.deepcopy(ours).train() for _ in range(2)]
    x = torch.randn(3, 6, 5, 7)
    outputs = run_replicas(replicas, [x[:2], x[2:]], join_timeout=30.0)
    expected = single(x)
    torch.testing.assert_close(torch.cat(outputs), expected)
    torch.testing.assert_close(replicas[0][2].running_mean, single[2].running_mean)
    torch.testing.assert_close(replicas[0][2].running_var, single[2].running_var)


def test_aspp_and_deeplabv3_head_equal_torchvision():
    torch.manual_seed(0)
    reference = tv_deeplabv3.DeepLabHead(32, 5, atrous_rates=(1, 2, 3)).eval()
    ours = DeepLabV3Head(32, 5, atrous_rates=(1, 2, 3)).eval()
    assert list(ours.state_dict()) == list(reference.state_dict())
    ours.load_state_dict(reference.state_dict())
    x = torch.randn(2, 32, 9, 11)
    torch.testing.assert_close(ours({"out": x}), reference(x))
    aspp = ASPP(32, (1, 2, 3), out_channels=8)
    assert aspp(x).shape == (2, 8, 9, 11)
