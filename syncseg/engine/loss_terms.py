"""The loss terms besides cross-entropy (syncseg/engine/loss.py): focal, Dice and Lovasz-Softmax, each as the pair
(loss sum, local normalizer) that SegmentationLoss divides over the global batch.

Two kinds of reduction, both exact under any split of the global batch over processes and
micro-batches (tested in float64 against one big batch):

- per pixel (focal, like cross-entropy): the sum of per-pixel losses (class-weighted), divided by
  the global sum of the valid pixels' weights;
- per image (Dice, Lovasz): each image's loss is computed from its own valid pixels only, averaged
  over the classes present in its labels; the sum of these image losses is divided by the global
  number of images that have a valid pixel. This is Berman et al.'s `per_image=True` and mmseg's
  per-sample Dice. A batch-level Dice or Lovasz (intersections summed over the whole global batch)
  would need every micro-batch's prediction before the first backward pass, which gradient
  accumulation does not have; per image, a micro-batch's share is final when it is computed.

Inputs: logits N x C x H x W (float32 or float64), `target` N x H x W with ignored pixels replaced by 0
(`safe_target`) and `valid` marking the others.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class TermInputs:
    """What every loss term of one head gets (syncseg.engine.registry.LOSS_TERMS' `compute(loss, inputs)`)."""

    logits: torch.Tensor  # N x C x H x W, float32 or float64
    target: torch.Tensor  # N x H x W, the ignore label where unlabeled
    safe_target: torch.Tensor  # target with ignored pixels replaced by 0
    valid: torch.Tensor  # N x H x W bool: not ignored
    pixel_weight: torch.Tensor  # each pixel's class weight (train.class_weights; 1 without), 0 where ignored
    class_weights: torch.Tensor | None  # C values, or None


def cross_entropy_term(loss: Any, inputs: TermInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """train.loss `ce`: SegmentationLoss.cross_entropy_terms (class weights and OHEM are the loss's)."""
    return loss.cross_entropy_terms(inputs.logits, inputs.target, inputs.class_weights, inputs.valid,
                                    inputs.safe_target, inputs.pixel_weight)


def focal_term(loss: Any, inputs: TermInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """train.loss `focal`, with the loss's train.focal_gamma."""
    return focal_terms(inputs.logits, inputs.safe_target, inputs.pixel_weight, gamma=loss.focal_gamma)


def dice_term(loss: Any, inputs: TermInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """train.loss `dice`."""
    return dice_terms(inputs.logits, inputs.safe_target, inputs.valid)


def lovasz_term(loss: Any, inputs: TermInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """train.loss `lovasz`."""
    return lovasz_terms(inputs.logits, inputs.safe_target, inputs.valid)


def focal_terms(logits: torch.Tensor, safe_target: torch.Tensor, pixel_weight: torch.Tensor, *,
                gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax focal loss (Lin et al. 2017), -(1 - p_t)^gamma * log p_t per pixel, times `pixel_weight`
    (class weight of the pixel's label, 0 where ignored): (sum, sum of pixel_weight). gamma = 0 is
    cross-entropy."""
    log_p = F.log_softmax(logits, dim=1).gather(1, safe_target.unsqueeze(1)).squeeze(1)
    # clamped so that p_t == 1 (confident pixels round to it in float32) has a finite gradient for gamma < 1
    modulating = (1 - log_p.exp()).clamp_min(torch.finfo(log_p.dtype).tiny).pow(gamma)
    return -(modulating * log_p * pixel_weight).sum(), pixel_weight.sum()


def _present_class_counts(safe_target: torch.Tensor, valid: torch.Tensor, num_classes: int,
                          values: torch.Tensor) -> torch.Tensor:
    """N x C sums of `values` (N x H x W) over each image's valid pixels of each label."""
    sums = values.new_zeros(values.shape[0], num_classes)
    return sums.scatter_add_(1, safe_target.flatten(1), (values * valid).flatten(1))


def dice_terms(logits: torch.Tensor, safe_target: torch.Tensor,
               valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft Dice per image: for each class c present in the image's valid labels,
    1 - 2 * sum(p_c * y_c) / (sum(p_c) + sum(y_c)) over its valid pixels, averaged over those classes
    (Milletari et al. 2016 without the square; SMP's DiceLoss on one image with classes = the present
    ones). Returns (sum over images, number of images with a valid pixel)."""
    probabilities = logits.softmax(dim=1)
    num_classes = probabilities.shape[1]
    valid = valid.to(probabilities.dtype)
    true_probability = probabilities.gather(1, safe_target.unsqueeze(1)).squeeze(1)
    intersection = _present_class_counts(safe_target, valid, num_classes, true_probability)
    label_count = _present_class_counts(safe_target, valid, num_classes, torch.ones_like(valid))
    cardinality = (probabilities * valid.unsqueeze(1)).sum(dim=(2, 3)) + label_count
    present = label_count > 0
    per_class = torch.where(present, 1 - 2 * intersection / cardinality.clamp_min(1e-12), 0)
    num_present = present.sum(dim=1)
    per_image = per_class.sum(dim=1) / num_present.clamp_min(1)
    return per_image.sum(), (num_present > 0).sum().to(probabilities.dtype)


def lovasz_gradient(foreground_sorted: torch.Tensor) -> torch.Tensor:
    """Berman et al.'s Algorithm 1, column by column: the gradient of the Lovasz extension of the Jaccard
    loss for P x K foreground indicators sorted by decreasing error (each column holds a foreground)."""
    foreground_total = foreground_sorted.sum(dim=0)
    intersection = foreground_total - foreground_sorted.cumsum(dim=0)
    union = foreground_total + (1 - foreground_sorted).cumsum(dim=0)
    jaccard = 1 - intersection / union
    jaccard[1:] = jaccard[1:] - jaccard[:-1]
    return jaccard


def lovasz_terms(logits: torch.Tensor, safe_target: torch.Tensor,
                 valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lovasz-Softmax (Berman et al. 2018) per image, over the classes present in its valid labels
    (`classes='present', per_image=True`). Returns (sum over images, number of images with a valid pixel)."""
    probabilities = logits.softmax(dim=1)
    total, num_images = probabilities.sum() * 0, 0
    for image_probabilities, labels, mask in zip(probabilities, safe_target, valid):
        mask = mask.flatten()
        if not bool(mask.any()):
            continue
        labels = labels.flatten()[mask]
        classes = labels.unique()
        foreground = (labels.unsqueeze(1) == classes.unsqueeze(0)).to(probabilities.dtype)  # P x K
        class_probabilities = image_probabilities.flatten(1)[classes][:, mask].t()  # P x K
        errors_sorted, order = (foreground - class_probabilities).abs().sort(dim=0, descending=True)
        gradient = lovasz_gradient(foreground.gather(0, order))
        total = total + (errors_sorted * gradient).sum(dim=0).mean()
        num_images += 1
    return total, torch.tensor(float(num_images), dtype=probabilities.dtype, device=probabilities.device)
