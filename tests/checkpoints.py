"""A checkpoint of a randomly initialized tiny model, in the checkpoint format, for tests of what reads one."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from syncseg.engine.checkpoint_file import FORMAT_VERSION, save_checkpoint
from syncseg.engine.config import Config, load_config, to_dict


def save_random_checkpoint(path: Path, overrides: list[str], classes: list[str], *, seed: int,
                           iteration: int) -> tuple[Config, nn.Module]:
    """Save a model built from the default config with `overrides` (random weights from `seed`, running
    means moved off zero so that BatchNorm matters) at `path`; returns (its config, the model in eval mode)."""
    from syncseg.model.builder import build_model

    config = load_config(None, overrides)
    torch.manual_seed(seed)
    model = build_model(config.model, len(classes), in_channels=config.data.in_channels)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-0.1, 0.1)
    save_checkpoint(path, {"format_version": FORMAT_VERSION, "model": model.state_dict(), "config": to_dict(config),
                           "classes": list(classes), "iteration": iteration})
    return config, model.eval()
