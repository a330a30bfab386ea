"""SegmentationLoss: the weighted sum of train.loss's terms (cross-entropy with class weights and OHEM,
focal, Dice, Lovasz-Softmax; syncseg/engine/loss_terms.py) on the main and aux heads, each normalized over the
*global* batch.

`terms(outputs, target)` gives, per (head, term), the pair (loss sum, local normalizer): for
cross-entropy the sum of per-pixel losses and of per-pixel weights, whose ratio is the weighted mean
that `F.cross_entropy(..., weight=w, ignore_index=i)` computes; for Dice and Lovasz the sum of per-image
losses and the number of images with a valid pixel (syncseg/engine/loss_terms.py says why per image).
`forward` divides each loss sum by its normalizer summed over every process of torch.distributed (one
small all-reduce; outside torch.distributed the local sum), so the losses of all processes add up to
the loss of the global batch, however it is split, and their gradients add up to its gradient. With
gradient accumulation the divisors are those of the whole optimizer step (`target_weight` of every
micro-batch, all-reduced once, given as `step_weight`), so the micro-batches' losses and gradients add
up to the global batch's too.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from syncseg.engine.distributed import all_reduce_sum
from syncseg.engine.loss_terms import TermInputs
from syncseg.engine.registry import IMAGES, LOSS_TERMS, PIXELS
from syncseg.lazy_registry import load_object


def mask_check_is_free(device: torch.device) -> bool:
    """Whether checking mask values on `device` costs no host synchronization (a CPU tensor). On CUDA the
    training loader checks them on the CPU instead (syncseg.engine.samplers.MaskCheckingCollate): an
    out-of-range value reaching the loss there is a device-side assert that poisons the CUDA context."""
    return device.type == "cpu"


def check_mask_values(target: torch.Tensor, *, num_classes: int, ignore_index: int) -> None:
    """ValueError naming the first value of `target` (integer masks) that is neither a class index in
    0..num_classes-1 nor `ignore_index`. Reads the values back: call it where they are on the CPU."""
    valid = target != ignore_index
    low, high = (int(value) for value in torch.aminmax(torch.where(valid, target, torch.zeros_like(target))))
    if low < 0 or high >= num_classes:
        raise ValueError(f"mask value {low if low < 0 else high} is not a class index in 0..{num_classes - 1} "
                         f"nor ignore_index={ignore_index}")


def _safe_divide(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """numerator / denominator, 0 where nothing was counted (a batch of ignored pixels only)."""
    return torch.where(denominator > 0, numerator / denominator.clamp_min(1e-12), numerator * 0)


class SegmentationLoss(nn.Module):
    """out + aux_weight * aux, each the `terms`-weighted sum (train.loss: ((name, weight), ...)) of
    cross-entropy (the class-weighted, OHEM-filtered mean over valid pixels), focal (gamma `focal_gamma`,
    class-weighted), Dice and Lovasz-Softmax (means over images). Every term ignores `ignore_index`.

    OHEM keeps the cross-entropy pixels whose true-class probability is at most `ohem_thresh`, and at
    least the `ohem_min_kept` hardest ones. Every setting is required: build_loss takes them from the
    config, whose schema (syncseg.engine.config.schema.TrainConfig) holds the defaults.
    """

    def __init__(
        self,
        *,
        ignore_index: int,
        class_weights: Sequence[float] | None,
        ohem: bool,
        ohem_thresh: float,
        ohem_min_kept: int,
        aux_weight: float,
        terms: Sequence[tuple[str, float]],
        focal_gamma: float,
    ) -> None:
        super().__init__()
        self.loss_terms = tuple((name, float(weight)) for name, weight in terms)
        self.term_entries = {name: LOSS_TERMS.get(name) for name, _ in self.loss_terms}
        # the normalizers target_weight computes, in order (one per kind of reduction in use)
        self.normalizers = tuple(dict.fromkeys(entry.normalized_by for entry in self.term_entries.values()))
        self.focal_gamma = focal_gamma
        self.ignore_index = ignore_index
        weights = torch.tensor(list(class_weights), dtype=torch.float32) if class_weights else None
        self.register_buffer("class_weights", weights, persistent=False)
        self.ohem = ohem
        self.ohem_thresh = ohem_thresh
        self.ohem_min_kept = ohem_min_kept
        self.aux_weight = aux_weight

    def head_terms(self, logits: torch.Tensor, target: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """term name -> (loss sum, local normalizer) for logits N x C x H x W (any float dtype) and target N x H x W
        (any integer type: the training loader's masks are uint8)."""
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # half -> float32; float64 stays
        target = target.long()  # class indices: a uint8 index tensor would select by truth value
        num_classes = logits.shape[1]
        weights = self.class_weights
        if weights is not None:
            if weights.numel() != num_classes:
                raise ValueError(f"train.class_weights has {weights.numel()} values but the model predicts "
                                 f"{num_classes} classes")
            weights = weights.to(logits.device, logits.dtype)
        valid = target != self.ignore_index
        safe_target = torch.where(valid, target, torch.zeros_like(target))
        if mask_check_is_free(target.device):  # on CUDA the training loader has checked them on the CPU
            check_mask_values(target, num_classes=num_classes, ignore_index=self.ignore_index)
        pixel_weight = weights[safe_target] * valid if weights is not None else valid.to(logits.dtype)
        inputs = TermInputs(logits=logits, target=target, safe_target=safe_target, valid=valid,
                            pixel_weight=pixel_weight, class_weights=weights)
        return {name: load_object(entry.compute)(self, inputs) for name, entry in self.term_entries.items()}

    def cross_entropy_terms(self, logits: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None,
                            valid: torch.Tensor, safe_target: torch.Tensor,
                            pixel_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss sum, weight sum) of the (class-weighted, OHEM-filtered) cross-entropy; `pixel_weight` is
        each pixel's class weight (0 where ignored)."""
        losses = F.cross_entropy(logits, target, weight=weights, ignore_index=self.ignore_index, reduction="none")
        if self.ohem:
            keep = self._ohem_keep(logits.detach(), safe_target, valid)
            losses = losses * keep
            pixel_weight = pixel_weight * keep
        return losses.sum(), pixel_weight.sum()

    def _ohem_keep(self, logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        probability = logits.softmax(dim=1).gather(1, target.unsqueeze(1)).squeeze(1)
        probability = torch.where(valid, probability, torch.full_like(probability, 2.0))
        # Nothing is read back to the host: ignored pixels sort last (probability 2), so the k-th smallest
        # over all pixels, k = min(min_kept, pixels), is the k-th valid one when there are k valid pixels, and
        # otherwise 2, which keeps every valid pixel, as taking the last valid one would.
        threshold: float | torch.Tensor = self.ohem_thresh
        if self.ohem_min_kept > 0 and probability.numel() > 0:
            kth = min(self.ohem_min_kept, probability.numel())
            threshold = probability.flatten().kthvalue(kth).values.clamp_min(self.ohem_thresh)
        # `<=` keeps the min_kept-th pixel itself; ties at the threshold are kept too.
        return (valid & (probability <= threshold)).to(logits.dtype)

    def terms(self, outputs: Mapping[str, torch.Tensor],
              target: torch.Tensor) -> dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]]:
        """(head, term name) -> (loss sum, local normalizer), for the heads "out" and (if present) "aux"."""
        heads = {"out": outputs["out"]}
        if "aux" in outputs:  # even at weight 0: DDP expects a gradient for every parameter
            heads["aux"] = outputs["aux"]
        return {(head, name): pair for head, logits in heads.items()
                for name, pair in self.head_terms(logits, target).items()}

    def head_factor(self, name: str) -> float:
        return 1.0 if name == "out" else self.aux_weight

    def target_weight(self, target: torch.Tensor) -> torch.Tensor:
        """What the terms divide by for `target` N x H x W, known before the forward pass when there is no
        OHEM: one value per entry of `normalizers`, in order: the sum of per-pixel weights (valid pixels,
        class-weighted) and the number of images with a valid pixel."""
        if self.ohem:  # so the config refuses OHEM with accumulation (syncseg.engine.config.schema.validate)
            raise RuntimeError("SegmentationLoss.target_weight: with OHEM the weights depend on the logits")
        target = target.long()  # class indices: a uint8 index tensor would select by truth value
        valid = target != self.ignore_index
        values = {IMAGES: valid.flatten(1).any(dim=1).to(torch.float32).sum()}
        if self.class_weights is None:
            values[PIXELS] = valid.to(torch.float32).sum()
        else:
            weights = self.class_weights.to(target.device)
            # clamped: a mask value out of range is head_terms' error to report, with its message
            safe_target = torch.where(valid, target, torch.zeros_like(target)).clamp(0, weights.numel() - 1)
            values[PIXELS] = (weights[safe_target] * valid).sum()
        return torch.stack([values[kind] for kind in self.normalizers])

    def forward(self, outputs: Mapping[str, torch.Tensor], target: torch.Tensor, *,
                step_weight: torch.Tensor | None = None) -> torch.Tensor:
        """This process's share of the global-batch loss (the loss itself outside torch.distributed).

        `step_weight`: the all-reduced `target_weight` of every micro-batch of the optimizer step
        (gradient accumulation); None divides by this batch's normalizers, all-reduced here.
        """
        terms = self.terms(outputs, target)
        if step_weight is None:
            weights = torch.stack([weight.detach() for _, weight in terms.values()])
            all_reduce_sum(weights)
        else:  # every head shares the target, hence its normalizers
            step_weight = step_weight.detach().to(target.device).float().reshape(len(self.normalizers))
            weights = torch.stack([step_weight[self.normalizers.index(self.term_entries[name].normalized_by)]
                                   for _, name in terms])
        term_weights = dict(self.loss_terms)
        total = torch.zeros((), device=target.device)
        for ((head, name), (loss_sum, _)), weight in zip(terms.items(), weights):
            total = total + self.head_factor(head) * term_weights[name] * _safe_divide(loss_sum, weight)
        return total


def build_loss(train_cfg: Any, *, ignore_index: int) -> SegmentationLoss:
    """The loss configured by a `train` config section, ignoring `ignore_index` (data.ignore_index)."""
    return SegmentationLoss(
        ignore_index=ignore_index,
        class_weights=tuple(train_cfg.class_weights) or None,
        ohem=train_cfg.ohem,
        ohem_thresh=train_cfg.ohem_thresh,
        ohem_min_kept=train_cfg.ohem_min_kept,
        aux_weight=train_cfg.aux_weight,
        terms=train_cfg.loss,
        focal_gamma=train_cfg.focal_gamma,
    )
