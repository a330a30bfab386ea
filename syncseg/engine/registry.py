"""The engine's extension points: loss terms (train.loss names) and export formats (export.py --format).

Entries name their code by "package.module:function" strings (or hold the callable, for a user's own
entry), so this module imports no torch: the config schema and the commands' --help read it.

A loss term computes `(loss, inputs) -> (loss sum, local normalizer)` for one head, where `loss` is the
SegmentationLoss (its settings: focal_gamma, OHEM, ...) and `inputs` a syncseg.engine.loss_terms.TermInputs
(logits, target, the valid-pixel mask, per-pixel class weights); SegmentationLoss divides the sum by the
normalizer summed over the global batch (docs/extending.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

from syncseg.lazy_registry import Registry

PIXELS, IMAGES = "pixels", "images"  # what a loss term's sum is divided by, over the global batch


@dataclass(frozen=True)
class LossTerm:
    """A train.loss name: its `compute` function and how it is normalized."""

    compute: str | Callable[..., Any]
    normalized_by: Literal["pixels", "images"]  # the sum of valid pixels' weights, or of images with a valid pixel
    weighs_classes: bool = False  # train.class_weights apply to it


@dataclass(frozen=True)
class ExportFormat:
    """An export.py --format value and what it writes."""

    description: str


LOSS_TERMS: Registry[LossTerm] = Registry("train.loss")
EXPORT_FORMATS: Registry[ExportFormat] = Registry("--format")


def register_loss_term(name: str, compute: str | Callable[..., Any], *, normalized_by: Literal["pixels", "images"],
                       weighs_classes: bool = False) -> LossTerm:
    """Make `name` a valid train.loss term computed by `compute` (the contract above)."""
    if normalized_by not in (PIXELS, IMAGES):
        raise ValueError(f"loss term '{name}': normalized_by={normalized_by!r} is not one of {PIXELS}, {IMAGES}")
    return LOSS_TERMS.register(name, LossTerm(compute, normalized_by, weighs_classes))


_TERMS = "syncseg.engine.loss_terms"
register_loss_term("ce", f"{_TERMS}:cross_entropy_term", normalized_by=PIXELS, weighs_classes=True)
register_loss_term("dice", f"{_TERMS}:dice_term", normalized_by=IMAGES)
register_loss_term("focal", f"{_TERMS}:focal_term", normalized_by=PIXELS, weighs_classes=True)
register_loss_term("lovasz", f"{_TERMS}:lovasz_term", normalized_by=IMAGES)

EXPORT_FORMATS.register("onnx", ExportFormat("torch.onnx dynamo exporter"))
EXPORT_FORMATS.register("torchscript", ExportFormat("traced"))
EXPORT_FORMATS.register("exported", ExportFormat("torch.export .pt2 program"))
EXPORT_FORMATS.register("safetensors", ExportFormat(
    "the weights with config and classes as metadata, for a release; eval.py, predict.py and "
    "model.init_checkpoint read it"))
