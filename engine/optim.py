"""The optimizer over model.builder's parameter groups, and the poly learning-rate schedule with warmup."""
from __future__ import annotations

from typing import Any, Mapping

import torch


def build_optimizer(param_groups: list[dict], train_cfg: Any) -> torch.optim.Optimizer:
    """SGD (momentum, no Nesterov) or AdamW over `param_groups` (from model.builder.build_param_groups)."""
    if train_cfg.optimizer == "adamw":
        return torch.optim.AdamW(param_groups, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay)
    return torch.optim.SGD(param_groups, lr=train_cfg.lr, momentum=train_cfg.momentum,
                           weight_decay=train_cfg.weight_decay)


def poly_warmup_factor(iteration: int, *, total_iters: int, power: float, warmup_iters: int) -> float:
    """LR multiplier for 0-based step `iteration`: (1 - it/total)^power, times a linear warmup
    (it+1)/warmup_iters over the first warmup_iters steps; 0 from total_iters on."""
    if iteration >= total_iters:
        return 0.0
    factor = (1.0 - iteration / total_iters) ** power
    if warmup_iters > 0 and iteration < warmup_iters:
        factor *= (iteration + 1) / warmup_iters
    return factor


class PolyWarmupLR:
    """Per-iteration poly schedule with linear warmup, applied to each group's `initial_lr`.

    The state is the iteration only; the total comes from the config, so resuming with a larger
    train.iters stretches the remaining schedule.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, total_iters: int, power: float = 0.9,
                 warmup_iters: int = 0) -> None:
        self.optimizer = optimizer
        self.total_iters = total_iters
        self.power = power
        self.warmup_iters = warmup_iters
        self.iteration = 0
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self._apply()

    def factor(self, iteration: int | None = None) -> float:
        """The multiplier of step `iteration` (default: the next step's)."""
        return poly_warmup_factor(self.iteration if iteration is None else iteration, total_iters=self.total_iters,
                                  power=self.power, warmup_iters=self.warmup_iters)

    def _apply(self) -> None:
        factor = self.factor()
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * factor

    def step(self) -> None:
        self.iteration += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, int]:
        return {"iteration": self.iteration}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.iteration = int(state["iteration"])
        self._apply()
