"""Segmentation metrics from one confusion matrix, kept on the device and all-reduced under DDP.

Rows are ground truth, columns predictions. Conventions (the same as torchmetrics'
MulticlassJaccardIndex and cityscapesscripts' pixel-level evaluation): a class absent from both
ground truth and prediction has IoU None ("n/a") and is left out of the mean; a class that is only
predicted has IoU 0 and counts.
"""
from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class ConfusionMatrix:
    """Accumulates a num_classes x num_classes int64 confusion matrix on `device`.

    `update(pred, target)` takes integer tensors of the same shape (any layout, e.g. N x H x W);
    pixels whose target equals `ignore_index` are skipped. A target outside [0, num_classes) that is
    not `ignore_index`, or a prediction outside [0, num_classes), raises ValueError.
    """

    def __init__(self, num_classes: int, *, ignore_index: int = 255, device: torch.device | str | None = None):
        if num_classes < 1:
            raise ValueError(f"ConfusionMatrix: num_classes={num_classes} must be >= 1")
        self.num_classes = int(num_classes)
        self.ignore_index = int(ignore_index)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.matrix = torch.zeros(self.num_classes, self.num_classes, dtype=torch.int64, device=self.device)

    def reset(self) -> None:
        self.matrix.zero_()

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
        # Why this shape of code: on CPU the cost is in elementwise passes over ~2M pixels, not in the
        # bincount. Boolean masking (target[valid]) is 6x slower than folding everything into one index:
        # row = target + 1, clamped to [0, last], so row 0 collects negative labels, rows 1..C the classes,
        # and every label >= C lands in rows past C; one bincount of row*C + pred in int32 then gives the
        # matrix plus the "ignored" and "invalid" counts for free.
        low, high = torch.aminmax(pred)
        if int(low) < 0 or int(high) >= classes:
            raise ValueError(f"ConfusionMatrix.update: predictions must lie in [0, {classes}), got values in "
                             f"[{int(low)}, {int(high)}]")
        ignore = self.ignore_index
        num_ignored = 0
        if 0 <= ignore < classes:
            # Ignoring a real class: rare, so the plain (slower) masking is fine.
            keep = target != ignore
            target, pred = target[keep], pred[keep]
        if ignore >= classes:
            top = ignore + 1  # rows: 0 negative, 1..C classes, C+1..ignore invalid, ignore+1 ignored, ignore+2 invalid
            ignore_row = ignore + 1
        else:
            top = classes  # rows: 0 negative (ignore_index < 0 included), 1..C classes, C+1 invalid
            ignore_row = None
            if ignore < 0:
                num_ignored = int((target == ignore).sum())
        num_rows = top + 2
        index_dtype = torch.int16 if num_rows * classes < 2**15 else torch.int32
        if target.dtype == torch.uint8 and top >= 255:
            rows = target.to(index_dtype) + 1  # uint8 is already within [0, top]
        else:
            rows = target.clamp(-1, top).to(index_dtype) + 1
        counts = torch.bincount(rows * classes + pred.to(index_dtype), minlength=num_rows * classes)
        block = counts[classes:classes + classes * classes]
        outside = counts.sum() - block.sum() - num_ignored
        if ignore_row is not None:
            outside = outside - counts[ignore_row * classes:(ignore_row + 1) * classes].sum()
        if int(outside) != 0:
            bad = target[(target != ignore) & ((target < 0) | (target >= classes))]
            raise ValueError(
                f"ConfusionMatrix.update: {bad.numel()} target pixel(s) outside [0, {classes}) and not "
                f"ignore_index={ignore} (e.g. {sorted(set(bad[:1000].tolist()))[:5]}); check the "
                "dataset's label mapping or data.num_classes"
            )
        self.matrix += block.view(classes, classes)

    def all_reduce(self) -> None:
        """Sum the matrix over the processes of torch.distributed; a no-op when it is not initialized.

        Every process must call it (a collective), whatever the number of images it saw.
        """
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(self.matrix, op=dist.ReduceOp.SUM)

    def compute(self) -> dict[str, Any]:
        """Metrics in float64 from the matrix (moved to the CPU once).

        Returns miou, iou (per class, None when the class is absent from truth and prediction),
        acc (per-class recall, None when absent from the truth), pixel_acc, mean_acc (over classes
        present in the truth), fwiou (IoU weighted by ground-truth frequency), num_pixels. Values are
        Python floats; nan when no pixel was counted.
        """
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
