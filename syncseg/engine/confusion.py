"""Segmentation metrics from one confusion matrix, kept on the device and all-reduced under DDP.

Rows are ground truth, columns predictions. Conventions (the same as torchmetrics'
MulticlassJaccardIndex and cityscapesscripts' pixel-level evaluation): a class absent from both
ground truth and prediction has IoU None ("n/a") and is left out of the mean; a class that is only
predicted has IoU 0 and counts.
"""
from __future__ import annotations

import logging
import math
import sys
from typing import Any

import torch

from syncseg.engine.distributed import all_reduce_sum

logger = logging.getLogger(__name__)


class ConfusionMatrix:
    """Accumulates a num_classes x num_classes int64 confusion matrix on `device`.

    `update(pred, target)` takes integer tensors of the same shape (any layout, e.g. N x H x W);
    pixels whose target equals `ignore_index` (data.ignore_index: the caller passes it, nothing here assumes one) are skipped. A target outside [0, num_classes) that is
    not `ignore_index`, or a prediction outside [0, num_classes), raises ValueError.
    """

    def __init__(self, num_classes: int, *, ignore_index: int, device: torch.device | str | None = None):
        if num_classes < 1:
            raise ValueError(f"ConfusionMatrix: num_classes={num_classes} must be >= 1")
        self.num_classes = int(num_classes)
        self.ignore_index = int(ignore_index)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.matrix = torch.zeros(self.num_classes, self.num_classes, dtype=torch.int64, device=self.device)
        # pixels of device batches whose values were out of range: counted on the device, raised by compute()
        self.invalid = torch.zeros(2, dtype=torch.int64, device=self.device)  # (predictions, targets)

    def reset(self) -> None:
        self.matrix.zero_()
        self.invalid.zero_()

    def update(self, pred: torch.Tensor, target: torch.Tensor) -> None:
        """Add one batch. `pred` and `target`: integer tensors of the same shape on `self.device`."""
        if pred.shape != target.shape:
            raise ValueError(f"ConfusionMatrix.update: prediction shape {tuple(pred.shape)} != target shape "
                             f"{tuple(target.shape)}")
        if pred.is_floating_point() or target.is_floating_point():
            raise ValueError("ConfusionMatrix.update: prediction and target must be integer tensors (class "
                             f"indices), got {pred.dtype} and {target.dtype}; take argmax of the logits first")
        if pred.numel() == 0:
            return
        classes = self.num_classes
        pred = pred.to(self.matrix.device).reshape(-1)
        target = target.to(self.matrix.device).reshape(-1)
        if self.matrix.device.type != "cpu":
            self._update_without_reads(pred, target)
            return
        # Why this shape of code: on CPU the cost is in passes over memory (two int64 tensors of 16 MB
        # at VOC's batch) and torch's one-thread bincount, not in arithmetic, and boolean masking
        # (target[valid]) is 5-10x slower than everything else together.
        # So the common case (ignore_index >= num_classes) never masks: one read each to check ranges,
        # one fused multiply-add into a narrow index, one bincount whose rows past num_classes hold the
        # ignored pixels (dropped) and any invalid label (detected from the counts, so it costs nothing).
        low, high = (int(value) for value in torch.aminmax(pred))
        if low < 0 or high >= classes:
            raise ValueError(f"ConfusionMatrix.update: predictions must lie in [0, {classes}), got values in "
                             f"[{low}, {high}]")
        ignore = self.ignore_index
        target_low, target_high = (int(value) for value in torch.aminmax(target))
        if 0 <= ignore < classes or (ignore < 0 and target_low < 0):
            # Ignoring a real class or a negative value: rare, so plain masking is fine.
            keep = target != ignore
            target, pred = target[keep], pred[keep]
            if target.numel() == 0:
                return
            target_low, target_high = (int(value) for value in torch.aminmax(target))
        if target_low < 0 or target_high > max(classes - 1, ignore):
            self._raise_invalid(target)
        num_bins = (target_high + 1) * classes
        if target.dtype in _NARROW and num_bins <= 2**15:
            # A compact target (the loaders' uint8 masks): narrowed copies are small, and an add of two
            # contiguous int16 tensors is vectorized.
            index = torch.add(pred.to(torch.int16), target.to(torch.int16), alpha=classes)
        elif num_bins <= 2**31:
            # int32 indices; for int64 the low words (a view, no copy) are the values, now that the ranges
            # are checked: one add reads both inputs and writes only the index, where narrowed copies
            # would read each input once more.
            index = torch.add(_low_int32(pred), _low_int32(target), alpha=classes)
        else:  # an ignore_index beyond int32 that occurs in the target
            index = torch.add(pred.long(), target.long(), alpha=classes)
        counts = torch.bincount(index, minlength=classes * classes)
        block = counts[:classes * classes]
        if target_high >= classes:  # rows past the classes: only the ignore_index row may hold pixels
            ignored = counts[ignore * classes:(ignore + 1) * classes].sum() if classes <= ignore <= target_high else 0
            if int(counts[classes * classes:].sum() - ignored) != 0:
                self._raise_invalid(target)
        self.matrix += block.view(classes, classes)

    def _update_without_reads(self, pred: torch.Tensor, target: torch.Tensor) -> None:
        """update() on an accelerator: nothing read back, so that validation never drains the device queue
        (the CPU path's range checks read four or five values per batch, and torch's CUDA bincount reads
        its input's minimum and maximum). Out-of-range values are counted here and raised by compute()."""
        classes, ignore = self.num_classes, self.ignore_index
        pred, target = pred.long(), target.long()
        bad_pred = (pred < 0) | (pred >= classes)
        ignored = target == ignore
        bad_target = ~ignored & ((target < 0) | (target >= classes))
        self.invalid += torch.stack([bad_pred.sum(), bad_target.sum()])
        keep = ~(ignored | bad_target | bad_pred)
        overflow = classes * classes  # the bin of every pixel not counted
        index = torch.where(keep, target * classes + pred, overflow)
        counts = torch.zeros(overflow + 1, dtype=torch.int64, device=index.device)
        counts.scatter_add_(0, index, index.new_ones(1).expand_as(index))  # no pixel-sized tensor of ones
        self.matrix += counts[:overflow].view(classes, classes)

    def _raise_invalid(self, target: torch.Tensor) -> None:
        classes, ignore = self.num_classes, self.ignore_index
        bad = target[(target != ignore) & ((target < 0) | (target >= classes))]
        raise ValueError(
            f"ConfusionMatrix.update: {bad.numel()} target pixel(s) outside [0, {classes}) and not "
            f"ignore_index={ignore} (e.g. {torch.unique(bad).tolist()[:5]}); check the dataset's label "
            "mapping or data.num_classes"
        )

    def all_reduce(self) -> None:
        """Sum the matrix over the processes of torch.distributed; a no-op when it is not initialized.

        Every process must call it (a collective), whatever the number of images it saw.
        """
        all_reduce_sum(self.matrix)
        all_reduce_sum(self.invalid)

    def compute(self) -> dict[str, Any]:
        """Metrics in float64 from the matrix (moved to the CPU once).

        Returns miou, iou (per class, None when the class is absent from truth and prediction),
        acc (per-class recall, None when absent from the truth), pixel_acc, mean_acc (over classes
        present in the truth), fwiou (IoU weighted by ground-truth frequency), num_pixels. Values are
        Python floats; nan when no pixel was counted.
        """
        bad_predictions, bad_targets = self.invalid.tolist()
        if bad_predictions or bad_targets:
            raise ValueError(
                f"ConfusionMatrix: {bad_predictions} predicted pixel(s) outside [0, {self.num_classes}) and "
                f"{bad_targets} target pixel(s) outside [0, {self.num_classes}) and not "
                f"ignore_index={self.ignore_index}; check the dataset's label mapping or data.num_classes")
        matrix = self.matrix.detach().to("cpu", torch.float64)
        true_positive = matrix.diagonal()
        truth = matrix.sum(dim=1)
        predicted = matrix.sum(dim=0)
        union = truth + predicted - true_positive
        total = float(matrix.sum())
        iou = [float(tp / u) if u > 0 else None for tp, u in zip(true_positive.tolist(), union.tolist())]
        acc = [float(tp / t) if t > 0 else None for tp, t in zip(true_positive.tolist(), truth.tolist())]
        present_iou = [value for value in iou if value is not None]
        present_acc = [value for value in acc if value is not None]
        nan = math.nan
        fwiou = nan
        if total > 0:
            fwiou = float(sum(t / total * value for t, value in zip(truth.tolist(), iou) if value is not None and t > 0))
        return {
            "miou": float(sum(present_iou) / len(present_iou)) if present_iou else nan,
            "iou": iou,
            "acc": acc,
            "pixel_acc": float(true_positive.sum() / total) if total > 0 else nan,
            "mean_acc": float(sum(present_acc) / len(present_acc)) if present_acc else nan,
            "fwiou": fwiou,
            "num_pixels": int(total),
        }


# Compact target dtypes (the data loaders give uint8 masks where the labels fit).
_NARROW = (torch.uint8, torch.int8, torch.int16)


def _low_int32(values: torch.Tensor) -> torch.Tensor:
    """`values` (integers known to lie in [0, 2**31)) as int32: for int64 on a little-endian machine a
    strided view of the low words (reading them costs what reading the int64 does, writing costs nothing)."""
    if values.dtype == torch.int32:
        return values
    if values.dtype == torch.int64 and sys.byteorder == "little":
        return values.contiguous().view(torch.int32)[::2]
    return values.to(torch.int32)
