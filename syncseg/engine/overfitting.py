"""OverfittingWatch: says once, in the training log, when the training loss has fallen far below its start while
validation stopped improving (memorizing the training pixels), with the config keys that usually help.

The two signs, both needed:

- the training loss (the mean of the last RECENT_STEPS steps) is under LOSS_FRACTION of its start (the mean of
  the first START_STEPS steps of this fit: few, since a run without warmup can lose half its loss in 10
  steps). Cross-entropy starts near ln(num_classes) (1.9 for 7 classes); at 1% of that the true class gets
  ~0.98 of the probability on every labelled training pixel: what a run that memorizes a few labelled
  pixels reaches (issue 32: 0.002 from 1.9 at iteration 200), while healthy runs on full labels level off
  at a few percent of their start (VOC from scratch: ~0.1-0.2 from ~3);
- validation mIoU made no new best for the last PATIENCE validations (a single flat validation is noise).

best.pt needs nothing from here: it is written at each new best validation only (Trainer._validation), so it
keeps the best validation however the run goes on. A resumed run measures its start from where it resumed
(the losses before it are not in last.pt), which only makes the sign harder to reach.
"""
from __future__ import annotations

from collections import deque
from typing import Mapping

LOSS_FRACTION = 0.01
PATIENCE = 2  # validations without a new best
START_STEPS = 3
RECENT_STEPS = 10

ADVICE = (
    "augment more (data.scale_range wider, data.hflip, data.rot90 for images with no up such as overhead or "
    "microscope ones, a smaller data.crop_size), regularize (train.weight_decay higher, model.aspp_dropout, "
    "train.ema_decay), train fewer steps (train.iters; best.pt already keeps the best validation), or a lighter "
    "model (model.arch=deeplabv3, model.head_channels, model.backbone=resnet18); for few images or sparse labels "
    "start from configs/small_data.yaml (docs/own-data.md, \"Few images or sparse labels\")"
)


class OverfittingWatch:
    """Fed every step's training loss (`add_losses`) and every validation's mIoU (`after_validation`), in
    order; `after_validation` returns the warning the first time both signs hold (module docstring), and None
    every other time. `best_miou` is the best validation before this fit (a resume's), -1 when none."""

    def __init__(self, *, best_miou: float = -1.0, loss_fraction: float = LOSS_FRACTION, patience: int = PATIENCE,
                 start_steps: int = START_STEPS, recent_steps: int = RECENT_STEPS) -> None:
        self.loss_fraction, self.patience = loss_fraction, patience
        self.start_steps = start_steps
        self._start: list[float] = []
        self._recent: deque[float] = deque(maxlen=recent_steps)
        self.best_miou, self.best_iteration = best_miou, None
        self.validations_since_best = 0
        self.warned = False

    def add_losses(self, losses: Mapping[int, float]) -> None:
        """Steps' losses, {iteration: loss}, in any number per call; iterations in increasing order over calls."""
        for _, loss in sorted(losses.items()):
            if len(self._start) < self.start_steps:
                self._start.append(loss)
            self._recent.append(loss)

    @property
    def start_loss(self) -> float | None:
        return sum(self._start) / len(self._start) if self._start else None

    @property
    def recent_loss(self) -> float | None:
        return sum(self._recent) / len(self._recent) if self._recent else None

    def after_validation(self, iteration: int, miou: float) -> str | None:
        """Record the validation of `iteration`; the warning when it is due (once per watch), else None."""
        if miou > self.best_miou:
            self.best_miou, self.best_iteration, self.validations_since_best = miou, iteration, 0
        else:
            self.validations_since_best += 1
        start, recent = self.start_loss, self.recent_loss
        if self.warned or start is None or recent is None or start <= 0:
            return None
        if self.validations_since_best < self.patience or recent >= self.loss_fraction * start:
            return None
        self.warned = True
        since = f" since iteration {self.best_iteration}" if self.best_iteration is not None else ""
        share = 100 * recent / start
        return (f"overfitting: at iteration {iteration} the training loss ({recent:.4g}) is {share:.2g}% of its start"
                f" ({start:.4g}), but val mIoU has made no new best for {self.validations_since_best} "
                f"validations (best {self.best_miou:.4f}{since}; best.pt holds it): the model memorizes its "
                f"training pixels. What usually helps: {ADVICE}")
