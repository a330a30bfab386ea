"""A checkpoint of a randomly initialized tiny model, in the checkpoint format, for tests of what reads one."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from syncseg.engine.checkpoint_file import FORMAT_VERSION, save_checkpoint
from syncseg.engine.config import Config, load_config, to_dict

# a DeepLabV3+ / ResNet-18 small enough to export and run in a few seconds, and the same on 16-bit, 6-band data
TINY_MODEL = ["model.backbone=resnet18", "model.head_channels=32", "model.aspp_rates=1,2,3", "data.crop_size=64",
              "eval.amp=off"]
SIX_BANDS = ["data.dataset=folder", "data.num_classes=4", "data.in_channels=6", "data.max_value=65535",
             "data.mean=0.4,0.4,0.4,0.5,0.5,0.5", "data.std=0.2,0.2,0.2,0.25,0.25,0.25"]
TIE = 1e-4  # a class may differ from a reference's only where its two best logits are this close


def unexplained_differences(reference: torch.Tensor, classes: torch.Tensor) -> tuple[int, int]:
    """(pixels where `classes` (H x W) differs from the argmax of `reference` (C x H x W logits), those of
    them that are not near-ties of the reference's two best logits)."""
    top2 = reference.topk(2, dim=0).values
    near_tie = (top2[0] - top2[1]) <= TIE * max(1.0, float(reference.abs().max()))
    differ = reference.argmax(0) != torch.as_tensor(classes)
    return int(differ.sum()), int((differ & ~near_tie).sum())


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
