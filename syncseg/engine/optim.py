"""The optimizer: parameter groups (backbone / head), SGD or AdamW over them, and the poly learning-rate
schedule with warmup."""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from syncseg.model.builder import unwrap_model


def build_param_groups(model: nn.Module, *, lr: float, head_lr_mult: float, weight_decay: float) -> list[dict]:
    """Optimizer parameter groups: "backbone" at `lr`, "head" (everything else) at `lr * head_lr_mult`.

    Each group: {"name", "params", "lr", "weight_decay"}. Only parameters with requires_grad are included;
    a group without any is left out. DataParallel / DistributedDataParallel wrappers are looked through.
    """
    model = unwrap_model(model)
    backbone = getattr(model, "backbone", None)
    if backbone is None:
        raise ValueError(f"build_param_groups expects a model with a 'backbone' attribute, got {type(model).__name__}")
    backbone_ids = {id(p) for p in backbone.parameters()}
    groups = {"backbone": [], "head": []}
    for parameter in model.parameters():
        if parameter.requires_grad:
            groups["backbone" if id(parameter) in backbone_ids else "head"].append(parameter)
    rates = {"backbone": lr, "head": lr * head_lr_mult}
    return [
        {"name": name, "params": params, "lr": rates[name], "weight_decay": weight_decay}
        for name, params in groups.items()
        if params
    ]


# Devices where torch's fused SGD/AdamW kernels run (torch 2.4+): one pass over every parameter of a group, where
# torch's CPU default loops over the tensors (the step's cost each way: benchmarks/bench_optim.py, docs/benchmarks.md)
_FUSED_DEVICE_TYPES = ("cpu", "cuda")


def fused_supported(param_groups: list[dict]) -> bool:
    """Whether every parameter in `param_groups` is a floating tensor on a device with fused optimizer kernels."""
    params = [p for group in param_groups for p in group["params"]]
    return bool(params) and all(p.device.type in _FUSED_DEVICE_TYPES and p.is_floating_point() for p in params)


def build_optimizer(param_groups: list[dict], train_cfg: Any) -> torch.optim.Optimizer:
    """SGD (momentum, no Nesterov) or AdamW over `param_groups` (from syncseg.model.builder.build_param_groups),
    fused where torch has the kernels for the parameters' device (the same update, other rounding)."""
    fused = fused_supported(param_groups)
    if train_cfg.optimizer == "adamw":
        return torch.optim.AdamW(param_groups, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay, fused=fused)
    return torch.optim.SGD(param_groups, lr=train_cfg.lr, momentum=train_cfg.momentum,
                           weight_decay=train_cfg.weight_decay, fused=fused)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Load a saved optimizer state (moments, step counts) but keep what this run configured: each group's
    base LR (`initial_lr`) and weight decay from the config, and the kernel choice of this build, so a
    checkpoint from before the optimizer was fused, or from another device, continues fused where it can.

    torch moves a loaded `step` to its parameter's device only when the *saved* group was fused or
    capturable; a fused or capturable group of this run gets its steps moved here (float32, the dtype
    torch's own policy gives them), or the fused CUDA kernel would receive host steps."""
    kept = ("initial_lr", "weight_decay", "fused", "foreach")
    configured = [{key: group[key] for key in kept if key in group} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, values in zip(optimizer.param_groups, configured):
        group.update(values)
        if not (group.get("fused") or group.get("capturable")):
            continue
        for param in group["params"]:
            param_state = optimizer.state.get(param, {})
            step = param_state.get("step")
            if isinstance(step, torch.Tensor) and (step.device != param.device or step.dtype != torch.float32):
                param_state["step"] = step.to(device=param.device, dtype=torch.float32)


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
