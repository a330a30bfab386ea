"""train.loss: focal, Dice and Lovasz-Softmax against float64 references written from the published
formulas (and segmentation_models_pytorch's losses where it is installed), gradients by finite
differences, and the global-batch reduction: one big batch == micro-batches == processes (float64)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from syncseg.engine.accumulation import step_normalizer
from syncseg.engine.config import TrainConfig
from syncseg.engine.loss import SegmentationLoss, build_loss
from syncseg.engine.registry import LOSS_TERMS
from syncseg.engine.loss_terms import dice_terms, focal_terms, lovasz_terms
from tests.gloo import free_port, init_gloo, start_ranks

IGNORE = 255


def _loss(*terms: tuple[str, float], **settings) -> SegmentationLoss:
    return build_loss(TrainConfig(loss=terms, **settings), ignore_index=IGNORE)


def _batch(seed: int = 0, num_classes: int = 4, shape=(3, 6, 7), ignore_fraction=0.2, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(shape[0], num_classes, *shape[1:], generator=generator) * 2).to(dtype)
    # images use different subsets of the classes, so "present classes" differ per image
    target = torch.randint(0, num_classes, shape, generator=generator)
    target[0][target[0] == num_classes - 1] = 0
    target[(torch.rand(shape, generator=generator) < ignore_fraction)] = IGNORE
    return logits, target


# -------------------------------------------------------------------------- float64 references
def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=1, keepdims=True)
    return np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)


def _pixels(logits: torch.Tensor, target: torch.Tensor):
    """Per image: (P x C probabilities, P labels) of its valid pixels, as numpy float64."""
    probabilities, labels = _softmax(logits.double().numpy()), target.numpy()
    for image, image_labels in zip(probabilities, labels):
        keep = image_labels.reshape(-1) != IGNORE
        yield image.reshape(image.shape[0], -1).T[keep], image_labels.reshape(-1)[keep]


def focal_reference(logits, target, gamma, class_weights=None) -> float:
    """Lin et al.: sum over valid pixels of -alpha_y (1 - p_y)^gamma log p_y, over sum of alpha_y."""
    total, weight = 0.0, 0.0
    for probabilities, labels in _pixels(logits, target):
        for p, y in zip(probabilities, labels):
            alpha = 1.0 if class_weights is None else class_weights[y]
            total += -alpha * (1 - p[y]) ** gamma * np.log(p[y])
            weight += alpha
    return total / weight


def _per_image_mean(logits, target, class_losses) -> float:
    """Mean over the images that have a valid pixel of the mean of `class_losses(probabilities, labels)`."""
    losses = [np.mean(class_losses(probabilities, labels)) for probabilities, labels in _pixels(logits, target)
              if len(labels)]
    return float(np.mean(losses))


def dice_reference(logits, target) -> float:
    """Per image, per class present in its labels: 1 - 2|P.Y| / (|P| + |Y|); mean over those classes,
    then over the images that have a valid pixel."""
    def class_losses(probabilities, labels):
        ys = [(c, (labels == c).astype(np.float64)) for c in np.unique(labels)]
        return [1 - 2 * (probabilities[:, c] * y).sum() / (probabilities[:, c].sum() + y.sum()) for c, y in ys]

    return _per_image_mean(logits, target, class_losses)


def _lovasz_grad(gt_sorted: np.ndarray) -> np.ndarray:
    """Berman et al. 2018, Algorithm 1 (as in their lovasz_losses.py)."""
    gts = gt_sorted.sum()
    intersection = gts - np.cumsum(gt_sorted)
    union = gts + np.cumsum(1 - gt_sorted)
    jaccard = 1.0 - intersection / union
    jaccard[1:] = jaccard[1:] - jaccard[:-1]
    return jaccard


def lovasz_reference(logits, target) -> float:
    """lovasz_softmax(probas, labels, classes='present', per_image=True, ignore=255) of Berman et al.,
    averaged over the images that have a valid pixel."""
    def class_losses(probabilities, labels):
        losses = []
        for c in range(probabilities.shape[1]):
            fg = (labels == c).astype(np.float64)
            if fg.sum() == 0:
                continue
            errors = np.abs(fg - probabilities[:, c])
            order = np.argsort(-errors, kind="stable")
            losses.append(float(np.dot(errors[order], _lovasz_grad(fg[order]))))
        return losses

    return _per_image_mean(logits, target, class_losses)


@pytest.mark.parametrize("seed", [0, 1])
def test_focal_dice_lovasz_equal_their_float64_references(seed):
    logits, target = _batch(seed)
    assert abs(float(_loss(("focal", 1.0))({"out": logits}, target)) - focal_reference(logits, target, 2.0)) < 1e-6
    assert abs(float(_loss(("dice", 1.0))({"out": logits}, target)) - dice_reference(logits, target)) < 1e-6
    assert abs(float(_loss(("lovasz", 1.0))({"out": logits}, target)) - lovasz_reference(logits, target)) < 1e-6
    # float32 logits (the training dtype) agree with the float64 references as closely as float32 can
    logits32 = logits.float()
    assert abs(float(_loss(("lovasz", 1.0))({"out": logits32}, target)) - lovasz_reference(logits, target)) < 1e-5


def test_focal_takes_gamma_and_class_weights_and_is_cross_entropy_at_gamma_zero():
    logits, target = _batch(2)
    weights = (0.5, 2.0, 1.0, 3.0)
    loss = _loss(("focal", 1.0), focal_gamma=0.5, class_weights=weights)({"out": logits}, target)
    assert abs(float(loss) - focal_reference(logits, target, 0.5, weights)) < 1e-6
    at_zero = _loss(("focal", 1.0), focal_gamma=0.0, class_weights=weights)({"out": logits}, target)
    torch.testing.assert_close(at_zero, F.cross_entropy(logits, target, weight=torch.tensor(weights).double(),
                                                        ignore_index=IGNORE), rtol=0, atol=1e-12)


def test_weighted_terms_on_both_heads():
    logits, target = _batch(3)
    aux, _ = _batch(4)
    loss = _loss(("ce", 1.0), ("dice", 0.5), ("lovasz", 2.0), aux_weight=0.4)({"out": logits, "aux": aux}, target)

    def head(z):
        return (F.cross_entropy(z, target, ignore_index=IGNORE).item() + 0.5 * dice_reference(z, target)
                + 2.0 * lovasz_reference(z, target))

    assert abs(float(loss) - (head(logits) + 0.4 * head(aux))) < 1e-6


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32])
def test_narrow_integer_masks_give_the_int64_losses_and_normalizers(dtype):
    """The training loader's masks are uint8 (syncseg.engine.build); a class-weight lookup indexed by a uint8
    tensor would select by truth value instead, so every term and the step normalizer must see class indices."""
    logits, target = _batch(5, num_classes=5)
    weights = dict(class_weights=(0.5, 1.0, 2.0, 1.0, 3.0))
    for settings in ({}, weights, dict(weights, ohem=True, ohem_thresh=0.7, ohem_min_kept=10)):
        loss = _loss(("ce", 1.0), ("focal", 0.5), ("dice", 1.0), ("lovasz", 0.5), **settings)
        wide, narrow = loss.terms({"out": logits}, target), loss.terms({"out": logits}, target.to(dtype))
        assert wide.keys() == narrow.keys() and len(wide) == 4
        for key, (value, weight) in wide.items():
            assert torch.equal(narrow[key][0], value) and torch.equal(narrow[key][1], weight), (settings, key)
        assert torch.equal(loss({"out": logits}, target.to(dtype)), loss({"out": logits}, target))
        if not settings.get("ohem"):
            assert torch.equal(loss.target_weight(target.to(dtype)), loss.target_weight(target))


@pytest.mark.parametrize("name", ["focal", "dice", "lovasz"])
def test_gradients_match_finite_differences(name):
    logits, target = _batch(5, shape=(2, 3, 4))
    logits.requires_grad_(True)
    criterion = _loss((name, 1.0))
    assert torch.autograd.gradcheck(lambda z: criterion({"out": z}, target), (logits,), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", LOSS_TERMS.names())
def test_an_all_ignored_batch_gives_zero_and_finite_gradients(name):
    logits = torch.randn(2, 3, 4, 4, requires_grad=True)
    loss = _loss((name, 1.0))({"out": logits}, torch.full((2, 4, 4), IGNORE))
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(logits.grad).all()


def test_ignored_pixels_do_not_count():
    logits, target = _batch(6)
    changed = logits.clone()
    changed.permute(0, 2, 3, 1)[target == IGNORE] = 100.0  # whatever the model says there
    for name in LOSS_TERMS:
        criterion = _loss((name, 1.0))
        assert float(criterion({"out": changed}, target)) == pytest.approx(float(criterion({"out": logits}, target)),
                                                                           abs=1e-12), name



def test_terms_are_sums_over_pixels_or_images_with_their_local_normalizers():
    logits, target = _batch(7)
    target[1] = IGNORE  # an image with no valid pixel counts in no per-image mean
    valid, safe = target != IGNORE, torch.where(target != IGNORE, target, 0)
    assert float(dice_terms(logits, safe, valid)[1]) == 2 and float(lovasz_terms(logits, safe, valid)[1]) == 2
    assert float(focal_terms(logits, safe, valid.double(), gamma=2.0)[1]) == int(valid.sum())


# --------------------------------------------------------------------- the global-batch reduction
def _split_shares(criterion: SegmentationLoss, logits: torch.Tensor, target: torch.Tensor, sizes: list[int]):
    """The micro-batch shares of one accumulated step, as syncseg.engine.trainer.Trainer.train_step computes them."""
    chunks = list(zip(logits.split(sizes), target.split(sizes)))
    normalizer = step_normalizer(criterion, [t for _, t in chunks])
    return [criterion({"out": z}, t, step_weight=normalizer) for z, t in chunks]


COMBINED = (("ce", 1.0), ("focal", 0.5), ("dice", 1.0), ("lovasz", 0.25))


@pytest.mark.parametrize("terms", [(("dice", 1.0),), (("lovasz", 1.0),), (("focal", 1.0),), COMBINED],
                         ids=["dice", "lovasz", "focal", "combined"])
def test_micro_batches_give_the_value_and_gradient_of_one_big_batch(terms):
    logits, target = _batch(8, shape=(5, 6, 7))
    target[2] = IGNORE  # a micro-batch member without valid pixels
    criterion = _loss(*terms, class_weights=(1.0, 2.0, 0.5, 1.5) if ("focal", 0.5) in terms else ())
    whole_logits = logits.clone().requires_grad_(True)
    whole = criterion({"out": whole_logits}, target)
    whole.backward()
    split_logits = logits.clone().requires_grad_(True)
    shares = _split_shares(criterion, split_logits, target, [1, 4])
    torch.stack(shares).sum().backward()
    assert abs(float(torch.stack(shares).sum().detach()) - float(whole.detach())) < 1e-12
    torch.testing.assert_close(split_logits.grad, whole_logits.grad, rtol=0, atol=1e-12)
    # control: each micro-batch normalized by itself (a mean per micro-batch) is not the big batch's loss
    naive = sum(float(criterion({"out": z}, t).detach()) for z, t in zip(logits.split([1, 4]), target.split([1, 4]))) / 2
    assert abs(naive - float(whole.detach())) > 1e-3


def _rank_worker(rank: int, port: int, folder: Path) -> None:
    torch.set_num_threads(1)
    init_gloo(rank, 2, port, timeout_s=60)
    try:
        logits, target = _batch(9, shape=(6, 5, 6))
        target[1] = IGNORE
        mine = slice(0, 4) if rank == 0 else slice(4, 6)  # uneven shares, as 6 over 2 ranks x 2 micro-batches
        criterion = _loss(*COMBINED)
        one_pass = logits[mine].clone().requires_grad_(True)
        share = criterion({"out": one_pass}, target[mine])  # normalizers all-reduced inside
        share.backward()
        accumulated = logits[mine].clone().requires_grad_(True)
        sizes = [3, 1] if rank == 0 else [1, 1]
        shares = _split_shares(criterion, accumulated, target[mine], sizes)
        torch.stack(shares).sum().backward()
        torch.save({"share": share.detach(), "accumulated": torch.stack(shares).sum().detach(),
                    "grad": one_pass.grad, "accumulated_grad": accumulated.grad}, folder / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_processes_with_and_without_micro_batches_give_one_big_batch(tmp_path):
    start_ranks(_rank_worker, (free_port(), tmp_path), 2)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    logits, target = _batch(9, shape=(6, 5, 6))
    target[1] = IGNORE
    logits.requires_grad_(True)
    whole = _loss(*COMBINED)({"out": logits}, target)
    whole.backward()
    for key, grad_key in (("share", "grad"), ("accumulated", "accumulated_grad")):
        assert abs(float(ranks[0][key] + ranks[1][key]) - float(whole.detach())) < 1e-12, key
        torch.testing.assert_close(torch.cat([ranks[0][grad_key], ranks[1][grad_key]]), logits.grad, rtol=0, atol=1e-12)


# -------------------------------------------------------- segmentation_models_pytorch, where installed
def test_dice_and_lovasz_equal_segmentation_models_pytorch():
    smp_losses = pytest.importorskip("segmentation_models_pytorch.losses")
    logits, target = _batch(10)
    ours_dice = float(_loss(("dice", 1.0))({"out": logits}, target))
    ours_lovasz = float(_loss(("lovasz", 1.0))({"out": logits}, target))
    dice, lovasz = [], []
    for z, t in zip(logits.split(1), target.split(1)):  # per image; SMP's Dice is over its whole batch
        present = sorted(set(t[t != IGNORE].tolist()))
        dice.append(float(smp_losses.DiceLoss("multiclass", classes=present, from_logits=True, smooth=0.0,
                                              ignore_index=IGNORE, eps=0.0)(z, t)))
        # float32: SMP's Lovasz gradient is computed in float32 whatever the input
        lovasz.append(float(smp_losses.LovaszLoss("multiclass", per_image=True, ignore_index=IGNORE)(z.float(), t)))
    assert abs(ours_dice - np.mean(dice)) < 1e-6
    assert abs(ours_lovasz - np.mean(lovasz)) < 1e-6
