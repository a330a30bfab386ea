"""SegmentationLoss against torch's cross-entropy and a float64 OHEM re-computation."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from syncseg.engine.config import TrainConfig
from syncseg.engine.loss import SegmentationLoss, build_loss


def _loss(**settings) -> SegmentationLoss:
    """The loss of a train section with `settings` (the schema's defaults otherwise), ignore label 255."""
    return build_loss(TrainConfig(**settings), ignore_index=255)


def _logits_and_target(seed: int = 0, num_classes: int = 4, shape=(2, 5, 6), ignore_fraction=0.2):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(shape[0], num_classes, *shape[1:], generator=generator) * 2
    target = torch.randint(0, num_classes, shape, generator=generator)
    ignored = torch.rand(shape, generator=generator) < ignore_fraction
    target[ignored] = 255
    return logits, target


# ------------------------------------------------------------------------------------------- loss
def test_loss_equals_torch_cross_entropy_with_ignore_index():
    logits, target = _logits_and_target()
    loss = _loss()({"out": logits}, target)
    reference = F.cross_entropy(logits, target, ignore_index=255)
    torch.testing.assert_close(loss, reference)


def test_loss_with_class_weights_equals_torch_weighted_mean():
    logits, target = _logits_and_target(seed=1)
    weights = [0.5, 2.0, 1.0, 3.0]
    loss = _loss(class_weights=weights)({"out": logits}, target)
    reference = F.cross_entropy(logits, target, weight=torch.tensor(weights), ignore_index=255)
    torch.testing.assert_close(loss, reference)


def test_aux_loss_is_weighted_sum_of_heads():
    logits, target = _logits_and_target(seed=2)
    aux, _ = _logits_and_target(seed=3)
    loss = _loss(aux_weight=0.4)({"out": logits, "aux": aux}, target)
    reference = F.cross_entropy(logits, target, ignore_index=255) + 0.4 * F.cross_entropy(aux, target, ignore_index=255)
    torch.testing.assert_close(loss, reference)


def _ohem_reference(logits: torch.Tensor, target: torch.Tensor, thresh: float, min_kept: int) -> float:
    """float64 numpy recomputation of OHEM: keep pixels with p(true) < thresh, at least min_kept."""
    z = logits.double().numpy()
    z = z - z.max(axis=1, keepdims=True)
    prob = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    t = target.numpy()
    valid = t != 255
    n, _, h, w = z.shape
    losses, probs = [], []
    for i in range(n):
        for y in range(h):
            for x in range(w):
                if valid[i, y, x]:
                    p = prob[i, t[i, y, x], y, x]
                    probs.append(p)
                    losses.append(-np.log(p))
    probs, losses = np.array(probs), np.array(losses)
    threshold = max(thresh, np.sort(probs)[min(min_kept, len(probs)) - 1])
    kept = probs <= threshold
    return float(losses[kept].mean())


# min_kept 55: between the valid pixels (47) and all (60); 10,000: more than there are pixels
@pytest.mark.parametrize("thresh,min_kept", [(0.7, 5), (0.3, 20), (0.05, 1), (0.05, 55), (0.05, 10_000)])
def test_ohem_matches_float64_reference(thresh, min_kept):
    logits, target = _logits_and_target(seed=4)
    loss = _loss(ohem=True, ohem_thresh=thresh, ohem_min_kept=min_kept)({"out": logits}, target)
    assert loss.item() == pytest.approx(_ohem_reference(logits, target, thresh, min_kept), rel=1e-5)


def test_ohem_on_a_batch_without_valid_pixels_is_zero():
    logits, target = _logits_and_target(seed=4)
    loss = _loss(ohem=True, ohem_min_kept=5)({"out": logits.requires_grad_()}, torch.full_like(target, 255))
    loss.backward()
    assert loss.item() == 0.0 and logits.grad.abs().sum().item() == 0.0


def test_ohem_keeps_fewer_pixels_than_plain_loss_and_is_harder():
    logits, target = _logits_and_target(seed=5)
    plain = _loss()({"out": logits}, target)
    hard = _loss(ohem=True, ohem_thresh=0.3, ohem_min_kept=1)({"out": logits}, target)
    assert hard > plain  # only low-probability (high-loss) pixels remain


def test_loss_of_all_ignored_batch_is_zero_not_nan():
    logits = torch.randn(1, 3, 4, 4, requires_grad=True)
    target = torch.full((1, 4, 4), 255)
    loss = _loss()({"out": logits}, target)
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(logits.grad).all()


def test_loss_rejects_mask_values_out_of_range():
    logits = torch.randn(1, 3, 2, 2)
    target = torch.tensor([[[0, 1], [2, 7]]])
    with pytest.raises(ValueError, match="mask value 7"):
        _loss()({"out": logits}, target)
