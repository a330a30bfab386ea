"""An exponential moving average of a model's weights (train.ema_decay), for validation and best.pt.

After every optimizer step each floating-point parameter becomes `decay * average + (1 - decay) * current`;
buffers (BatchNorm running statistics, counters) are copied, so the averaged model evaluates with the
statistics of the data the current model saw. Under DDP every process holds the same average without
any communication: the parameters it averages are the same on every process after the gradient
all-reduce. The average is a full copy of the model on its device (one model's memory more).
"""
from __future__ import annotations

import copy
import logging
from typing import Any, Mapping

import torch
from torch import nn

logger = logging.getLogger(__name__)


class ModelEMA:
    """`module`: the averaged copy of `model` (eval mode only; never trained). `decay` in [0, 1)."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"train.ema_decay={decay} must lie in [0, 1)")
        self.decay = float(decay)
        # process groups (model.syncbn_group_size) are shared, not copied: they cannot be
        memo = {id(group): group for group in (getattr(module, "process_group", None) for module in model.modules())
                if group is not None}
        self.module = copy.deepcopy(model, memo).eval().requires_grad_(False)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Move the average toward `model`'s current weights (the same architecture, unwrapped)."""
        for average, current in zip(self.module.parameters(), model.parameters()):
            average.lerp_(current.detach().to(average.dtype), 1.0 - self.decay)
        for average, current in zip(self.module.buffers(), model.buffers()):
            average.copy_(current)

    def state_dict(self) -> dict[str, Any]:
        return self.module.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.module.load_state_dict(state, strict=True)

    def resume(self, state: Mapping[str, Any] | None, model: nn.Module) -> None:
        """Continue from a checkpoint's averaged weights; without them (train.ema_decay turned on for a
        resumed run) the average starts at `model`'s resumed weights, with a warning."""
        if state is not None:
            self.load_state_dict(state)
            return
        logger.warning("train.ema_decay is on but the checkpoint has no averaged weights: averaging from here")
        self.module.load_state_dict(model.state_dict())


def best_after_decay_change(saved_decay: float, decay: float, best_miou: float) -> float:
    """The best mIoU a resumed run goes on comparing against when train.ema_decay differs from the
    checkpoint's (`saved_decay`), saying so once: a changed decay goes on averaging with the new one; turning
    averaging off resets the best (it was measured on the averaged weights, which validation no longer uses),
    so the next validation of the plain weights writes best.pt."""
    if decay == saved_decay:
        return best_miou
    if saved_decay > 0 and decay == 0:
        logger.warning("train.ema_decay=0 on resuming a run that averaged its weights (train.ema_decay=%g): its best "
                       "val mIoU %.4f was measured on the averaged weights, so the best is reset and the next "
                       "validation of the plain weights writes best.pt", saved_decay, best_miou)
        return -1.0
    if saved_decay > 0:
        logger.warning("train.ema_decay changed on resume from %g to %g: the average goes on with the new decay",
                       saved_decay, decay)
    return best_miou
