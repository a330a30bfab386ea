"""DeepLabV3 / V3+ networks with synchronized BatchNorm.

Kept light: importing `model` (or `model.sync_batchnorm`) loads nothing else; the builder functions are
imported on first use.
"""
from __future__ import annotations

from typing import Any

__all__ = ["build_model", "build_param_groups", "load_segmentation_weights"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from model import builder

        return getattr(builder, name)
    raise AttributeError(f"module 'model' has no attribute {name!r}")
